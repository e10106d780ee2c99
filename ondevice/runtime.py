"""``Runtime``: the public API of a loaded model (generate / stream / chat), locking and cancel."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Sequence

from ondevice import inputs
from ondevice.backends.base import Backend
from ondevice.costs import Costs, ProbeCancelled
from ondevice.drafters.base import Drafter
from ondevice.errors import OndeviceError
from ondevice.media import MediaPrompt
from ondevice.params import GenerateRequest
from ondevice.policy import AdaptivePolicy, FixedGamma
from ondevice.results import Chunk, Result, Stats
from ondevice.slot import Slot
from ondevice.streams import AsyncStream, Request, Stream
from ondevice.text import TextAssembler, add_tail, step_chunks
from ondevice.threads import release_omp_team


class Runtime:
    """A loaded target (and drafter), ready to generate. Calls from several threads are serialised.

    The runtime drives one ``Slot`` (``self.slot``: the sequence's cache prefix and per-request state, kept
    consistent however a request is interrupted); ``reset()`` empties both caches whatever state they are in.
    """

    draft_choice: dict | None = None  # set by load(draft="auto"): what was chosen and why
    constraints_and_logprobs = True  # a sharded runtime does not replay them on its other ranks yet
    projector = None  # the vision projector (``ondevice.backends.llama_mtmd.Projector``), once attached
    mmproj = None  # set by load(): a projector found beside the model, attached at the first image
    reasoning_budget: int | None = None  # the server's default budget for thinking models (serve --reasoning-budget)

    def __init__(self, target: Backend, drafter: Drafter | None, *, vocab_limit: int, load_seconds: float = 0.0) -> None:
        self.target = target
        self.vocab_limit = vocab_limit
        self.load_seconds = load_seconds
        # Both caches must hold every position: a pair agrees on the smaller context.
        db = drafter.backend if drafter is not None else None
        self.n_ctx = min(target.n_ctx, db.n_ctx) if db is not None else target.n_ctx
        self._lock = threading.RLock()  # guards native state; user code runs under it only as an observer
        self._turn = threading.Lock()  # one request at a time (a stream holds it until it ends)
        self._owner: int | None = None  # the thread whose request holds the slot
        self._current: Request | None = None
        self._closed = False
        self._closing = False  # set first by close(): requests still waiting for the slot then refuse to run
        self.slot = Slot(target, drafter, n_ctx=self.n_ctx)
        self.observer = None  # optional verify observer (benchmarks): see speculative.steps
        self.last_stats: Stats | None = None  # statistics of the last finished request
        self._adaptive = None  # AdaptivePolicy, created at the first gamma="auto" request

    drafter = property(lambda self: self.slot.drafter, lambda self, d: setattr(self.slot, "drafter", d),
                       doc="The drafter: the slot's (one sequence, one drafter); setting it swaps the slot's.")

    @property
    def draft_backend(self) -> Backend | None:
        """The draft model's backend, when the drafter has one (its cost is measured; its context bounds ours)."""
        return self.drafter.backend if self.drafter is not None else None

    # -- context manager -------------------------------------------------------------------------
    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Cancel any running stream, wait for it, then free native memory (both models).

        Idempotent. Every later call raises a clear ``OndeviceError``, also in threads that were
        waiting for their turn when the runtime was closed: they never run, and ``close()`` does not wait
        for them.
        """
        self._closing = True
        self.cancel()
        if not self._enter(None, closing=True):
            return
        try:
            with self._lock:
                self._closed = True
                if self.drafter is not None:
                    self.drafter.close()
                if self.projector is not None:
                    self.projector.close()  # libmtmd holds the model: freed first
                self.target.close()
        finally:
            self._exit()

    # -- API -------------------------------------------------------------------------------------
    def tokenize(self, text: str, *, add_bos: bool = True) -> list[int]:
        """Tokenize as llama-cpp-python's create_completion does (BOS per model metadata, specials parsed)."""
        if not isinstance(text, str):
            raise OndeviceError(f"text to tokenize must be a str, not {type(text).__name__}")
        inputs.check_text(text, "the prompt")
        with self._lock:
            self._check_open()
            return self.target.tokenize(text, add_bos=add_bos, special=True)

    def stream(self, prompt: str | Sequence[int], request: GenerateRequest | None = None, **options) -> Stream:
        """Generate, yielding ``Chunk(text, tokens, from_draft)`` as target passes complete.

        Args:
            prompt: text (tokenized like create_completion), token ids, or a ``MediaPrompt`` (messages with
                images: ``chat_prompt``; it serves this one request).
            request: a ``GenerateRequest`` (sampling, max_tokens, gamma, stop, response_format, grammar,
                logprobs, top_logprobs), or none and the same options as keywords: ``max_tokens`` (default
                256), ``temperature``, ``top_k``, ``top_p``, ``min_p``, ``repetition_penalty``, ``seed`` (see
                ``SamplingParams``), ``gamma`` ("auto", the cost-aware policy: plain steps wherever speculation
                would not pay, or a fixed number of tokens drafted per target pass, 0 = plain decoding),
                ``stop`` (strings that end generation, not included in the text), ``reasoning_budget`` (thinking
                tokens at most, then the end of thinking is forced: ``ondevice.budget``), ``response_format`` /
                ``grammar`` (a constraint, exact under speculation: ``ondevice.constrain``) and ``logprobs`` /
                ``top_logprobs`` (``Chunk.logprobs``, ``Result.logprobs``: ``ondevice.logprobs``).
        Returns:
            A ``Stream``: iterate it for chunks; ``.cancel()`` stops it; ``.stats`` when finished. A stream dropped
            unfinished ends at once; a new request from the thread that left one unfinished ends that stream first.
        Raises:
            OndeviceError: a bad argument (checked here, before anything runs) or a closed runtime.
        """
        request = GenerateRequest.resolve(request, options)
        self._supersede()
        media = prompt if isinstance(prompt, MediaPrompt) else None
        ids = self._prompt_ids(prompt if media is None else media.ids())
        constraint = self._constraint(request.response_format, request.grammar)
        if request.reasoning_budget is not None:
            constraint = self._budget(ids, request.reasoning_budget, constraint)
        n_lp = request.top_logprobs if (request.logprobs or request.top_logprobs) else None
        extra = {k: v for k, v in (("constraint", constraint), ("n_logprobs", n_lp)) if v is not None}
        if extra and not self.constraints_and_logprobs:
            raise OndeviceError(f"{', '.join(extra)}: not supported by a sharded target yet; load the model on one rank")
        extra.update({"media": media} if media is not None else {})
        return Stream(lambda out: self._run(ids, request, out, **extra), Request())

    def _constraint(self, response_format, grammar):
        """The request's compiled ``Constraint`` (None when unconstrained); compile errors raise here."""
        if response_format is None and grammar is None:
            return None
        from ondevice.constrain import Constraint

        with self._lock:
            self._check_open()
            return Constraint.build(self.target, response_format, grammar)

    def _budget(self, ids: list[int], budget: int, inner):
        """The request's ``ThinkingBudget`` (``ondevice.budget``) around its constraint ``inner``."""
        from ondevice.budget import ThinkingBudget

        with self._lock:
            self._check_open()
            return ThinkingBudget.for_prompt(self.target, ids, budget, inner)

    def astream(self, prompt: str | Sequence[int], request: GenerateRequest | None = None, **options) -> AsyncStream:
        """``stream`` for asyncio: ``async for chunk in rt.astream(prompt, ...)``.

        Takes the same arguments as ``stream``. The model runs on a worker thread, one pass per chunk
        asked for; leaving the ``async for`` early ends the request at once, and ``Runtime.last_stats``
        then holds its statistics.
        """
        return AsyncStream(self.stream(prompt, request, **options))

    def generate(self, prompt: str | Sequence[int], request: GenerateRequest | None = None, **options) -> Result:
        """Generate to completion. Takes the same arguments as ``stream``; returns ``Result``."""
        s = self.stream(prompt, request, **options)
        for _ in s:
            pass
        return Result(s.text, s.tokens, s.stats, s.logprobs)

    def chat(self, messages: Sequence[dict], request: GenerateRequest | None = None, **options) -> Result:
        """Render ``messages`` with the model's chat template, then ``generate``.

        ``messages``: a non-empty list of {role, content}; content is a string, None (empty) or a list of
        OpenAI content parts: ``{"type": "text", "text": ...}`` (joined) and ``{"type": "image_url", "image_url":
        {"url": a data: URL or a local path}}`` (a GGUF model with its vision projector: ``chat_prompt``).
        """
        request = GenerateRequest.resolve(request, options)  # bad options fail before the template renders
        return self.generate(self.chat_prompt(messages), request)

    def chat_prompt(self, messages: Sequence[dict], add_generation_prompt: bool = True,
                    tools: Sequence[dict] | None = None):
        """``render_chat``, or, when a message has ``image_url`` parts, a ``MediaPrompt`` for ``stream`` /
        ``generate`` (``ondevice.media``; the projector from ``load(mmproj=)`` or found beside the model). Raises
        OndeviceError as ``render_chat``, for a bad image, or for a model without a projector given an image."""
        from ondevice.media import chat_prompt

        return chat_prompt(self, messages, add_generation_prompt, tools)

    def render_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True,
                    tools: Sequence[dict] | None = None) -> list[int]:
        """Token ids of ``messages`` (and OpenAI ``tools``, if any) rendered with the model's chat template (an
        untrusted template renders in a worker process with a time, memory, output and recursion budget:
        ``ondevice.templates``).

        Raises:
            OndeviceError: bad messages, no template, or a template that fails or exceeds its budget.
        """
        text, add_bos = self.render_text(messages, add_generation_prompt, tools)
        return self.tokenize(text, add_bos=add_bos)

    def render_text(self, messages: Sequence[dict], add_generation_prompt: bool = True,
                    tools: Sequence[dict] | None = None, variables: dict | None = None) -> tuple[str, bool]:
        """``render_chat``'s text (``variables``: further template variables, e.g. enable_thinking), and whether
        to add a BOS when tokenizing it (the template wrote none)."""
        from ondevice.chat import render

        t = self.target
        with self._lock:
            self._check_open()
            bos = t.token_bytes(t.bos_id).decode("utf-8", "replace") if t.bos_id is not None else ""
        text = render(t.chat_template, messages, add_generation_prompt=add_generation_prompt, bos_token=bos,
                      source=str(t.path), tools=tools, variables=variables)
        return text, not (bos and text.startswith(bos))

    def embed(self, texts):
        """Unit-length embeddings [len(texts), n_embd] of ``texts`` (a string, or a list of strings or token-id
        lists) with this runtime's GGUF model (``ondevice.embed``: llama.cpp's embedding path, a second context).
        Raises OndeviceError for a model on another backend, empty or over-long input."""
        from ondevice.embed import embed

        return embed(self, texts)

    def reset(self) -> None:
        """Forget the cached prefix: the next request evaluates its whole prompt. Always restores a
        consistent state, whatever interrupted the previous request."""
        self._enter(None)
        try:
            with self._lock:
                self.slot.forget()
        finally:
            self._exit()

    def cancel(self) -> None:
        """Cancel the stream that is running now, if any."""
        cur = self._current
        if cur is not None:
            cur.cancel_event.set()

    # -- requests --------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise OndeviceError("this Runtime is closed; load() a new one")

    def _prompt_ids(self, prompt) -> list[int]:
        t = self.target
        self._check_open()
        if isinstance(prompt, str):
            ids = self.tokenize(prompt) if prompt else ([t.bos_id] if t.bos_id is not None else [])
            if not ids:
                raise OndeviceError("empty prompt and the model has no BOS token to start from; pass some text")
        else:
            ids = inputs.token_ids(prompt, t.vocab_size, t.bos_id)
        if len(ids) >= self.n_ctx:
            raise OndeviceError(f"prompt is {len(ids)} tokens but n_ctx is {self.n_ctx}; raise n_ctx or shorten the prompt")
        return ids

    def _supersede(self) -> None:
        """End the stream this thread left unfinished (it holds the slot this thread now asks for);
        refuse a call from inside a running stream (e.g. from a callback), which would deadlock."""
        if self._owner != threading.get_ident():
            return
        cur = self._current
        gen = cur.gen() if cur is not None and cur.gen is not None else None
        if gen is not None and gen.gi_running:
            raise OndeviceError("a new request cannot start from inside a running stream of this Runtime "
                                "(e.g. from a callback); finish, cancel or close that stream first")
        if gen is not None:
            gen.close()

    def _enter(self, req: Request | None, closing: bool = False) -> bool:
        """Take the request slot (waiting for the request that holds it), after ending a stream this
        thread left unfinished. Returns False (slot not taken) when closing a closed runtime."""
        self._supersede()
        self._turn.acquire()
        if self._closed or (self._closing and not closing):
            self._turn.release()
            if closing:
                return False
            raise OndeviceError("this Runtime is closed; load() a new one")
        self._owner = threading.get_ident()
        self._current = req
        return True

    def _exit(self) -> None:
        self._owner = None
        self._current = None
        self._turn.release()
        release_omp_team()  # this thread may not decode next: one team per process keeps libgomp spinning

    # -- the loop --------------------------------------------------------------------------------
    def _policy(self, gamma, stats: Stats, cancelled=None):
        """FixedGamma(γ), or the runtime's adaptive policy (measuring costs on first use; ``cancelled`` stops
        that probe with ``ProbeCancelled``)."""
        if gamma != "auto":
            return FixedGamma(int(gamma))
        if self._adaptive is None:
            t0 = time.perf_counter()
            with self._lock:
                costs = self._costs(cancelled)
            spt = self.drafter.seconds_per_token()
            if spt is not None:  # a drafter without a backend (heads): its own measured cost per token
                costs = dataclasses.replace(costs, target_seconds=dict(costs.target_seconds), draft_seconds=spt)
            self._adaptive = AdaptivePolicy(costs, self.drafter.traits)
            stats.probe_seconds = time.perf_counter() - t0
        return self._adaptive

    def _costs(self, cancelled=None) -> Costs:
        """Measured costs, cached on disk per model files, device and threads (a probe of a few seconds).

        The probe fills both caches with synthetic tokens: the bookkeeping is emptied first, and the
        probe empties the caches again whatever happens, so an interrupted probe leaves nothing stale.
        """
        from ondevice.costs import cached_measure

        self.slot.kv = []
        if self.drafter is not None:
            self.drafter.reset()
        return cached_measure(self.target, self.draft_backend, cancelled)

    def _run(self, ids: list[int], req: GenerateRequest, out: Request, constraint=None, n_logprobs: int | None = None,
             media=None):
        """The generator behind a ``Stream``: takes the turn at the first chunk, releases it when it ends."""
        self._enter(out)
        stats = out.stats
        try:
            if self._admit(ids, req, out, constraint, n_logprobs, media):
                yield from self._iterate(req, out, constraint)
        except GeneratorExit:  # the stream was closed or dropped unfinished
            stats.stop_reason = stats.stop_reason or "cancelled"
            raise
        except BaseException:
            stats.stop_reason = stats.stop_reason or "error"
            raise
        finally:
            self.slot.finish(time.perf_counter())
            self.last_stats = stats
            if media is not None:
                media.close()
            self._exit()

    def _admit(self, ids: list[int], req: GenerateRequest, out: Request, constraint, n_logprobs, media=None) -> bool:
        """Choose the request's policy (maybe probing costs first), prefill its prompt and set up its steps.
        Returns False when it was cancelled during the cost probe."""
        stats, slot = out.stats, self.slot
        slot.open(stats)
        stats.load_seconds, stats.prompt_tokens = self.load_seconds, len(ids)
        use_draft = self.drafter is not None and req.gamma != 0
        stats.drafter = self.drafter.name if use_draft else "none"
        try:
            policy = self._policy(req.gamma, stats, out.cancel_event.is_set) if use_draft else FixedGamma(0)
        except ProbeCancelled:  # cancelled (e.g. a server shutting down) while measuring costs
            stats.stop_reason = "cancelled"
            return False
        trees = use_draft and self.drafter.traits.trees and constraint is None and self.observer is None \
            and self.target.tree_unsupported() is None and media is None  # best-first trees sized by the policy
        with self._lock:
            slot.admit(ids, params=req.sampling, policy=policy, draft=use_draft, trees=trees, constraint=constraint,
                       logprobs=n_logprobs, observer=self.observer,
                       media=None if media is None else (media.projector, media.prompt))
        if n_logprobs is not None:
            out.logprobs = []
        return True

    def _iterate(self, req: GenerateRequest, out: Request, constraint):
        """Step the slot and release its text until EOS, a stop string, ``max_tokens``, a full context or a cancel."""
        slot, stats = self.slot, out.stats
        text = TextAssembler(self.target.token_bytes, req.stop)
        while True:
            with self._lock:  # native state is touched only here; user code never runs under it
                step = slot.step()
            chunks = [] if step is None else self._account(step, text, req.max_tokens, constraint)
            if step is None:
                stats.stop_reason = "context"
            if stats.stop_reason or out.cancel_event.is_set():
                add_tail(chunks, text.flush())
            for c in chunks:
                out.add(c)
                if c.tokens and slot.t_first is None:
                    slot.t_first = time.perf_counter()
            yield from chunks
            if stats.stop_reason:
                break
            if out.cancel_event.is_set():
                stats.stop_reason = "cancelled"
                break

    def _account(self, step, text: TextAssembler, max_tokens: int, constraint) -> list[Chunk]:
        """A step into the statistics and the policy's cost model; its tokens into chunks of text."""
        slot, stats = self.slot, self.slot.stats
        stats.add(step)
        if stats.target_forwards > 1:  # the first pass holds the prompt
            slot.policy.observe_step(step.drafted, step.verify_seconds, step.draft_seconds, step.copied)
        if stats.target_forwards == 1:
            stats.prompt_seconds = time.perf_counter() - slot.t_start
        chunks = step_chunks(step, self.target.is_eog, text, stats, max_tokens)
        if not stats.stop_reason and constraint is not None and constraint.is_done():
            stats.stop_reason = "eos"  # only an end of generation may follow: no pass is spent on it
        return chunks
