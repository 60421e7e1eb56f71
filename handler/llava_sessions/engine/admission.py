"""Admission: check a request against the session, the limits, the context and the memory, then make its work.

Everything that decides a request's status happens here, before any forward pass (TorchServe fixes
the status and headers with a job's first frame: docs/platform.md). An image, the
opening one or an added one, takes one path: decode, the image limits, its placeholder count, the
conversation's context, then whether room can be made for the device memory it needs (the step's
plan makes that room: scheduler rule 10), checked once the session is marked busy.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence as GenericSequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..conversation import (
    Chat,
    ChatTarget,
    Turn,
    common_prefix_len,
    is_video_size,
    media_size,
    still_images,
    video_indexes,
)
from ..errors import ErrorCode, ServiceError, overloaded
from ..results import ContextPolicy, elapsed_ms
from ..sampling.grammar import GrammarMatcher
from ..sampling.params import SamplingParams
from ..sampling.sampler import IncrementalDetokenizer, Sampler
from .memory import device_bytes, kv_grant_bytes, new_session_bytes
from .samples import add_samples, sample_bytes
from .sequence import ImagePrefill, Sequence
from .sharing import reusable_len

if TYPE_CHECKING:
    from ..model import LlavaModel
    from ..sessions.session import Session
    from ..sessions.store import SessionStore
    from .sequence import Driver
    from .sharing import ImageSharing

__all__ = ["Admission", "EngineLimits"]


#: What a resent conversation that does not fit can do (the client owns the history).
_CHAT_CONTEXT_HINT = "lower max_tokens, or send a shorter conversation (drop the oldest messages or images)"


@dataclass
class EngineLimits:
    """Per-request limits: ``max_new_tokens_cap`` (a native question's; a chat answer's is the
    context), ``max_prompt_tokens`` (tokens of one prompt) and ``planned_new_tokens`` (the new
    tokens memory is made room for at the start of a chat answer without a limit);
    per-session limits: ``max_images`` (images a session holds, the opening one included) and
    ``max_image_tokens`` (placeholder tokens of all its images; 0: only the model's context); the
    conversation cache's: ``cache_share`` (the share of the device budget its entries may hold, 0
    to 1; 0: off) and ``cache_entries`` (most entries held); ``truncation_headroom``: the share of the
    context (0 to 0.9) a truncation leaves free (:meth:`Admission._fit`)."""

    max_new_tokens_cap: int = 1024
    max_prompt_tokens: int = 2048
    planned_new_tokens: int = 256
    max_images: int = 8
    max_image_tokens: int = 0
    cache_share: float = 0.5
    cache_entries: int = 64
    truncation_headroom: float = 0.25


class Admission:
    """The engine's admission of opens, added images and questions (see the module docstring).

    Args:
        store: the sessions and their memory; model: the loaded model (token counts, templates, bytes);
        limits: per-request and per-session limits; sharing: what other sessions hold;
        decode_image: encoded bytes -> image; driver: what the work made here calls back into.
        page_size: positions per page of the KV pool the sessions' caches are in (0: none), which
            the grants count in (:func:`~.memory.kv_grant_bytes`).
    """

    def __init__(
        self,
        store: SessionStore,
        model: LlavaModel,
        limits: EngineLimits,
        sharing: ImageSharing,
        decode_image: Callable[[bytes], Any],
        driver: Driver,
        page_size: int = 0,
    ) -> None:
        self.page_size = page_size
        self.store = store
        self.model = model
        self.limits = limits
        self.sharing = sharing
        self.decode_image = decode_image
        self.driver = driver

    # ------------------------------------------------------------------ images
    def open(
        self,
        session_id: str,
        image_bytes: bytes,
        system_prompt: str | None,
        image: Any,
        history: list[Turn] | None,
        history_images: GenericSequence[tuple[bytes, Any]],
        salt: str | None = None,
    ) -> ImagePrefill:
        """Admit a new session (``SessionEngine.begin_open``, which documents the errors)."""
        history = list(history or [])
        self._check_no_placeholder([text for t in history for text in (t.prompt, t.answer)], "history")
        t0 = time.perf_counter()
        image, decode_ms = self._decoded(image_bytes, image)
        if sum(t.images for t in history) != len(history_images):
            raise ServiceError(ErrorCode.INVALID_PARAMETER, "the history's image counts do not match its images")
        images = [image] + [img for _, img in history_images]
        sizes, tokens = self._layout([], images)
        if history:  # the opening image opens the first restored question
            history[0] = dataclasses.replace(history[0], images=history[0].images + 1)
        data = [image_bytes] + [b for b, _ in history_images]
        session = self.store.new_session(session_id, system_prompt, data, sizes, tokens, history)
        session.set_salt(salt)
        if session.chat().image_after_video():
            raise ServiceError(
                ErrorCode.INVALID_REQUEST,
                "the history's first turn adds an image to a session opened on a video; " + _ORDER,
            )
        prefix = self.model.template.prefix_ids(session.chat())
        medium = f"the video ({tokens[0]} tokens)" if is_video_size(sizes[0]) else "the image"
        what = f"{medium} and the restored history are" if history else f"{medium} is"
        self._check_context(prefix, f"{what} {len(prefix)} tokens in all", "")
        self.store.add(session)  # admission first: nothing is computed for a session that cannot be held
        need = new_session_bytes(self.model, len(prefix), sum(tokens), self.page_size)
        try:
            self._check_room(session, need, "a new session")
        except ServiceError:
            self.store.remove(session_id)
            raise
        prefill = ImagePrefill(self.driver, "open", session, images, prefix, t0, decode_ms, start_bytes=need)
        stills = still_images(sizes)
        rows = [self.sharing.rows(session, k, n, stills) for k, n in zip(session.image_keys, tokens, strict=True)]
        if all(r is not None for r in rows):
            prefill.shared_rows = rows
        return prefill

    def add_image(self, session_id: str, image_bytes: bytes, image: Any) -> ImagePrefill:
        """Admit an image that opens the session's next question (``SessionEngine.begin_add_image``)."""
        session = self.idle_session(session_id)
        self._check_image_count(len(session.images) + 1)
        t0 = time.perf_counter()
        image, decode_ms = self._decoded(image_bytes, image)
        sizes, tokens = self._layout(session.image_sizes, [image])
        chat = Chat(
            session.system_prompt,
            tuple(session.history),
            session.pending_images + 1,
            tuple(tokens),
            video_indexes(sizes),
        )
        if chat.image_after_video():
            raise ServiceError(ErrorCode.INVALID_REQUEST, "an image cannot follow a video in one question; " + _ORDER)
        prefix = self.model.template.prefix_ids(chat)
        medium = f"video ({tokens[-1]} tokens)" if is_video_size(sizes[-1]) else "image"
        self._check_context(
            prefix,
            f"with this {medium} the conversation is {len(prefix)} tokens",
            f"; open a new session for this {medium.split()[0]} (a reset forgets the turns but keeps every image)",
        )
        relayout = tokens[:-1] != session.image_tokens
        feature_tokens = sum(tokens) if relayout or session.image_features is None else tokens[-1]
        reuse = 0 if relayout else common_prefix_len(session.cached_ids, prefix)
        need = device_bytes(self.model, 0, feature_tokens) + self._kv_grant(reuse, len(prefix))
        self._check_room(session, need, "the image now")
        return ImagePrefill(
            self.driver,
            "add_image",
            session,
            [image],
            prefix,
            t0,
            decode_ms,
            new_image=(image_bytes, sizes, tokens),
            start_bytes=need,
        )

    def _decoded(self, data: bytes, image: Any) -> tuple[Any, float | None]:
        """``(the decoded image, decode ms or None when it came decoded)``."""
        if image is not None:
            return image, None
        t0 = time.perf_counter()
        image = self.decode_image(data)
        return image, elapsed_ms(t0)

    def _layout(self, sizes: list[tuple[int, ...]], new_images: list[Any]) -> tuple[list[tuple[int, ...]], list[int]]:
        """Every image's (height, width) and placeholder count once ``new_images`` join images of
        ``sizes``, within the image limits.

        Raises:
            ServiceError: image_limit_exceeded (``max_images`` or ``max_image_tokens``).
        """
        sizes = [*sizes, *(media_size(img) for img in new_images)]
        return sizes, self._layout_sizes(sizes)

    def _layout_sizes(self, sizes: list[tuple[int, ...]]) -> list[int]:
        """The placeholder count of each image of a conversation with images of ``sizes``, within
        the image limits (raises image_limit_exceeded as :meth:`_layout`)."""
        self._check_image_count(len(sizes))
        stills = still_images(sizes)
        tokens = [self.model.image_token_count(size, stills) for size in sizes]
        cap = self.limits.max_image_tokens
        if cap and sum(tokens) > cap:
            raise ServiceError(
                ErrorCode.IMAGE_LIMIT_EXCEEDED,
                f"the session's images would take {sum(tokens)} image tokens; at most {cap} are allowed",
            )
        return tokens

    def _check_image_count(self, num_images: int) -> None:
        if num_images > self.limits.max_images:
            raise ServiceError(
                ErrorCode.IMAGE_LIMIT_EXCEEDED, f"a session holds at most {self.limits.max_images} images"
            )

    def _check_context(self, prefix: list[int], what: str, hint: str) -> None:
        """Raise context_length_exceeded when ``prefix`` leaves no room for a question."""
        if len(prefix) >= self.model.max_positions:
            raise ServiceError(
                ErrorCode.CONTEXT_LENGTH_EXCEEDED,
                f"{what}, over the model's context of {self.model.max_positions} tokens{hint}",
            )

    def _check_room(self, session: Session, num_bytes: int, purpose: str) -> None:
        """Mark ``session`` busy and check that room can be made for ``num_bytes`` of device memory
        (demoting idle sessions; nothing is demoted here: the step's plan makes the room, scheduler
        rule 10); on a shortage it is idle again and ``overloaded`` is raised."""
        self.store.pin(session)
        if not self.store.can_allocate(num_bytes, keep=session):
            self.store.unpin(session)
            raise overloaded(f"not enough device memory for {purpose}", "session_room")

    # ------------------------------------------------------------------ questions
    def question(
        self,
        session_id: str,
        prompt: str,
        params: SamplingParams,
        remember: bool,
        context_policy: ContextPolicy,
        clip_max_new_tokens: bool,
    ) -> Sequence:
        """Admit a question (``SessionEngine.start``, which documents the policy and the errors)."""
        session = self.idle_session(session_id)
        self._check_prompt(prompt, params)
        grammar = _grammar(self.model, params)
        chat = session.chat()
        clip = clip_max_new_tokens and context_policy == "truncate"  # `error` changes nothing (docs/api.md)
        ids, dropped, max_new = self._fit(chat, prompt, params.max_new_tokens, context_policy, clip)
        request = dataclasses.replace(params, max_new_tokens=max_new)
        params = request.for_sample(request.session_choice)
        model = self.model
        seq = Sequence(
            self.driver,
            session,
            prompt,
            ids,
            params,
            remember,
            Sampler(params, model.device, ids, model.eos_token_ids, grammar),
            IncrementalDetokenizer(model.tokenizer, skip_special_tokens=params.skip_special_tokens),
            truncated_turns=dropped,
        )
        extra = (request.n - 1) * self._sample_bytes(len(ids) + seq.room_tokens, session.image_tokens)
        seq.start_bytes = self._start_bytes(seq) + extra
        add_samples(seq, request, self.store, model, lambda p: _grammar(model, p))
        self.store.pin(session)
        return seq

    def _sample_bytes(self, num_tokens: int, image_tokens: GenericSequence[int]) -> int:
        """Device bytes each other answer of a request of several takes (:func:`~.samples.sample_bytes`)."""
        return sample_bytes(self.model, self.page_size, num_tokens, sum(image_tokens))

    def _start_bytes(self, seq: Sequence) -> int:
        """Device bytes ``seq``'s start needs room for: a demoted session's image features, the KV of
        the prompt tokens its cache does not serve and of ``room_tokens`` new ones."""
        session = seq.session
        restore = bool(session.images) and session.image_features is None
        kv = self._kv_grant(seq.num_reusable_tokens(), len(seq.prompt_ids) + seq.room_tokens)
        return kv + device_bytes(self.model, 0, sum(session.image_tokens) if restore else 0)

    def _kv_grant(self, reuse: int, num_tokens: int) -> int:
        """Bytes a cache cropped to ``reuse`` positions is booked more once it holds ``num_tokens``."""
        return kv_grant_bytes(self.model, self.page_size, reuse, num_tokens)

    def _check_prompt(self, prompt: str, params: SamplingParams, *, chat: bool = False) -> None:
        """A question's text and limits (``chat``: a resent conversation's, which may be blank and
        whose answer only the context bounds)."""
        if not chat and (not prompt or not prompt.strip()):
            raise ServiceError(ErrorCode.INVALID_PARAMETER, "prompt must not be empty")
        self._check_no_placeholder([prompt], "prompt")
        cap = self.limits.max_new_tokens_cap
        if not chat and params.max_new_tokens > cap:
            raise ServiceError(ErrorCode.INVALID_PARAMETER, f"max_new_tokens must be <= {cap}")
        # a token covers at least one UTF-8 byte (SentencePiece may add one leading-space piece), so
        # only a prompt of more bytes than the cap can be over it: shorter ones skip the tokenizer
        if len(prompt.encode("utf-8")) + 1 <= self.limits.max_prompt_tokens:
            return
        num_prompt = self.model.template.count_text_tokens(prompt)
        if num_prompt > self.limits.max_prompt_tokens:
            raise ServiceError(
                ErrorCode.INVALID_PARAMETER,
                f"prompt is {num_prompt} tokens; at most {self.limits.max_prompt_tokens} are allowed (the server's "
                "max_prompt_tokens setting): shorten the message, or raise max_prompt_tokens",
            )

    def _fit(
        self, chat: Chat, prompt: str, max_new: int, policy: ContextPolicy, clip: bool, *, hint: str | None = None
    ) -> tuple[list[int], int, int]:
        """The conversation's ids fitted to the context: ``(ids, oldest turns dropped, max_new_tokens)``;
        ``truncate`` drops the oldest turns first, then ``clip`` lowers a default ``max_new`` to the room left.
        A truncation drops enough turns to leave ``truncation_headroom`` of the context free too (as
        many as there are at most), so the next turns append to the KV cache instead of dropping a
        turn each, which would change the conversation right after the images and re-prefill the rest.
        A drop that would move a video's turn into a turn with an image is skipped (the template could
        not render that message in the conversation's order: :meth:`Chat.image_after_video`).

        Raises:
            ServiceError: context_length_exceeded.
        """
        template, limit = self.model.template, self.model.max_positions
        ids = template.conversation_ids(chat, prompt)
        dropped = 0
        if len(ids) + max_new > limit and policy == "truncate":
            room = limit - int(limit * self.limits.truncation_headroom)
            shortest = next(
                (c for n in range(len(chat.turns), 0, -1) if not (c := chat.without_oldest(n)).image_after_video()),
                chat,
            )
            if len(template.conversation_ids(shortest, prompt)) + max_new > room:
                room = limit  # the headroom is out of reach: drop no more turns than the turn needs
            for n in range(1, len(chat.turns) + 1):
                if len(ids) + max_new <= room:
                    break
                fewer = chat.without_oldest(n)
                if not fewer.image_after_video():
                    ids, dropped = template.conversation_ids(fewer, prompt), n
        if len(ids) + max_new > limit and clip and len(ids) < limit:
            max_new = limit - len(ids)
        if len(ids) + max_new > limit:
            hint = hint or (
                "lower max_new_tokens or shorten the question"
                if policy == "truncate"
                else "lower max_new_tokens, reset the session (it forgets the turns), open a new one or use "
                "context_policy truncate"
            )
            if clip:  # no limit was asked: the prompt alone leaves no room
                needs = f"{len(ids)} prompt tokens + at least 1 new token"
            else:
                needs = f"{len(ids)} prompt tokens + {max_new} new tokens = {len(ids) + max_new}"
            raise ServiceError(
                ErrorCode.CONTEXT_LENGTH_EXCEEDED,
                f"this turn needs {needs}, over the model's context of {limit} tokens; {hint}",
            )
        return ids, dropped, max_new

    # ------------------------------------------------------------------ resent conversations
    def conversation(
        self, session_id: str, target: ChatTarget, params: SamplingParams, clip_max_new_tokens: bool, salt: str | None
    ) -> Sequence:
        """Admit a resent whole conversation (``SessionEngine.start_chat``, which documents the errors):
        the session comes to hold it, keeping the feature rows of every image it (or, when sharing,
        any session) holds and its KV cache up to the first token or image that differs; the images
        left to encode and the prefix to prefill run in the answer's steps."""
        session = self.idle_session(session_id)
        session.set_salt(salt)  # what it comes to hold is shared within the salt of the request that sent it
        texts = [target.question, *(text for t in target.turns for text in (t.prompt, t.answer))]
        self._check_no_placeholder([*texts, target.system_prompt or ""], "messages")
        self._check_prompt(target.question, params, chat=True)
        grammar = _grammar(self.model, params)
        sizes = [img.size for img in target.images]
        tokens = self._layout_sizes(sizes)
        chat = Chat(target.system_prompt, target.turns, target.pending_images, tuple(tokens), video_indexes(sizes))
        ids, _, max_new = self._fit(
            chat, target.question, params.max_new_tokens, "error", clip_max_new_tokens, hint=_CHAT_CONTEXT_HINT
        )
        request = dataclasses.replace(params, max_new_tokens=max_new)
        params = request.for_sample(request.session_choice)
        keys = [img.key for img in target.images]
        keep = 0
        if session.kv_cache is not None:
            keep = reusable_len(session, ids, keys, tokens, self.model.image_token_id)
        sharing = self.sharing
        stills = still_images(sizes)
        rows = [sharing.rows(session, img.key, n, stills) for img, n in zip(target.images, tokens, strict=True)]
        model = self.model
        unchanged = keys == session.image_keys and tokens == session.image_tokens and session.image_features is not None
        # a new set of features is a new tensor (every row copied or encoded when the answer starts)
        room = min(max_new, self.limits.planned_new_tokens) if clip_max_new_tokens else max_new
        need = device_bytes(model, 0, 0 if unchanged else sum(tokens)) + self._kv_grant(keep, len(ids) + room)
        need += (request.n - 1) * self._sample_bytes(len(ids) + room, tokens)
        self._check_room(session, need, "this turn" if request.n == 1 else f"{request.n} answers now")
        to_encode = self._hold_conversation(session, target, tokens, keep, rows, unchanged=unchanged)
        seq = Sequence(
            self.driver,
            session,
            target.question,
            ids,
            params,
            True,
            Sampler(params, model.device, ids, model.eos_token_ids, grammar),
            IncrementalDetokenizer(model.tokenizer, skip_special_tokens=params.skip_special_tokens),
            room_tokens=room,
            start_bytes=need,
        )
        seq.set_images_to_encode(to_encode, rows, assemble=not unchanged)
        add_samples(seq, request, self.store, model, lambda p: _grammar(model, p))
        return seq

    def _hold_conversation(
        self, session: Session, target: ChatTarget, tokens: list[int], keep: int, rows: list[Any], *, unchanged: bool
    ) -> list[tuple[int, Any]]:
        """Make ``session`` hold ``target``: its KV cache cropped to the ``keep`` tokens that serve it,
        its features kept when ``unchanged`` (the session's images, laid out as before), else freed
        (the answer's start assembles them from the ``rows`` found held and the vision tower's);
        returns the images left to encode (``(index, decoded image or None)``)."""
        session.crop_kv(keep)
        session.set_conversation(
            target.system_prompt,
            list(target.turns),
            target.pending_images,
            [(img.key, img.data, img.size, n) for img, n in zip(target.images, tokens, strict=True)],
        )
        if unchanged:
            return []  # the same images as before: their features stay as they are
        session.set_features(None)
        return [(i, target.images[i].image) for i, r in enumerate(rows) if r is None]

    # ------------------------------------------------------------------ shared
    def check_video(self) -> None:
        """Check that the model has a video path (:attr:`~llava_sessions.model.LlavaModel.supports_video`).

        Raises:
            ServiceError: video_unsupported (400), naming the model's architecture.
        """
        if not self.model.supports_video:
            raise ServiceError(
                ErrorCode.VIDEO_UNSUPPORTED,
                f"this server's model ({self.model.architecture}) has no video path; send images, or serve "
                "a LLaVA-OneVision or LLaVA-NeXT-Video checkpoint for videos",
                param="video",
            )

    def idle_session(self, session_id: str) -> Session:
        """The open session ``session_id``, which must not be answering.

        Raises:
            ServiceError: session_not_found / _expired / _evicted, session_busy.
        """
        session = self.store.get(session_id)
        if session.busy:
            raise ServiceError(
                ErrorCode.SESSION_BUSY, "the session is answering another request; wait for it to finish"
            )
        return session

    def _check_no_placeholder(self, texts: list[str], where: str) -> None:
        video = self.model.template.video_token
        for token, what in ((self.model.image_token, "image"), (video, "video")):
            if token and any(token in text for text in texts):
                raise ServiceError(
                    ErrorCode.INVALID_PARAMETER, f"{where} must not contain the {what} placeholder {token!r}"
                )


#: Why an image may not follow a video in one user message.
_ORDER = (
    "the chat template renders a message's images before its videos: ask about the video first, or add the "
    "image before the video"
)


def _grammar(model: Any, params: SamplingParams) -> GrammarMatcher | None:
    """The structured output's matcher of an answer (before anything is held for it), or None.

    Raises:
        ServiceError: invalid_parameter: the grammar cannot start on this model's tokenizer.
    """
    return model.grammars.matcher(params.grammar) if params.grammar is not None else None
