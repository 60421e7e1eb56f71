"""The session engine: open a session on an image once, answer many questions cheaply.

``open`` decodes and encodes the image once (vision tower + projector) and prefills the
conversation prefix (system prompt and image). Each ``generate`` chat-templates the FULL
conversation, tokenizes it, reuses the session's KV cache for the longest common token prefix,
prefills only the rest and decodes. A follow-up question therefore costs the prefill of its own
tokens plus decode, and gives exactly the tokens a from-scratch ``model.generate`` on the same
templated conversation gives (fp32).

Generation is step-wise: :meth:`SessionEngine.start` returns a :class:`Generation`, an iterator of
:class:`TokenEvent` (one forward pass per step), so callers can stream and interleave sessions;
:meth:`SessionEngine.generate` is the plain call built on it. No HTTP, no JSON, no TorchServe.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from .errors import ErrorCode, ServiceError
from .model import BatchKVCache, Chat, LlavaRunner, Turn, cache_len, common_prefix_len, crop_cache
from .sampling import IncrementalDetokenizer, Sampler, SamplingParams
from .sessions import Session, SessionStore, Tier

log = logging.getLogger(__name__)


#: Why an answer ended: ``stop`` (EOS or a stop sequence) or ``length`` (max_new_tokens reached).
FinishReason = Literal["stop", "length"]
#: What happens when a turn does not fit the context (:meth:`SessionEngine.start`).
ContextPolicy = Literal["truncate", "error"]
#: Prefill tokens a scheduler step runs at least, whatever the decode rows took of its budget.
MIN_PREFILL_TOKENS = 16
#: The tier a demoted session was rebuilt from.
RestoredFrom = Literal["features", "image"]


def _ms(t0: float, t1: float | None = None) -> float:
    return round(((time.perf_counter() if t1 is None else t1) - t0) * 1000.0, 3)


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()


def _oom_retry(fn: Callable[[], Any], store: SessionStore, *, keep: Session | None) -> Any:
    """Run ``fn``; on a CUDA out-of-memory error demote every idle session but ``keep`` and retry
    once, else raise ServiceError(overloaded)."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001
        if not _is_oom(exc):
            raise
        log.warning("out of memory; demoting idle sessions and retrying once")
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        store.demote_all(keep=keep)
        try:
            return fn()
        except Exception as exc2:  # noqa: BLE001
            if _is_oom(exc2):
                raise ServiceError(
                    ErrorCode.OVERLOADED, "the device is out of memory; retry later", retry_after_s=2
                ) from exc2
            raise


def available_host_bytes() -> int:
    """Host memory available now (``sysconf`` available pages x page size), bytes."""
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def default_device_budget(runner: LlavaRunner, fraction: float) -> int:
    """``fraction`` of the device memory free now (CUDA ``mem_get_info``), or of available host
    memory (:func:`available_host_bytes`) on CPU; bytes."""
    if runner.device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(runner.device)
    else:
        free = available_host_bytes()
    return max(1, int(free * fraction))


@dataclass(frozen=True)
class TokenEvent:
    """One generated token: ``id``, the text it completes (a detokenization delta; may be ``""``),
    its ``logprob`` (None unless asked for) and whether it is a ``special`` token (EOS)."""

    id: int
    text: str
    logprob: float | None
    special: bool = False


@dataclass
class Answer:
    """A finished answer.

    Attributes:
        text: the answer text (the concatenation of the events' texts).
        finish_reason: ``stop`` (EOS or a stop sequence) or ``length`` (max_new_tokens reached).
        prompt_tokens: tokens of the templated conversation (system, image, history, question).
        cached_tokens: of those, how many came from the session's KV cache (not prefilled).
        generated_tokens: tokens generated (EOS included when it ended the answer).
        tokens: the token events.
        timings: ms — ``restore`` (re-encode/features work for a demoted session), ``prefill``,
            ``ttft`` (request start → first token), ``total``; and ``decode_tokens_per_s``.
        seed: the sampler's seed (None for greedy).
        restored_from: the tier the session was restored from, or None when it was a KV hit.
        max_new_tokens: the limit the answer ran under (possibly clipped to the room left).
        truncated_turns: oldest remembered turns that left the context (and the history) for it.
    """

    text: str
    finish_reason: FinishReason
    prompt_tokens: int
    cached_tokens: int
    generated_tokens: int
    tokens: list[TokenEvent]
    timings: dict[str, float]
    seed: int | None = None
    restored_from: RestoredFrom | None = None
    max_new_tokens: int = 0
    truncated_turns: int = 0


@dataclass(frozen=True)
class OpenResult:
    """Result of :meth:`SessionEngine.open`: ``expires_at`` in epoch s; ``image_tokens`` placeholders
    of the image (they depend on its size for anyres models); ``prefix_tokens`` prefilled; ``timings`` in ms: ``encode`` (vision tower + projector),
    ``prefill``, ``total``, and ``decode`` when ``open`` decoded the image itself."""

    session_id: str
    expires_at: int
    image_tokens: int
    prefix_tokens: int
    timings: dict[str, float]


@dataclass(frozen=True)
class AddImageResult:
    """Result of :meth:`SessionEngine.add_image`: ``image_tokens`` placeholders of the new image;
    ``images`` the session holds now; ``prefix_tokens`` of the conversation up to the next question;
    ``cached_tokens`` of those reused from the KV cache (not prefilled); ``timings`` in ms: ``encode``
    (vision tower + projector), ``prefill``, ``total``, and ``decode`` when decoded here."""

    session_id: str
    image_tokens: int
    images: int
    prefix_tokens: int
    cached_tokens: int
    timings: dict[str, float]


@dataclass
class EngineLimits:
    """Per-request limits: ``max_new_tokens_cap`` and ``max_prompt_tokens`` (tokens of one prompt);
    per-session limits: ``max_images`` (images a session holds, the opening one included) and
    ``max_image_tokens`` (placeholder tokens of all its images; 0: only the model's context)."""

    max_new_tokens_cap: int = 1024
    max_prompt_tokens: int = 2048
    max_images: int = 8
    max_image_tokens: int = 0


class SessionEngine:
    """Sessions on one model: open, generate (step-wise), reset, close, under a memory budget.

    Args:
        runner: the loaded model.
        store: the session store (budget, TTL).
        decode_image: ``bytes -> RGB PIL image``; raises ServiceError(image_invalid | image_too_large).
        limits: per-request limits.
    """

    def __init__(
        self,
        runner: LlavaRunner,
        store: SessionStore,
        decode_image: Callable[[bytes], Any],
        limits: EngineLimits | None = None,
    ) -> None:
        self.runner = runner
        self.store = store
        self.decode_image = decode_image
        self.limits = limits or EngineLimits()
        self.batch = DecodeBatch(runner, store)
        self.num_reused_tokens = 0  # counters for metrics
        self.num_prefilled_tokens = 0
        self.num_generated_tokens = 0  # tokens sampled (every answer, finished or abandoned)

    # ------------------------------------------------------------------ lifecycle
    def open(
        self,
        session_id: str,
        image_bytes: bytes,
        system_prompt: str | None = None,
        *,
        image: Any = None,
        history: list[Turn] | None = None,
        history_images: Sequence[tuple[bytes, Any]] = (),
    ) -> OpenResult:
        """Open a session: decode + encode the image once and prefill the conversation prefix.

        The whole open in one call (:meth:`begin_open`, then its steps without a token budget).
        With ``history``, the session starts with those turns remembered (a restored conversation)
        and the prefix prefilled covers them too, so the next question prefills only itself.

        Args:
            session_id: the new session's id.
            image_bytes: the encoded image (JPEG, PNG, ...).
            system_prompt: optional system message, templated first.
            image: ``image_bytes`` already decoded (RGB PIL image), to skip decoding here.
            history: past turns to restore (their prompts must not contain the image placeholder).

        Raises:
            ServiceError: image_invalid / image_too_large (bad image), overloaded (no room: the
                session is not opened), invalid_request (id already open), invalid_parameter (the
                image placeholder in a history prompt), context_length_exceeded (history too long).
        """
        task = self.begin_open(
            session_id, image_bytes, system_prompt, image=image, history=history, history_images=history_images
        )
        while not task.done:
            self.step([task])
        if task.error is not None:
            raise task.error
        assert task.result is not None
        return task.result

    def begin_open(
        self,
        session_id: str,
        image_bytes: bytes,
        system_prompt: str | None = None,
        *,
        image: Any = None,
        history: list[Turn] | None = None,
        history_images: Sequence[tuple[bytes, Any]] = (),
    ) -> OpenTask:
        """Admit a new session and return its :class:`OpenTask` (the vision tower and the prefix
        prefill run in later :meth:`step` calls). The session is held (busy) from now on.

        Arguments as :meth:`open`; ``history_images``: ``(encoded bytes, decoded image)`` of the images
        the restored turns' ``images`` counts place (in order), for a conversation about several images.

        Raises:
            ServiceError: as :meth:`open`, for everything decided before any model work (the image
                decodes, the id is new, the history fits, there is room).
        """
        history = list(history or [])
        if any(self.runner.image_token in t.prompt or self.runner.image_token in t.answer for t in history):
            raise ServiceError(
                ErrorCode.INVALID_PARAMETER,
                f"history must not contain the image placeholder {self.runner.image_token!r}",
            )
        t0 = time.perf_counter()
        decoded_here = image is None
        image = self.decode_image(image_bytes) if image is None else image
        decode_ms = _ms(t0) if decoded_here else None
        if sum(t.images for t in history) != len(history_images):
            raise ServiceError(ErrorCode.INVALID_PARAMETER, "the history's image counts do not match its images")
        if 1 + len(history_images) > self.limits.max_images:
            raise ServiceError(
                ErrorCode.IMAGE_LIMIT_EXCEEDED, f"a session holds at most {self.limits.max_images} images"
            )
        session = self.store.new_session(session_id, image_bytes, system_prompt)
        decoded = [image] + [img for _, img in history_images]
        session.images += [data for data, _ in history_images]
        session.image_sizes = [(int(img.height), int(img.width)) for img in decoded]
        session.image_tokens = [self.runner.image_token_count(size, len(decoded)) for size in session.image_sizes]
        self._check_image_tokens(session.image_tokens)
        if history:  # the opening image opens the first restored question
            first = history[0]
            history[0] = Turn(first.prompt, first.answer, first.images + 1)
            session.pending_images = 0
        session.history = history
        prefix = self.runner.prefix_ids(session.chat())
        if len(prefix) >= self.runner.max_positions:
            what = "the image and the restored history are" if history else "the image is"
            raise ServiceError(
                ErrorCode.CONTEXT_LENGTH_EXCEEDED,
                f"{what} {len(prefix)} tokens, over the model's context of {self.runner.max_positions} tokens",
            )
        self.store.add(session)  # admission first: nothing is computed for a session that cannot be held
        session.busy = True
        if not self.store.reserve(self.new_session_bytes(len(prefix), sum(session.image_tokens)), keep=session):
            session.busy = False
            self.store.remove(session_id)
            raise ServiceError(ErrorCode.OVERLOADED, "not enough device memory for a new session", retry_after_s=5)
        return OpenTask(self, session, decoded, prefix, t0, decode_ms)

    def add_image(self, session_id: str, image_bytes: bytes, *, image: Any = None) -> AddImageResult:
        """Append an image to a session's conversation: it opens the next question, which may refer
        to every image. The whole add in one call (:meth:`begin_add_image`, then its steps).

        Raises:
            ServiceError: as :meth:`begin_add_image`, and image_invalid / overloaded from its steps
                (the session is then as before).
        """
        task = self.begin_add_image(session_id, image_bytes, image=image)
        while not task.done:
            self.step([task])
        if task.error is not None:
            raise task.error
        assert task.result is not None
        return task.result

    def begin_add_image(self, session_id: str, image_bytes: bytes, *, image: Any = None) -> AddImageTask:
        """Admit an added image and return its :class:`AddImageTask` (the vision tower and the prefill
        of the conversation up to the next question run in later :meth:`step` calls; the KV cache of
        everything before is reused). The session is busy until the task is done.

        Where the model lays out earlier images differently once there are several (LLaVA-OneVision:
        one base tile each), the earlier images are re-encoded too and the cache is reused up to the
        first image only: the answers stay those of the model on the whole conversation.

        Args:
            session_id: an open session.
            image_bytes: the encoded image (JPEG, PNG, ...).
            image: ``image_bytes`` already decoded (RGB PIL image), to skip decoding here.

        Raises:
            ServiceError: session_* (gone), session_busy, image_invalid / image_too_large,
                image_limit_exceeded (``max_images`` or ``max_image_tokens``), context_length_exceeded
                (the conversation with the image leaves no room for a question), overloaded (no
                device memory now).
        """
        session = self._get_idle(session_id)
        if len(session.images) >= self.limits.max_images:
            raise ServiceError(
                ErrorCode.IMAGE_LIMIT_EXCEEDED, f"a session holds at most {self.limits.max_images} images"
            )
        t0 = time.perf_counter()
        decoded_here = image is None
        image = self.decode_image(image_bytes) if image is None else image
        decode_ms = _ms(t0) if decoded_here else None
        sizes = [*session.image_sizes, (int(image.height), int(image.width))]
        tokens = [self.runner.image_token_count(size, len(sizes)) for size in sizes]
        self._check_image_tokens(tokens)
        chat = Chat(session.system_prompt, tuple(session.history), session.pending_images + 1, tuple(tokens))
        prefix = self.runner.prefix_ids(chat)
        if len(prefix) >= self.runner.max_positions:
            raise ServiceError(
                ErrorCode.CONTEXT_LENGTH_EXCEEDED,
                f"with this image the conversation is {len(prefix)} tokens, over the model's context of "
                f"{self.runner.max_positions} tokens; reset the session or open a new one",
            )
        relayout = tokens[:-1] != session.image_tokens
        feature_tokens = sum(tokens) if relayout or session.image_features is None else tokens[-1]
        reuse = 0 if relayout else common_prefix_len(session.cached_ids, prefix)
        need = feature_tokens * self._hidden_bytes() + (len(prefix) - reuse) * self.runner.kv_bytes_per_token
        session.busy = True
        if not self.store.reserve(need, keep=session):
            session.busy = False
            raise ServiceError(ErrorCode.OVERLOADED, "not enough device memory for the image now", retry_after_s=5)
        return AddImageTask(self, session, image, image_bytes, sizes, tokens, prefix, t0, decode_ms)

    def reset(self, session_id: str) -> None:
        """Forget the history, keep the images (and the cached prefix up to where the conversation
        changes): every image now opens the next question.

        Raises:
            ServiceError: session_not_found / _expired / _evicted, session_busy.
        """
        session = self._get_idle(session_id)
        session.history = []
        session.pending_images = len(session.images)  # every image opens the next question
        if session.kv_cache is not None:
            keep = common_prefix_len(session.cached_ids, self.runner.prefix_ids(session.chat()))
            crop_cache(session.kv_cache, keep)
            session.cached_ids = session.cached_ids[:keep]
        self.store.sync(session)

    def close(self, session_id: str) -> None:
        """Close the session and free everything it holds.

        Raises:
            ServiceError: session_not_found / _expired / _evicted, session_busy.
        """
        self._get_idle(session_id)
        self.store.remove(session_id)

    def history(self, session_id: str) -> list[Turn]:
        """The remembered turns of a session (a copy)."""
        return list(self.store.get(session_id).history)

    # ------------------------------------------------------------------ generation
    def start(
        self,
        session_id: str,
        prompt: str,
        params: SamplingParams | None = None,
        remember: bool = True,
        *,
        context_policy: ContextPolicy = "truncate",
        clip_max_new_tokens: bool = False,
    ) -> Generation:
        """Validate a question and return its :class:`Generation` (nothing computed yet).

        Context policy, when prompt tokens + ``max_new_tokens`` > the model's max positions:
        ``truncate`` drops the oldest remembered turns, one at a time, until the turn fits (the
        system prompt and the images never leave: a dropped turn's images open the first turn kept); if none is left and ``clip_max_new_tokens``,
        ``max_new_tokens`` is lowered to the room left. The dropped turns leave the session's
        history when the answer completes (an abandoned answer changes nothing), so the history
        is always what the model saw. ``error`` changes nothing and raises.

        Args:
            session_id: an open session.
            prompt: the user's question (plain text; must not contain the image placeholder).
            params: sampling parameters.
            remember: True: the turn joins the history; False: answered with the current history
                as context, then forgotten (the cache is cropped back).
            context_policy: ``truncate`` or ``error`` (above).
            clip_max_new_tokens: ``params.max_new_tokens`` is a default the request did not set,
                so it may be clipped to the room left.

        Raises:
            ServiceError: session_* (gone), session_busy, invalid_parameter (empty prompt, the
                image token in it, max_new_tokens over the cap, prompt too long),
                context_length_exceeded (the turn does not fit: under ``truncate``, not even with
                every remembered turn dropped).
        """
        params = params or SamplingParams()
        session = self._get_idle(session_id)
        if not prompt or not prompt.strip():
            raise ServiceError(ErrorCode.INVALID_PARAMETER, "prompt must not be empty")
        if self.runner.image_token in prompt:
            raise ServiceError(
                ErrorCode.INVALID_PARAMETER,
                f"prompt must not contain the image placeholder {self.runner.image_token!r}",
            )
        if params.max_new_tokens > self.limits.max_new_tokens_cap:
            raise ServiceError(
                ErrorCode.INVALID_PARAMETER, f"max_new_tokens must be <= {self.limits.max_new_tokens_cap}"
            )
        num_prompt = self.runner.count_text_tokens(prompt)
        if num_prompt > self.limits.max_prompt_tokens:
            raise ServiceError(
                ErrorCode.INVALID_PARAMETER,
                f"prompt is {num_prompt} tokens; at most {self.limits.max_prompt_tokens} are allowed",
            )
        chat = session.chat()
        ids = self.runner.conversation_ids(chat, prompt)
        limit = self.runner.max_positions
        max_new = params.max_new_tokens
        dropped = 0
        if len(ids) + max_new > limit and context_policy == "truncate":
            while dropped < len(chat.turns) and len(ids) + max_new > limit:
                dropped += 1
                ids = self.runner.conversation_ids(chat.without_oldest(dropped), prompt)
            if len(ids) + max_new > limit and clip_max_new_tokens and len(ids) < limit:
                max_new = limit - len(ids)
        if len(ids) + max_new > limit:
            hint = (
                "lower max_new_tokens or shorten the question"
                if context_policy == "truncate"
                else "lower max_new_tokens, reset the session, open a new one or use context_policy truncate"
            )
            raise ServiceError(
                ErrorCode.CONTEXT_LENGTH_EXCEEDED,
                f"this turn needs {len(ids)} prompt tokens + {max_new} new tokens = "
                f"{len(ids) + max_new}, over the model's context of {limit} tokens; {hint}",
            )
        if max_new != params.max_new_tokens:
            params = dataclasses.replace(params, max_new_tokens=max_new)
        return Generation(self, session, prompt, ids, params, remember, truncated_turns=dropped)

    def generate(
        self,
        session_id: str,
        prompt: str,
        params: SamplingParams | None = None,
        remember: bool = True,
        *,
        context_policy: ContextPolicy = "truncate",
        clip_max_new_tokens: bool = False,
    ) -> Answer:
        """Answer ``prompt`` in one call (runs :meth:`start`'s generation to the end).

        Raises:
            ServiceError: as :meth:`start`, and overloaded when memory runs out (session intact).
        """
        gen = self.start(
            session_id,
            prompt,
            params,
            remember,
            context_policy=context_policy,
            clip_max_new_tokens=clip_max_new_tokens,
        )
        for _ in gen:
            pass
        assert gen.answer is not None
        return gen.answer

    def step(self, work: Sequence[Generation | PrefixTask], *, prefill_budget: int | None = None) -> None:
        """Run one scheduler step over ``work``: every prefilled generation decodes one token,
        together, in one forward pass (rows of :attr:`batch`); then the prefill work runs in chunks
        within the token budget: questions first (restore, then the new tokens; one whose prefill
        completes samples its first token), then opens and added images (vision tower, then the
        prefix), each in arrival order.

        Args:
            work: generations and open tasks to advance (done ones are skipped).
            prefill_budget: most tokens this step runs (vLLM's ``max_num_batched_tokens``): the
                decode rows count one each, prefill chunks get the rest, but at least
                :data:`MIN_PREFILL_TOKENS`, so new work always moves. A vision tower takes the
                whole prefill share of its step. None: no limit (every prefill runs whole).

        A piece of work whose step fails gets its ``error`` set and its session left as before
        (an open's session is removed); the others are untouched. Never raises ``Exception``.
        """
        decoding = [w for w in work if isinstance(w, Generation) and not w.done and w.prefilled]
        if decoding:
            self._decode(decoding)
        budget = None if prefill_budget is None else max(prefill_budget - len(decoding), MIN_PREFILL_TOKENS)
        # questions first (a follow-up is a few tokens and a user waits for its first token), then opens
        for w in sorted(work, key=lambda w: isinstance(w, PrefixTask)):
            if w.done or (isinstance(w, Generation) and (w.prefilled or w in decoding)):
                continue
            if budget is not None and budget <= 0:
                break
            try:
                used = w._prefill_step(budget)
            except Exception as exc:  # noqa: BLE001 - one request's failure is that request's
                w._fail(exc)
                continue
            except BaseException:
                w._fail(RuntimeError("interrupted"))
                raise
            if budget is not None:
                budget -= used

    def _decode(self, decoding: list[Generation]) -> None:
        try:
            logits = self.batch.step(decoding)
        except Exception as exc:  # noqa: BLE001 - the batched step failed: each of its answers fails
            for g in decoding:
                g._fail(exc)
            return
        except BaseException:
            for g in decoding:
                g._abort()
            raise
        for g in decoding:
            assert g._row is not None
            try:
                g._accept(logits[g._row])
            except Exception as exc:  # noqa: BLE001
                g._fail(exc)

    def check_idle(self, session_id: str) -> None:
        """Check that ``session_id`` is open and not answering.

        Raises:
            ServiceError: session_not_found / _expired / _evicted, session_busy.
        """
        self._get_idle(session_id)

    # ------------------------------------------------------------------ internals
    def _get_idle(self, session_id: str) -> Session:
        session = self.store.get(session_id)
        if session.busy:
            raise ServiceError(
                ErrorCode.SESSION_BUSY, "the session is answering another request; wait for it to finish"
            )
        return session

    def new_session_bytes(self, num_prefix_tokens: int, num_image_tokens: int | None = None) -> int:
        """Device bytes a new session takes in the KV tier: its image features (``num_image_tokens``,
        default one base tile, x hidden x dtype bytes) plus the KV cache of its ``num_prefix_tokens``
        prefix tokens."""
        image_tokens = self.runner.num_image_tokens if num_image_tokens is None else num_image_tokens
        return image_tokens * self._hidden_bytes() + num_prefix_tokens * self.runner.kv_bytes_per_token

    def _check_image_tokens(self, image_tokens: Sequence[int]) -> None:
        """Raise ServiceError(image_limit_exceeded) when the images' placeholder tokens pass ``max_image_tokens``."""
        cap = self.limits.max_image_tokens
        if cap and sum(image_tokens) > cap:
            raise ServiceError(
                ErrorCode.IMAGE_LIMIT_EXCEEDED,
                f"the session's images would take {sum(image_tokens)} image tokens; at most {cap} are allowed",
            )

    def encode(self, session: Session, images: Sequence[Any]) -> torch.Tensor:
        """Encode ``images`` (the session's last ``len(images)``, in order) as laid out in the session's
        conversation now (:attr:`Session.image_tokens`); returns their rows ``[tokens, hidden]``.

        Raises:
            ServiceError: image_invalid; overloaded (out of device memory twice).
            RuntimeError: the model gave another row count than the processor's (a bug).
        """
        feats = self._oom_retry(lambda: self.runner.encode_images(images, len(session.images)), session)
        expected = session.image_tokens[len(session.images) - len(images) :]
        got = [int(f.shape[0]) for f in feats]
        if got != expected:
            raise RuntimeError(f"image features have {got} rows; the processor counts {expected}")
        return feats[0] if len(feats) == 1 else torch.cat(feats, dim=0)

    def _hidden_bytes(self) -> int:
        return self.runner.config.text_config.hidden_size * self.runner.dtype.itemsize

    def _oom_retry(self, fn: Callable[[], Any], session: Session) -> Any:
        return _oom_retry(fn, self.store, keep=session)

    def _prefill_chunk(
        self, session: Session, ids: list[int], budget: int | None, timings: dict[str, float]
    ) -> tuple[torch.Tensor, int]:
        """Prefill the next chunk of ``ids`` beyond ``session``'s cache: at most ``budget`` tokens
        (None: all of them). Updates the session's ``cached_ids``, the ledger, the prefill counter
        and ``timings["prefill"]`` (ms, accumulated).

        Returns:
            ``(logits [vocab] float32 of the chunk's last position, tokens prefilled)``.
        """
        t0 = time.perf_counter()
        start = cache_len(session.kv_cache)
        end = len(ids) if budget is None else min(len(ids), start + max(1, budget))
        runner = self.runner
        logits = self._oom_retry(lambda: runner.prefill(session.kv_cache, ids[:end], session.image_features), session)
        session.cached_ids = list(ids[:end])
        self.num_prefilled_tokens += end - start
        timings["prefill"] = round(timings.get("prefill", 0.0) + _ms(t0), 3)
        self.store.sync(session)
        return logits, end - start

    def _restore(self, session: Session) -> RestoredFrom | None:
        """Bring a demoted session back to a prefillable state; returns the tier it came from."""
        tier = session.tier
        if tier is Tier.KV:
            return None
        if tier is Tier.IMAGE:
            images = [self.decode_image(data) for data in session.images]
            if not self.store.reserve(sum(session.image_tokens) * self._hidden_bytes(), keep=session):
                raise ServiceError(
                    ErrorCode.OVERLOADED, "not enough device memory to restore the session", retry_after_s=5
                )
            session.image_features = self.encode(session, images)
        session.kv_cache = self.runner.new_cache()
        session.cached_ids = []
        session.num_restores += 1
        self.store.stats.num_restores += 1
        return "features" if tier is Tier.FEATURES else "image"


class PrefixTask:
    """Work that encodes images and then prefills the conversation up to the next question, in
    scheduler steps: an open (:class:`OpenTask`) or an added image (:class:`AddImageTask`).

    Advanced by :meth:`SessionEngine.step`: the first piece runs the vision tower (it takes the
    whole step's budget), the next ones prefill :attr:`prefix` in chunks. When done, :attr:`result`
    is set and the session is idle; when a step fails, :attr:`error` is set (what happens to the
    session is the subclass's :meth:`close`).
    """

    def __init__(
        self, engine: SessionEngine, session: Session, prefix: list[int], t0: float, decode_ms: float | None
    ) -> None:
        self.engine = engine
        self.session = session
        self.prefix = prefix
        self.error: Exception | None = None
        self.done = False
        self._encoded = False
        self._t0 = t0
        self._timings: dict[str, float] = {} if decode_ms is None else {"decode": decode_ms}

    @property
    def session_id(self) -> str:
        """The session the work is for."""
        return self.session.session_id

    def _encode(self) -> None:
        """Run the vision tower and leave the session ready to prefill :attr:`prefix`."""
        raise NotImplementedError

    def _finish(self) -> None:
        """Set :attr:`result` (the session is idle and enforced by then)."""
        raise NotImplementedError

    def close(self) -> None:
        """Abandon the work (client gone, or a failed step)."""
        raise NotImplementedError

    def _prefill_step(self, budget: int | None) -> int:
        """Run the next piece (the vision tower, which takes the whole ``budget``, or a prefix chunk
        of at most ``budget`` tokens; None: all of it); returns the tokens used."""
        engine, session = self.engine, self.session
        if not self._encoded:
            t = time.perf_counter()
            self._encode()
            self._encoded = True
            self._timings["encode"] = _ms(t)
            engine.store.sync(session)
            if budget is not None:
                return budget
        used = 0
        if cache_len(session.kv_cache) < len(self.prefix):
            _logits, used = engine._prefill_chunk(session, self.prefix, budget, self._timings)
        if cache_len(session.kv_cache) == len(self.prefix):
            session.busy = False
            engine.store.enforce(keep=session)
            self._timings["total"] = _ms(self._t0)
            self.done = True
            self._finish()
        return used

    def _fail(self, exc: Exception) -> None:
        """Record ``exc`` and undo the work (:meth:`close`)."""
        self.error = exc
        self.close()


class OpenTask(PrefixTask):
    """An open in flight: the vision tower, then the conversation prefix prefilled in chunks.

    Made by :meth:`SessionEngine.begin_open` (the session is admitted and busy). When a step fails
    the session is removed, as :meth:`close` (client gone) does.
    """

    def __init__(
        self,
        engine: SessionEngine,
        session: Session,
        images: list[Any],
        prefix: list[int],
        t0: float,
        decode_ms: float | None,
    ) -> None:
        super().__init__(engine, session, prefix, t0, decode_ms)
        self.result: OpenResult | None = None
        self._images = images

    def _encode(self) -> None:
        session = self.session
        session.image_features = self.engine.encode(session, self._images)
        session.kv_cache = self.engine.runner.new_cache()
        self._images = []

    def _finish(self) -> None:
        session = self.session
        self.result = OpenResult(
            session.session_id, session.expires_at, session.image_tokens[0], len(self.prefix), dict(self._timings)
        )

    def close(self) -> None:
        """Abandon the open (client gone): the session is removed. No-op once done."""
        if self.done:
            return
        self.done = True
        self.session.busy = False
        if self.session.session_id in self.engine.store:
            try:
                self.engine.store.remove(self.session.session_id)
            except ServiceError:
                pass


class AddImageTask(PrefixTask):
    """An added image in flight (:meth:`SessionEngine.begin_add_image`): the vision tower, then the
    conversation up to the next question prefilled in chunks, reusing the cache before the image.

    The session takes the image when its features are computed; when a step fails, or the client
    goes (:meth:`close`), the session is put back as before the add (images, features, history) with
    the cache kept up to what the old conversation shares, so nothing the user stored is lost.
    """

    def __init__(
        self,
        engine: SessionEngine,
        session: Session,
        image: Any,
        image_bytes: bytes,
        image_sizes: list[tuple[int, int]],
        image_tokens: list[int],
        prefix: list[int],
        t0: float,
        decode_ms: float | None,
    ) -> None:
        super().__init__(engine, session, prefix, t0, decode_ms)
        self.result: AddImageResult | None = None
        self._image = image
        self._image_bytes = image_bytes
        self._sizes = image_sizes
        self._tokens = image_tokens
        self._reuse = 0
        self._before: tuple[Any, ...] | None = None

    def _encode(self) -> None:
        engine, session = self.engine, self.session
        self._before = (
            list(session.images),
            list(session.image_sizes),
            list(session.image_tokens),
            session.pending_images,
            session.image_features,
        )
        relayout = self._tokens[:-1] != session.image_tokens
        session.images = [*session.images, self._image_bytes]
        session.image_sizes = list(self._sizes)
        session.image_tokens = list(self._tokens)
        session.pending_images += 1
        if relayout or session.image_features is None:  # every image (re-)encoded as laid out now
            images = [engine.decode_image(data) for data in session.images[:-1]] + [self._image]
            session.image_features = engine.encode(session, images)
        else:
            new = engine.encode(session, [self._image])
            session.image_features = torch.cat([session.image_features, new], dim=0)
        self._image = None
        if session.kv_cache is None or relayout:  # the cached image rows changed: nothing from the first one on
            ids = session.cached_ids if session.kv_cache is not None else []
            first = ids.index(engine.runner.image_token_id) if engine.runner.image_token_id in ids else len(ids)
            keep = min(first, common_prefix_len(ids, self.prefix))
            if session.kv_cache is None:
                session.kv_cache, keep = engine.runner.new_cache(), 0
        else:
            keep = common_prefix_len(session.cached_ids, self.prefix)
        if keep < cache_len(session.kv_cache):
            crop_cache(session.kv_cache, keep)
        session.cached_ids = session.cached_ids[:keep]
        self._reuse = keep
        engine.num_reused_tokens += keep

    def _finish(self) -> None:
        session = self.session
        self.result = AddImageResult(
            session.session_id,
            image_tokens=session.image_tokens[-1],
            images=len(session.images),
            prefix_tokens=len(self.prefix),
            cached_tokens=self._reuse,
            timings=dict(self._timings),
        )

    def close(self) -> None:
        """Abandon the add: the session is as before it (its cache kept where still valid). No-op once done."""
        if self.done:
            return
        self.done = True
        session = self.session
        session.busy = False
        if self._before is not None:
            images, sizes, tokens, pending, features = self._before
            relayout = tokens != session.image_tokens[:-1]
            session.images, session.image_sizes, session.image_tokens = images, sizes, tokens
            session.pending_images, session.image_features = pending, features
            if features is None or relayout:
                session.drop_kv()
            else:  # the cache is kept up to what the restored conversation shares with it
                session.keep_kv(common_prefix_len(session.cached_ids, self.engine.runner.prefix_ids(session.chat())))
        if session.session_id in self.engine.store:
            self.engine.store.sync(session)


class DecodeBatch:
    """The running answers of one worker as rows of one left-padded, preallocated KV cache.

    Layout (``BatchKVCache``, per decoder layer): keys and values ``[B, kv_heads, capacity,
    head_dim]``. Every row writes its next token at the same column (``length``); a row's sequence
    ends at that column and starts wherever its own length puts it (left padding). ``mask [B,
    capacity]`` (long, 1 = a valid position of that row) carries the padding, the holes of rows that
    sat out a step (a job TorchServe did not bring back in a call) and the rows that left.

    Costs. A decode step writes one column per layer in place and copies no KV. Building the batch
    copies each member's KV once: when an answer joins (its prefill done), when the columns run out
    (``capacity = longest row + grow_columns``), or to compact once most rows have left. A leaving
    row's valid columns are gathered into the session's own ``DynamicCache`` (one copy of that
    session). Memory: ``B × capacity × kv_bytes_per_token``; the overhead over the rows' own KV is the
    padding (longest minus each row's length) plus at most ``grow_columns`` free columns per row.

    Args:
        runner: the model runner (allocates the cache, runs the batched forward).
        store: the session store (counts the batch's bytes against the device budget).
        grow_columns: free columns allocated past the longest row at each build.
    """

    def __init__(self, runner: LlavaRunner, store: SessionStore, *, grow_columns: int = 64) -> None:
        self.runner = runner
        self.store = store
        self.grow_columns = grow_columns
        self.cache: BatchKVCache | None = None
        self.mask: torch.Tensor | None = None
        self.rows: list[Generation | None] = []
        self.num_builds = 0  # how many times the batch was (re)built (a copy of every member's KV)

    @property
    def num_live(self) -> int:
        """Rows that belong to a running answer."""
        return sum(g is not None for g in self.rows)

    def step(self, gens: list[Generation]) -> torch.Tensor:
        """Run one decode step for ``gens`` (each already prefilled) in one forward pass.

        Rows of the batch not in ``gens`` sit this step out (their new column is masked).

        Returns:
            Logits ``[B, vocab]`` float32, indexed by each generation's row.

        Raises:
            Exception: the forward pass failed (the batch is left as before the step); CUDA
                out-of-memory after one retry with the idle sessions demoted becomes
                ServiceError(overloaded).
        """
        if self.cache is None or any(g._row is None for g in gens) or self._should_rebuild():
            self._build([g for g in gens if g._row is None])
        cache, mask_or_none = self.cache, self.mask
        assert cache is not None and mask_or_none is not None
        mask: torch.Tensor = mask_or_none
        col = cache.length
        tokens = [0] * len(self.rows)
        positions = [0] * len(self.rows)
        for g in gens:
            assert g._row is not None
            tokens[g._row] = g.events[-1].id
            positions[g._row] = g.next_position
            mask[g._row, col] = 1

        def forward() -> torch.Tensor:
            try:
                return self.runner.decode_batch(cache, tokens, positions, mask[:, : col + 1])
            except BaseException:
                cache.set_length(col)  # a failed step leaves no column behind
                raise

        try:
            return _oom_retry(forward, self.store, keep=None)
        except BaseException:
            mask[:, col] = 0
            raise

    def release(self, gen: Generation) -> None:
        """Take ``gen`` out of the batch: its row's valid columns become its session's ``kv_cache``.

        No-op for a generation without a row.
        """
        row = gen._row
        if row is None:
            return
        assert self.cache is not None and self.mask is not None
        gen._row = None
        self.rows[row] = None
        columns = torch.nonzero(self.mask[row, : self.cache.length]).flatten()
        gen.session.kv_cache = self.runner.extract_row(self.cache, row, columns)
        self.store.sync(gen.session)
        if self.num_live == 0:
            self._free()

    def _should_rebuild(self) -> bool:
        cache = self.cache
        assert cache is not None
        return cache.length + 1 > cache.capacity or self.num_live * 2 < len(self.rows)

    def _build(self, joining: list[Generation]) -> None:
        """Lay out the live rows and ``joining`` (whose KV is in their sessions' caches) anew."""
        members = [g for g in self.rows if g is not None] + joining
        old, old_mask = self.cache, self.mask
        lengths: list[int] = []
        old_columns: list[torch.Tensor | None] = []
        for g in members:
            if g._row is not None:
                assert old is not None and old_mask is not None
                cols = torch.nonzero(old_mask[g._row, : old.length]).flatten()
                old_columns.append(cols)
                lengths.append(int(cols.numel()))
            else:
                old_columns.append(None)
                lengths.append(cache_len(g.session.kv_cache))
        width = max(lengths)
        need = len(members) * (width + self.grow_columns) * self.runner.kv_bytes_per_token
        self.store.batch_bytes = 0 if old is None else old.nbytes()
        if not self.store.reserve(need, keep=None):
            raise ServiceError(
                ErrorCode.OVERLOADED, "not enough device memory to decode now; retry later", retry_after_s=2
            )
        cache = _oom_retry(
            lambda: self.runner.new_batch_cache(len(members), width + self.grow_columns), self.store, keep=None
        )
        mask = torch.zeros(len(members), cache.capacity, dtype=torch.long, device=self.runner.device)
        for row, (g, src_cols, n) in enumerate(zip(members, old_columns, lengths, strict=True)):
            if src_cols is not None:
                assert old is not None and g._row is not None
                for dst, src in zip(cache.batch_layers, old.batch_layers, strict=True):
                    dst.keys[row, :, width - n : width] = src.keys[g._row].index_select(1, src_cols)
                    dst.values[row, :, width - n : width] = src.values[g._row].index_select(1, src_cols)
            else:
                self.runner.load_row(cache, row, g.session.kv_cache, width)
                g.session.kv_cache = None  # the row holds it now (the session is busy: never demoted)
                self.store.sync(g.session)
            mask[row, width - n : width] = 1
        cache.set_length(width)
        for row, g in enumerate(members):
            g._row = row
        self.cache, self.mask, self.rows = cache, mask, list(members)
        self.store.batch_bytes = cache.nbytes()
        self.num_builds += 1

    def _free(self) -> None:
        self.cache = None
        self.mask = None
        self.rows = []
        self.store.batch_bytes = 0


class Generation:
    """One answer in flight, advanced one token per scheduler step by :meth:`SessionEngine.step`.

    Its first step restores a demoted session, prefills the uncached tokens (batch of one) and
    samples the first token; every later step decodes one token as a row of the worker's
    :class:`DecodeBatch` (one forward pass for all running answers). When the answer ends,
    :attr:`answer` is set and the session is updated (remembered turn, or cache cropped back); when
    a step fails, :attr:`error` is set and the session is left as it was before the question, as
    :meth:`close` (client gone) does. The session is marked busy while in flight. Iterating it
    (``next()``) runs steps of this answer alone and yields its :class:`TokenEvent`s.
    """

    def __init__(
        self,
        engine: SessionEngine,
        session: Session,
        prompt: str,
        prompt_ids: list[int],
        params: SamplingParams,
        remember: bool,
        *,
        truncated_turns: int = 0,
    ) -> None:
        self.engine = engine
        self.truncated_turns = truncated_turns
        self.session = session
        self.prompt = prompt
        self.prompt_ids = prompt_ids
        self.params = params
        self.remember = remember
        self.answer: Answer | None = None
        self.error: Exception | None = None
        self.done = False
        self._detok = IncrementalDetokenizer(engine.runner.tokenizer)
        self._sampler = Sampler(params, engine.runner.device, prompt_ids)
        self._events: list[TokenEvent] = []
        self._prefilled = False
        self._prefill_started = False
        self._row: int | None = None  # this answer's row in the decode batch, while it has one
        self._reuse = 0
        self._restored: RestoredFrom | None = None
        self._t0 = time.perf_counter()
        self._t_first = self._t_last = 0.0
        self._timings: dict[str, float] = {}
        self._max_stop = max((len(s) for s in params.stop), default=0)
        session.busy = True
        engine.store.sync(session)

    @property
    def session_id(self) -> str:
        """The session this answer belongs to."""
        return self.session.session_id

    @property
    def events(self) -> list[TokenEvent]:
        """The token events generated so far, in order (do not modify)."""
        return self._events

    @property
    def prefilled(self) -> bool:
        """True once the prompt is prefilled (later steps are batched decode steps)."""
        return self._prefilled

    @property
    def next_position(self) -> int:
        """Position id of the token the next decode step feeds (the last one sampled)."""
        return len(self.prompt_ids) + len(self._events) - 1

    def __iter__(self) -> Generation:
        return self

    def __next__(self) -> TokenEvent:
        if self.done:
            raise StopIteration
        self.engine.step([self])
        if self.error is not None:
            raise self.error
        return self._events[-1]

    def _accept(self, logits: torch.Tensor) -> TokenEvent:
        """Sample the next token from ``logits [vocab]`` (float32); finish the answer if it ends."""
        runner = self.engine.runner
        token, logprob = self._sampler.next_token(logits)
        self.engine.num_generated_tokens += 1
        now = time.perf_counter()
        if not self._events:
            self._t_first = now
        self._t_last = now
        special = token in runner.eos_token_ids
        before = len(self._detok.text)
        text = self._detok.push(token)
        finish: FinishReason | None = None
        if (
            special
            or self._max_stop
            and any(s in self._detok.text[max(0, before - self._max_stop) :] for s in self.params.stop)
        ):
            finish = "stop"
        elif len(self._events) + 1 >= self.params.max_new_tokens:
            finish = "length"
        if finish:
            text += self._detok.flush()
        event = TokenEvent(token, text, logprob, special)
        self._events.append(event)
        if finish:
            self._finish(finish)
        return event

    def _fail(self, exc: Exception) -> None:
        """Record ``exc`` as this answer's error and leave the session as before the question."""
        self.error = exc
        self._abort()

    def _prefill_step(self, budget: int | None) -> int:
        """Run the next piece of this answer's prefill; returns the tokens it used of ``budget``.

        The first piece restores a demoted session (re-encoding the image takes the whole
        ``budget``), crops the cache to the reused prefix and reserves memory; then the uncached
        prompt tokens are prefilled in chunks of at most ``budget`` tokens (None: all at once).
        When the last chunk is done, the first token is sampled.

        Raises:
            ServiceError: overloaded (no device memory); the restore's image errors.
        """
        engine, runner, session = self.engine, self.engine.runner, self.session
        if not self._prefill_started:
            self._prefill_started = True
            t0 = time.perf_counter()
            self._restored = engine._restore(session)
            self._timings["restore"] = _ms(t0)
            reuse = min(common_prefix_len(session.cached_ids, self.prompt_ids), len(self.prompt_ids) - 1)
            need = (len(self.prompt_ids) - reuse + self.params.max_new_tokens) * runner.kv_bytes_per_token
            if not engine.store.reserve(need, keep=session):
                raise ServiceError(
                    ErrorCode.OVERLOADED, "not enough device memory for this answer now; retry later", retry_after_s=2
                )
            if reuse < cache_len(session.kv_cache):
                crop_cache(session.kv_cache, reuse)
            session.cached_ids = session.cached_ids[:reuse]
            self._reuse = reuse
            engine.num_reused_tokens += reuse
            if self._restored == "image" and budget is not None:
                return budget  # the vision tower ran: this step's prefill share is spent
        logits, used = engine._prefill_chunk(session, self.prompt_ids, budget, self._timings)
        if cache_len(session.kv_cache) == len(self.prompt_ids):
            self._prefilled = True
            self._accept(logits)
        return used

    def _finish(self, finish_reason: FinishReason) -> None:
        session = self.session
        self.engine.batch.release(self)  # the session's KV comes back from its batch row
        ids = [e.id for e in self._events]
        if self.truncated_turns:  # what the model saw: the oldest turns left the context (not their images)
            kept = session.chat().without_oldest(self.truncated_turns)
            session.history, session.pending_images = list(kept.turns), kept.pending_images
        if self.remember:
            session.history.append(Turn(self.prompt, self._detok.text, session.pending_images))
            session.pending_images = 0
            session.cached_ids = list(self.prompt_ids) + ids[:-1]  # the last token is not fed yet
        else:  # keep what the next question can reuse: the history's stable prefix
            stable = self.engine.runner.prefix_ids(session.chat())
            keep = max(self._reuse, common_prefix_len(self.prompt_ids, stable))
            crop_cache(session.kv_cache, keep)
            session.cached_ids = session.cached_ids[:keep]
        session.check_cache()
        session.busy = False
        self.done = True
        t_end = time.perf_counter()
        n = len(self._events)
        decode_s = self._t_last - self._t_first
        self._timings.update(
            {
                "ttft": _ms(self._t0, self._t_first),
                "total": _ms(self._t0, t_end),
                "decode_tokens_per_s": round((n - 1) / decode_s, 2) if n > 1 and decode_s > 0 else 0.0,
            }
        )
        self.answer = Answer(
            text=self._detok.text,
            finish_reason=finish_reason,
            prompt_tokens=len(self.prompt_ids),
            cached_tokens=self._reuse,
            generated_tokens=n,
            tokens=list(self._events),
            timings=dict(self._timings),
            seed=self._sampler.seed,
            restored_from=self._restored,
            max_new_tokens=self.params.max_new_tokens,
            truncated_turns=self.truncated_turns,
        )
        self.engine.store.enforce(keep=session)

    def _abort(self) -> None:
        """Leave the session as before the question (cache cropped to the reused prefix, or dropped
        if a forward pass failed midway)."""
        if self.done:
            return
        self.done = True
        session = self.session
        session.busy = False
        try:
            self.engine.batch.release(self)
        except Exception:  # noqa: BLE001 - the row cannot be read back: rebuild the session from features
            log.exception("could not read a session back from the decode batch")
            session.drop_kv()
        session.keep_kv(len(session.cached_ids) if not self._prefilled else self._reuse)
        self.engine.store.sync(session)

    def close(self) -> None:
        """Abandon the answer (client gone); the session stays as it was before the question."""
        self._abort()
