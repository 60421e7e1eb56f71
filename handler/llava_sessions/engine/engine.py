"""The session engine: admit work, then step it: schedule → execute → postprocess.

A session is opened on an image once (vision tower + projector, then the conversation prefix
prefilled). Each question chat-templates the FULL conversation, reuses the session's KV cache for
the longest common token prefix, prefills only the rest and decodes, so a follow-up costs its own
tokens and gives exactly the tokens a from-scratch ``model.generate`` on the same templated
conversation gives (fp32).

The parts, as in nano-vllm's ``engine/``: admission (:mod:`.admission`) checks a request and makes
its work (:class:`~.sequence.Sequence`, :class:`~.sequence.ImagePrefill`, state only);
:meth:`SessionEngine.step` asks the scheduler (:func:`~.scheduler.schedule`, plain data) what to
run and has the executor (:mod:`.executor`) carry the plan out: its memory and preemptions, what each
chunk needs first (:mod:`.inputs`), the model runner's passes, what they produce (:mod:`.outputs`).
No HTTP, no JSON, no TorchServe.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence as GenericSequence
from typing import TYPE_CHECKING, Any

from ..conversation import Chat, ChatTarget, Turn, common_prefix_len, video_indexes
from ..errors import ErrorCode, ServiceError
from ..results import AddImageResult, Answer, ContextPolicy, OpenResult
from ..sampling.params import SamplingParams
from ..sessions.store import SessionStore
from .admission import Admission, EngineLimits
from .executor import BatchRoom, StepExecutor
from .memory import new_session_bytes
from .model_runner import ModelRunner
from .paged_batch import PagedDecodeBatch
from .samples import runnable
from .scheduler import TimeBudget, schedule
from .sequence import EngineRequest, ImagePrefill, Sequence
from .sharing import ImageSharing, Unsalted, reusable_len

if TYPE_CHECKING:
    from ..sessions.session import Session

__all__ = ["EngineLimits", "SessionEngine"]

log = logging.getLogger(__name__)


class SessionEngine:
    """Sessions on one model: open, add images, answer (step-wise), reset, close, under a memory budget.

    Args:
        model: the loaded model (:class:`~llava_sessions.model.LlavaModel`).
        store: the session store (budget, TTL).
        decode_image: ``bytes -> RGB PIL image``; raises ServiceError(image_invalid | image_too_large).
        limits: per-request and per-session limits.
        check_invariants: after every step and every admission, assert the store's invariants
            (:meth:`SessionStore.check_invariants`); for tests.
        share_images: a session may use image features and prefix KV another session holds
            (:class:`~.sharing.ImageSharing`); False: only its own (``share_images: false``).
        unsalted: what requests without a ``cache_salt`` share (:data:`~.sharing.Unsalted`).
        fuse_prefill: a step's first prefill chunk runs in the decode step's forward pass while
            answers decode (rule 9 of :mod:`.scheduler`); False: a pass of its own.
        cuda_graphs: the decode step at static shapes, replayed as CUDA graphs on a GPU
            (:class:`~.model_runner.ModelRunner`).
        async_scheduling: a decode step whose tokens the device chooses launches the next before the
            host records them (:mod:`.ahead`; static steps only); None: with CUDA graphs on a GPU.

    Attributes:
        model: the loaded model; runner: its :class:`~.model_runner.ModelRunner`; batch: the decode batch.
        num_reused_tokens / num_generated_tokens / num_preemptions: counters for metrics (below).
    """

    def __init__(
        self,
        model: Any,
        store: SessionStore,
        decode_image: Callable[[bytes], Any],
        limits: EngineLimits | None = None,
        *,
        check_invariants: bool = False,
        share_images: bool = True,
        unsalted: Unsalted = "shared",
        fuse_prefill: bool = True,
        cuda_graphs: bool | None = None,
        async_scheduling: bool | None = None,
    ) -> None:
        self.model = model
        self.store = store
        self.decode_image = decode_image
        self.limits = limits or EngineLimits()
        self.runner = ModelRunner(model, store, cuda_graphs=cuda_graphs)
        self.fuse = fuse_prefill
        self.check_invariants = check_invariants
        self.sharing = ImageSharing(store, model, enabled=share_images, unsalted=unsalted)
        page = self.runner.page_size
        self._admission = Admission(store, model, self.limits, self.sharing, decode_image, self, page)
        if async_scheduling is None:
            async_scheduling = self.runner.replays_steps
        self._execute = StepExecutor(store, self.runner, self.sharing, decode_image, async_scheduling=async_scheduling)

    @property
    def batch(self) -> PagedDecodeBatch:
        """The running answers' decode batch."""
        return self.runner.batch

    @property
    def num_prefilled_tokens(self) -> int:
        """Prompt tokens prefilled since start."""
        return self.runner.num_prefilled_tokens

    @property
    def num_reused_tokens(self) -> int:
        """Prompt tokens served from a KV cache since start (for metrics)."""
        return self._execute.inputs.num_reused_tokens

    @property
    def num_generated_tokens(self) -> int:
        """Tokens sampled since start, finished answers or not (for metrics)."""
        return self._execute.outputs.num_generated_tokens

    @property
    def num_preemptions(self) -> int:
        """Answers preempted since start so that older ones could grow (for metrics)."""
        return self._execute.num_preemptions

    def new_session_bytes(self, num_prefix_tokens: int, num_image_tokens: int | None = None) -> int:
        """Device bytes a new session takes in the ``kv`` tier (:func:`~.memory.new_session_bytes`)."""
        return new_session_bytes(self.model, num_prefix_tokens, num_image_tokens, self.runner.page_size)

    # ------------------------------------------------------------------ sessions
    def open(
        self,
        session_id: str,
        image_bytes: bytes,
        system_prompt: str | None = None,
        *,
        image: Any = None,
        history: list[Turn] | None = None,
        history_images: GenericSequence[tuple[bytes, Any]] = (),
        salt: str | None = None,
    ) -> OpenResult:
        """Open a session in one call (:meth:`begin_open`, then its steps without a token budget).

        Raises:
            ServiceError: as :meth:`begin_open`, and image_invalid / overloaded from its steps.
        """
        prefill = self.begin_open(
            session_id,
            image_bytes,
            system_prompt,
            image=image,
            history=history,
            history_images=history_images,
            salt=salt,
        )
        result = self._run_whole(prefill)
        assert isinstance(result, OpenResult)
        return result

    def begin_open(
        self,
        session_id: str,
        image_bytes: bytes,
        system_prompt: str | None = None,
        *,
        image: Any = None,
        history: list[Turn] | None = None,
        history_images: GenericSequence[tuple[bytes, Any]] = (),
        salt: str | None = None,
    ) -> ImagePrefill:
        """Admit a new session on an image and return its :class:`~.sequence.ImagePrefill` (the vision
        tower and the prefix prefill run in later :meth:`step` calls); the session is busy until done.

        With ``history``, the session starts with those turns remembered (a restored conversation)
        and the prefix covers them too. ``history_images``: ``(encoded bytes, decoded image)`` of the
        images the restored turns' ``images`` counts place, in order.

        Args:
            session_id: the new session's id.
            image_bytes: the encoded image (JPEG, PNG, ...).
            system_prompt: optional system message, templated first.
            image: ``image_bytes`` already decoded (RGB PIL image), to skip decoding here.
            history: past turns to restore (their prompts must not contain the image placeholder).
            salt: the request's ``cache_salt``: image features are shared only within it.

        Raises:
            ServiceError: image_invalid / image_too_large (bad image), image_limit_exceeded,
                overloaded (no room: the session is not opened), invalid_request (id already open),
                invalid_parameter (the image placeholder in a history turn, image counts that do not
                match), context_length_exceeded (image and history too long).
        """
        prefill = self._admission.open(session_id, image_bytes, system_prompt, image, history, history_images, salt)
        self._check()
        return prefill

    def add_image(self, session_id: str, image_bytes: bytes, *, image: Any = None) -> AddImageResult:
        """Append an image to a session's conversation in one call (:meth:`begin_add_image`, then its steps).

        Raises:
            ServiceError: as :meth:`begin_add_image`, and image_invalid / overloaded from its steps
                (the session is then as before).
        """
        result = self._run_whole(self.begin_add_image(session_id, image_bytes, image=image))
        assert isinstance(result, AddImageResult)
        return result

    def begin_add_image(self, session_id: str, image_bytes: bytes, *, image: Any = None) -> ImagePrefill:
        """Admit an image that opens the session's next question, and return its
        :class:`~.sequence.ImagePrefill` (the vision tower, then the conversation up to the next question,
        in later :meth:`step` calls, reusing the KV cache of everything before).

        Where the model lays out earlier images differently once there are several (LLaVA-OneVision:
        one base tile each), the earlier images are re-encoded too and the cache is reused up to the
        first image only: the answers stay those of the model on the whole conversation.

        Raises:
            ServiceError: session_* (gone), session_busy, image_invalid / image_too_large,
                image_limit_exceeded (``max_images`` or ``max_image_tokens``), context_length_exceeded
                (no room left for a question), overloaded (no device memory now).
        """
        prefill = self._admission.add_image(session_id, image_bytes, image)
        self._check()
        return prefill

    def open_empty(self, session_id: str, system_prompt: str | None = None, *, salt: str | None = None) -> OpenResult:
        """Open a session that holds no image yet (AWS's ``{"requestType": "NEW_SESSION"}``, or a chat
        request without a session): its conversation comes with the next request's messages. Nothing
        runs on the model.

        Raises:
            ServiceError: invalid_request (id already open), overloaded (``max_sessions`` reached).
        """
        session = self.store.new_session(session_id, system_prompt, [], [], [], [])
        session.set_salt(salt)
        self.store.add(session)
        self._check()
        return OpenResult(session_id, session.expires_at, 0, 0, {})

    def image_held(
        self, session_id: str | None, key: str, salt: str | None = None
    ) -> tuple[bytes, tuple[int, ...]] | None:
        """The encoded bytes and (height, width) of the image of content ``key`` if the session
        ``session_id`` (or, when sharing, a session of the scope of ``salt``) holds it; else None.
        Never raises."""
        return self.sharing.held(self.store.peek(session_id) if session_id else None, key, salt)

    def uuid_key(self, session_id: str | None, uuid: str, salt: str | None = None) -> str | None:
        """The content key of the image the client named ``uuid`` (vLLM's per-part field) in the
        session ``session_id`` or a session or cache entry of the scope of ``salt``; None if none
        remembers it. Never raises."""
        return self.sharing.uuid_key(self.store.peek(session_id) if session_id else None, uuid, salt)

    def url_key(self, session_id: str | None, url: str) -> str | None:
        """The content key of the image the session fetched from ``url`` before, or None."""
        session = self.store.peek(session_id) if session_id else None
        return None if session is None else session.image_urls.get(url)

    def remember_urls(self, session_id: str, urls: dict[str, str], uuids: dict[str, str] | None = None) -> None:
        """Remember which image each URL gave (``url → content key``) so it is not fetched again in
        this session, and which image each client ``uuid`` names. Never raises (a session gone
        meanwhile is skipped)."""
        session = self.store.peek(session_id)
        if session is None:
            return
        for url, key in urls.items():
            session.remember_url(url, key)
        for uuid, key in (uuids or {}).items():
            session.remember_uuid(uuid, key)

    def retain(self, session_id: str) -> bool:
        """End a chat request that had no session: keep its state (images, features, KV of prompt
        and answer) as a conversation-cache entry (:meth:`SessionStore.retain`), so the same
        conversation resent with its next turn (or another starting alike, within the same salt)
        prefills only what is new; the entry it was copied from goes when the new one serves all
        it served. Removed instead when the cache is off or the request's scope shares nothing.
        Returns whether it is held. Never raises."""
        session = self.store.peek(session_id)
        if session is None or session.busy or session.anonymous:
            return False
        limits = self.limits
        if limits.cache_share <= 0 or self.sharing.scope(session.salt) is None or session.kv_cache is None:
            with contextlib.suppress(ServiceError):  # expired meanwhile: gone already
                self.store.remove(session_id)
            return False
        source = self.store.peek(session.source_id) if session.source_id else None
        drop = source if source is not None and source.anonymous and self._serves(session, source) else None
        budget = int(self.store.device_budget_bytes * min(limits.cache_share, 1.0))
        return self.store.retain(session, max_bytes=budget, max_entries=limits.cache_entries, drop=drop)

    def _serves(self, new: Session, old: Session) -> bool:
        """Whether ``new``'s KV cache serves all of ``old``'s conversation up to its next question."""
        ids = self.model.template.prefix_ids(old.chat())
        return reusable_len(new, ids, old.image_keys, old.image_tokens, self.model.image_token_id) == len(ids)

    def start_chat(
        self,
        session_id: str,
        target: ChatTarget,
        params: SamplingParams,
        *,
        clip_max_new_tokens: bool = False,
        salt: str | None = None,
    ) -> Sequence:
        """Admit a whole conversation resent by the client (OpenAI ``messages``) and return the
        :class:`~.sequence.Sequence` answering its last user message.

        The session comes to hold ``target`` (its previous conversation is replaced; it is the cache
        of the client's): the feature rows of every image it already holds (or, with
        ``share_images``, any session holds; matched by content key and layout) are kept, the rest
        are encoded in the answer's first step; the KV cache is kept up to the first token or image
        that differs (or a longer prefix another session holds is copied), so a resent history costs
        its new tokens and an edited earlier message re-prefills from the edit. The answer joins the
        history, and the answer is the tokens a from-scratch ``generate`` on the same templated
        conversation gives. A conversation that does not fit is refused, never truncated. ``salt``:
        the request's ``cache_salt``; state is found in and shared with its scope only.

        Raises:
            ServiceError: session_* (gone), session_busy, invalid_parameter (the image placeholder in
                a message, max_new_tokens over the cap, a question too long), image_limit_exceeded,
                context_length_exceeded, overloaded (no device memory now).
        """
        seq = self._admission.conversation(session_id, target, params, clip_max_new_tokens, salt)
        self._check()
        return seq

    def reset(self, session_id: str) -> None:
        """Forget the history, keep the images (and the cached prefix up to where the conversation
        changes): every image now opens the next question.

        Raises:
            ServiceError: session_not_found / _expired / _evicted, session_busy; invalid_request when
                an image follows a video among the session's media (one question could not hold them
                in their order: the chat template renders a message's images first).
        """
        session = self._admission.idle_session(session_id)
        if Chat(None, (), len(session.images), videos=video_indexes(session.image_sizes)).image_after_video():
            raise ServiceError(
                ErrorCode.INVALID_REQUEST,
                "this session holds an image after a video, which one question cannot render in that order; "
                "the conversation is kept as it was: ask on, or open a new session to start over",
            )
        session.forget_history()
        if session.kv_cache is not None:
            session.crop_kv(common_prefix_len(session.cached_ids, self.model.template.prefix_ids(session.chat())))
        self._check()

    def close(self, session_id: str) -> None:
        """Close the session and free everything it holds.

        Raises:
            ServiceError: session_not_found / _expired / _evicted, session_busy.
        """
        self._admission.idle_session(session_id)
        self.store.remove(session_id)

    def history(self, session_id: str) -> list[Turn]:
        return list(self.store.get(session_id).history)  # the remembered turns of a session (a copy)

    def check_idle(self, session_id: str) -> None:
        """Check that ``session_id`` is open and not answering (raises session_* (gone), session_busy)."""
        self._admission.idle_session(session_id)

    def check_video(self) -> None:
        """Check that the model has a video path, before a video is fetched or decoded (raises
        ServiceError video_unsupported: :meth:`Admission.check_video <.admission.Admission.check_video>`)."""
        self._admission.check_video()

    # ------------------------------------------------------------------ answers
    def start(
        self,
        session_id: str,
        prompt: str,
        params: SamplingParams | None = None,
        remember: bool = True,
        *,
        context_policy: ContextPolicy = "truncate",
        clip_max_new_tokens: bool = False,
    ) -> Sequence:
        """Admit a question and return its :class:`~.sequence.Sequence` (nothing computed yet).

        Context policy, when prompt tokens + ``max_new_tokens`` > the model's max positions:
        ``truncate`` drops the oldest remembered turns, one at a time, until the turn fits (the
        system prompt and the images never leave: a dropped turn's images open the first turn
        kept); if none is left and ``clip_max_new_tokens``, ``max_new_tokens`` is lowered to the
        room left. The dropped turns leave the session's history when the answer completes (an
        abandoned answer changes nothing). ``error`` changes nothing and raises.

        Args:
            session_id: an open session.
            prompt: the user's question (plain text; must not contain the image placeholder).
            params: sampling parameters; with ``n`` > 1 the answer returned is the head of ``n``
                (:attr:`~.sequence.Sequence.samples`, :mod:`.samples`).
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
        seq = self._admission.question(
            session_id, prompt, params or SamplingParams(), remember, context_policy, clip_max_new_tokens
        )
        self._check()
        return seq

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
        """Answer ``prompt`` in one call (:meth:`start`, then its steps to the end); returns the head's answer.

        Raises:
            ServiceError: as :meth:`start`, and overloaded when memory runs out (session intact).
        """
        seq = self.start(
            session_id,
            prompt,
            params,
            remember,
            context_policy=context_policy,
            clip_max_new_tokens=clip_max_new_tokens,
        )
        while not seq.all_done:  # and the request's other answers (``params.n``)
            self.step([seq])
        if seq.error is not None:
            raise seq.error
        assert seq.answer is not None
        return seq.answer

    # ------------------------------------------------------------------ the step
    def step(self, work: GenericSequence[EngineRequest], *, prefill_budget: int | TimeBudget | None = None) -> None:
        """Run one engine step over ``work``: schedule it (:func:`~.scheduler.schedule`: decode rows
        first, then prefill chunks, questions before images, within ``prefill_budget``: tokens, or a
        :class:`~.scheduler.TimeBudget` sized by the passes' measured costs; None: every chunk runs
        whole), execute the plan and apply what it produced. Device memory comes with the plan only
        (scheduler rules 10-11): its preemptions, then room for the decode batch and each request's start.
        A request listed twice in ``work`` runs once. A request whose step fails gets its ``error``
        set and its session put back as before (an open's session is removed); the others are
        untouched. Never raises ``Exception``. Async scheduling (:mod:`.ahead`): a step over the answers
        of the decode step in flight launches the next and records theirs; any other records them first.
        """
        live = runnable(work)  # work listed twice runs once; a request's other answers (``n``) too
        if self._execute.step_ahead(live):  # the answers in flight: the next step launched, theirs recorded
            self._check()
            return
        live = runnable(work)  # the tokens in flight are recorded: some answers may have ended
        views, layout = [w.view() for w in live], self.batch.layout()
        cost = self.runner.costs.estimate()  # rule 11 on the ledger's room, read only when the step opens pages
        plan = schedule(views, prefill_budget, layout, cost, fuse=self.fuse, room_bytes=self.store.room_bytes)
        seqs = [g for i in plan.decode if isinstance(g := live[i], Sequence)]  # only answers decode
        leaving = tuple(g for i in plan.room.preempt if isinstance(g := live[i], Sequence))
        room = BatchRoom(plan.rebuild, plan.batch_bytes, leaving, plan.room)
        chunks = list(plan.prefill)
        if plan.fuse:
            first = chunks.pop(0)
            self._execute.decode_with_chunk(seqs, room, live[first.index], first)
        elif seqs:
            self._execute.decode(seqs, room)
        self._execute.run_chunks([(live[chunk.index], chunk) for chunk in chunks])
        self._check()

    def abandon(self, work: EngineRequest) -> None:
        """Abandon ``work`` (an answer or an added image leaves its session as before, an open's is removed)."""
        self._execute.settle()
        self._execute.outputs.put_back(work)  # no-op once done (but a head whose turn waits)

    def _run_whole(self, prefill: ImagePrefill) -> Any:
        """Step ``prefill`` alone without a budget until done; returns its result or raises its error."""
        while not prefill.done:
            self.step([prefill])
        if prefill.error is not None:
            raise prefill.error
        return prefill.result

    def _check(self) -> None:
        if self.check_invariants:
            self.store.check_invariants()
            self.runner.check_pool(s.kv_cache for s in self.store.sessions())
