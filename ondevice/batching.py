"""``BatchEngine``: several requests decoded together in one llama.cpp batch (continuous batching, ``--parallel N``).

Each request takes a ``Slot`` with a sequence id of its own; between steps requests join (their prompt is
prefilled alone, on their own sequence, one ``n_batch`` chunk between two decode steps, so a long prompt does
not stall the others) and leave (the slot is free for the next step). One step is one ``llama_decode``
holding every active slot's pending token; each slot then draws its next token from its own
row with the one-slot path's code (``constraint.mask_rows``, ``verify_logits``, ``token_logprobs``, the
slot's own seeded generator), so an answer does not depend on what else shares the batch.

Exactness: on a context with one KV buffer per sequence (``LlamaBackend(kv_unified=False)``, as
``load(..., parallel=N)`` makes it), a decode step of one row per sequence and a prompt prefilled alone give
the logits a one-sequence context gives (the layout ``ondevice.heads.batch`` relies on), so a greedy or
seeded answer equals its one-at-a-time answer token for token (tests/test_parallel.py).

Limits: slots decode plain (γ = 0: no drafter, no trees; a batched verify of several slots' drafts is not
built); ``Runtime.stream`` on the same runtime speculates (chains) one request at a time and waits while a
batch runs (sequence 0 is shared: each continues from what the other left there). A sequence keeps its cells
when its request ends: a request takes the free sequence holding the longest prefix of its prompt, or a longer
prefix from the disk prompt cache (``load(..., prompt_cache=)``), and evaluates only the rest. llama.cpp only.
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ondevice.batch_load import build_parallel  # noqa: F401 - ondevice.loader imports it from here
from ondevice.drafters.base import common_prefix
from ondevice.errors import OndeviceError
from ondevice.logprobs import token_logprobs
from ondevice.params import GenerateRequest
from ondevice.results import Chunk, Result
from ondevice.sampling import verify_logits
from ondevice.slot import Slot
from ondevice.speculative import Step
from ondevice.streams import AsyncStream, Request, Stream
from ondevice.text import TextAssembler, add_tail, step_chunks

_END = object()  # posted after a request's last chunk


@dataclass(eq=False)
class _Job:
    """One request: its prompt, options, output queue and (while it runs) its slot."""

    ids: list[int]
    req: GenerateRequest
    out: Request
    constraint: object = None
    n_logprobs: int | None = None
    chunks: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    slot: Slot | None = None
    text: TextAssembler | None = None
    rows: list = field(default_factory=list)  # prompt rows still to prefill: (sequence, position, token)
    disk: tuple = (0, None)  # (tokens, restore) of the longest prefix the disk prompt cache holds


class BatchEngine:
    """Up to ``n`` requests of one runtime decoded together, one sequence id each.

    Args:
        rt: a ``Runtime`` loaded with ``load(..., parallel=N)`` (a llama.cpp target with one KV buffer per
            sequence and N sequence ids).
        n: slots (default: the target's sequence ids).
    Raises:
        OndeviceError: the target cannot decode several sequences exactly (another backend, or one KV buffer).
    """

    def __init__(self, rt, n: int | None = None) -> None:
        t = rt.target
        if not hasattr(t, "eval_seqs"):
            raise OndeviceError(f"{type(t).__name__}: parallel slots need a llama.cpp (GGUF) model; "
                                "MLX and Core ML models serve one request at a time")
        if getattr(t, "kv_unified", True) or t.n_seq_max < 2:
            raise OndeviceError("this runtime was not loaded for parallel slots; load(..., parallel=N) with N >= 2")
        self.rt, self.n = rt, min(int(n or t.n_seq_max), t.n_seq_max)
        if self.n < 1:
            raise OndeviceError(f"n={n}: a BatchEngine needs at least one slot")
        self.n_ctx = min(rt.n_ctx, t.n_ctx_seq)  # the cells one sequence holds
        self._cv = threading.Condition()
        self._waiting: deque[_Job] = deque()
        self._active: dict[int, _Job] = {}  # sequence id → job
        self._kv: dict[int, list[int]] = {s: [] for s in range(self.n)}  # a prefix of what each sequence holds
        self._worker: threading.Thread | None = None
        self._turn = Request()  # what the runtime sees while a batch holds its turn (Runtime.cancel sets it)
        self.steps = 0  # batched decode steps so far
        self.max_active = 0  # most slots one step has held
        self.on_step = None  # optional: called with the sequence ids of each batched step (tests, benchmarks)

    # -- API -------------------------------------------------------------------------------------
    def stream(self, prompt: str | Sequence[int], request: GenerateRequest | None = None, **options) -> Stream:
        """Queue a request; its chunks stream as the batch decodes it (``Runtime.stream``'s arguments; ``gamma``
        is ignored: slots decode plain). The request starts at once, before the stream is iterated; closing or
        cancelling the stream frees its slot before the next step."""
        req = GenerateRequest.resolve(request, options)
        rt = self.rt
        ids = rt._prompt_ids(prompt)
        if len(ids) >= self.n_ctx:
            raise OndeviceError(f"prompt is {len(ids)} tokens but a parallel slot holds {self.n_ctx}; "
                                "raise n_ctx or shorten the prompt")
        constraint = self._constraint(req)
        n_lp = req.top_logprobs if (req.logprobs or req.top_logprobs) else None
        out = Request()
        job = _Job(ids, req, out, constraint, n_lp, disk=self._lookup(ids))
        out.stats.prompt_tokens, out.stats.load_seconds = len(ids), rt.load_seconds
        with self._cv:
            self._waiting.append(job)
            if self._worker is None:
                self._worker = threading.Thread(target=self._run, name="ondevice-batch", daemon=True)
                self._worker.start()
        stream = Stream(lambda r: _consume(job), out)
        weakref.finalize(stream, out.cancel_event.set)  # a stream dropped unread frees its slot too
        return stream

    def _lookup(self, ids: list[int]) -> tuple:
        """The disk prompt cache's longest prefix of ``ids`` longer than any free sequence holds now (read and
        checked here, on the caller's thread: the running slots keep decoding meanwhile); (0, None) without one."""
        pc = self.rt.slot.prompt_cache
        if pc is None or len(ids) - 1 < pc.min_tokens:
            return 0, None
        with self._cv:  # the worker adds and removes active slots under it
            free = [list(kv) for s, kv in self._kv.items() if s not in self._active]
        return pc.lookup(ids, more_than=max([common_prefix(kv, ids) for kv in free] or [0]))

    def _constraint(self, req: GenerateRequest):
        """The request's compiled constraint (None: unconstrained). The vocabulary is read under the runtime's
        lock (once per model); the grammar compiles outside it, so the running slots keep decoding meanwhile."""
        if req.response_format is None and req.grammar is None:
            return None
        from ondevice.constrain import Constraint, grammar_text, tokenizer_for

        text = grammar_text(req.response_format, req.grammar)
        if text is None:
            return None
        with self.rt._lock:
            self.rt._check_open()
            tok = tokenizer_for(self.rt.target)
        return Constraint(tok, text)

    def astream(self, prompt, request: GenerateRequest | None = None, **options) -> AsyncStream:
        """``stream`` for asyncio."""
        return AsyncStream(self.stream(prompt, request, **options))

    def generate(self, prompt, request: GenerateRequest | None = None, **options) -> Result:
        """Generate to completion (other requests keep decoding alongside); returns ``Result``."""
        return _result(self.stream(prompt, request, **options))

    def generate_many(self, prompts: Sequence, request: GenerateRequest | None = None, **options) -> list[Result]:
        """Generate every prompt together; results in prompt order."""
        return [_result(s) for s in [self.stream(p, request, **options) for p in prompts]]

    @property
    def active(self) -> int:  # requests decoding now
        return len(self._active)

    def cancel_all(self) -> None:
        """Cancel every request, running or waiting."""
        with self._cv:
            for j in [*self._waiting, *self._active.values()]:
                j.out.cancel_event.set()

    # -- the loop --------------------------------------------------------------------------------
    def _run(self) -> None:
        """The worker: takes the runtime's turn while any request is waiting or running."""
        rt = self.rt
        self._turn = Request()  # a fresh one per run: an earlier Runtime.cancel does not end this one
        try:
            rt._enter(self._turn)
        except BaseException as e:  # noqa: BLE001 - a closed runtime: every waiting request gets the error
            self._fail_waiting(e)
            return
        try:
            with rt._lock:
                self._adopt()
            while self._loop_once():
                pass
        except BaseException as e:  # noqa: BLE001 - a failed decode: every running request gets the error
            for s in list(self._active):
                self._end(s, "error", e)
            self._fail_waiting(e)
        finally:
            try:
                with rt._lock:  # the one-slot path (sequence 0) continues from what sequence 0 holds
                    rt.slot.kv = list(self._kv[0])
            finally:
                rt._exit()

    def _adopt(self) -> None:
        """At the start of a run: what each sequence still holds. Sequence 0 is the one-slot path's (its
        ``Slot.kv``); another sequence is kept only if llama.cpp still holds exactly what the engine left there
        (a one-slot request that emptied the cache emptied every sequence)."""
        t = self.rt.target
        self._kv[0] = list(self.rt.slot.kv)
        for s in range(self.n):
            kv = self._kv[s]
            if t.seq_len(s) != len(kv) and not (kv and t.rollback_seq(s, len(kv))):
                self._kv[s] = []
                t.clear_seqs(s)

    def _fail_waiting(self, e: BaseException) -> None:
        with self._cv:
            waiting, self._waiting = list(self._waiting), deque()
            self._worker = None
        for j in waiting:
            j.out.stats.stop_reason = "error"
            j.chunks.put(e)

    def _loop_once(self) -> bool:
        """Admit, drop the cancelled, run one batched step. False when nothing is left to do."""
        if self._turn.cancel_event.is_set():  # Runtime.cancel / close: end everything
            self.cancel_all()
        with self._cv:
            new, gone = [], []
            while self._waiting and len(self._active) + len(new) < self.n:
                j = self._waiting.popleft()
                (gone if j.out.cancel_event.is_set() else new).append(j)
            pairs = []
            for j in new:  # the free sequence holding the longest prefix of the prompt (then the lowest id)
                free = [s for s in range(self.n) if s not in self._active]
                s = max(free, key=lambda s: (common_prefix(self._kv[s], j.ids), -s))
                self._active[s] = j
                pairs.append((s, j))
            if not self._active:
                self._worker = None
        for j in gone:  # cancelled while waiting: nothing was evaluated for it
            j.out.stats.stop_reason = "cancelled"
            j.chunks.put(_END)
        if not self._active:
            return False
        for s, j in pairs:
            self._admit(s, j)
        for s in [s for s, j in self._active.items() if j.out.cancel_event.is_set()]:
            self._end(s, "cancelled")
        for s in [s for s, j in self._active.items() if j.rows]:
            self._prefill(s)
        if any(not j.rows for j in self._active.values()):
            self._step()
        return True

    def _admit(self, s: int, job: _Job) -> None:
        """Prefill the job's prompt alone on sequence ``s`` (all but its pending last token)."""
        rt, t, ids = self.rt, self.rt.target, job.ids
        slot = job.slot = Slot(t, None, n_ctx=self.n_ctx, seq_id=s)
        slot.open(job.out.stats)
        slot.t_start = time.perf_counter()
        slot.context = list(ids)
        slot.rng = np.random.default_rng(job.req.sampling.seed)
        job.text = TextAssembler(t.token_bytes, job.req.stop)
        if job.n_logprobs is not None:
            job.out.logprobs = []
        try:
            with rt._lock:
                keep = min(common_prefix(self._kv[s], ids), len(ids) - 1)
                (n_disk, restore), job.disk = job.disk, (0, None)  # the state read from disk is let go here
                if restore is not None and n_disk > keep:  # a longer prefix on disk: it replaces the sequence
                    self._kv[s] = []
                    keep = restore(s)  # 0, the sequence emptied, when llama.cpp refuses the file
                    self._kv[s] = list(ids[:keep])
                self._kv[s] = self._kv[s][:keep]  # shortened before the cache is cut
                if not t.rollback_seq(s, keep):
                    keep, self._kv[s] = 0, []
                    t.clear_seqs(s)
                job.out.stats.cached_tokens = keep
                job.out.stats.prompt_eval_tokens = len(ids) - keep
                job.rows = [(s, p, tok) for p, tok in enumerate(ids[:-1]) if p >= keep]
                if not job.rows:
                    self._store(s, job)
        except BaseException as e:  # noqa: BLE001 - this request fails; the others go on
            self._end(s, "error", e)

    def _prefill(self, s: int) -> None:
        """The next ``n_batch`` chunk of sequence ``s``'s prompt (chunks from the first uncached token, as
        ``LlamaBackend.eval`` prefills; the last row outputs logits as there)."""
        job, t = self._active[s], self.rt.target
        chunk, last = job.rows[: t.n_batch], len(job.rows) <= t.n_batch
        try:
            with self.rt._lock:
                t.eval_seqs(chunk, outputs=[last and i == len(chunk) - 1 for i in range(len(chunk))])
                self._kv[s] = job.ids[: chunk[-1][1] + 1]  # lengthened after the cache grew
                job.rows = job.rows[t.n_batch :]
                if last:
                    self._store(s, job)
        except BaseException as e:  # noqa: BLE001 - this request fails; the others go on
            self._end(s, "error", e)

    def _store(self, s: int, job: _Job) -> None:
        """Sequence ``s`` holds the job's whole prompt but its last token: save it to the disk prompt cache (as
        ``Slot.prefill`` does; nothing is written when a stored prefix covers it). Under the runtime's lock."""
        pc, ids = self.rt.slot.prompt_cache, job.ids
        if pc is None or len(ids) - 1 < pc.min_tokens:
            return
        try:
            pc.store(ids[:-1], s)
        except (OSError, OndeviceError) as e:  # a full disk costs the next restart a miss, not this answer
            pc.warn(f"prompt cache: could not store a prefix in {pc.dir} ({getattr(e, 'strerror', None) or e})")

    def _step(self) -> None:
        """One ``llama_decode`` of every active slot's pending token, then each slot's token from its row."""
        rt = self.rt
        order = sorted(s for s, j in self._active.items() if not j.rows)  # prefilled ones
        rows = [(s, len(self._active[s].slot.context) - 1, self._active[s].slot.context[-1]) for s in order]
        t0 = time.perf_counter()
        with rt._lock:
            logits, _ = rt.target.eval_seqs(rows)
        dt = time.perf_counter() - t0
        self.steps += 1
        self.max_active = max(self.max_active, len(order))
        if self.on_step is not None:
            self.on_step(order)
        for r, s in enumerate(order):
            try:
                self._advance(s, logits[r : r + 1], dt)
            except BaseException as e:  # noqa: BLE001 - a slot's error ends that slot only
                self._end(s, "error", e)

    def _advance(self, s: int, row: np.ndarray, seconds: float) -> None:
        """The slot's plain step (``speculative._verify_chain`` with no draft) on its row, into chunks."""
        job = self._active[s]
        slot, req, stats, out = job.slot, job.req, job.out.stats, job.out
        context, constraint = slot.context, job.constraint
        if constraint is not None:
            row = constraint.mask_rows(row, [])
        _, nxt = verify_logits([], None, row, req.sampling, context, slot.rng)
        lps = None if job.n_logprobs is None else token_logprobs(row, [nxt], req.sampling, context, job.n_logprobs)
        if constraint is not None:
            constraint.advance([nxt])
        context.append(nxt)
        self._kv[s] = context[:-1]  # the decode evaluated the pending token: the cache holds this now
        step = Step(tokens=[nxt], from_draft=[False], gamma=0, drafted=0, accepted=0, draft_seconds=0.0,
                    verify_seconds=seconds, logprobs=lps)
        stats.add(step)
        if stats.target_forwards == 1:
            stats.prompt_seconds = time.perf_counter() - slot.t_start
        chunks = step_chunks(step, self.rt.target.is_eog, job.text, stats, req.max_tokens)
        if not stats.stop_reason and constraint is not None and constraint.is_done():
            stats.stop_reason = "eos"
        if not stats.stop_reason and len(context) > self.n_ctx:
            stats.stop_reason = "context"
        if stats.stop_reason:
            add_tail(chunks, job.text.flush())
        for c in chunks:
            out.add(c)
            if c.tokens and slot.t_first is None:
                slot.t_first = time.perf_counter()
            job.chunks.put(c)
        if stats.stop_reason:
            self._end(s, stats.stop_reason)

    def _end(self, s: int, reason: str, error: BaseException | None = None) -> None:
        """Free sequence ``s`` at once and close its request. The sequence keeps its cells (the next request on
        it reuses the common prefix), but after an error, when what it holds is not known: it is emptied."""
        with self._cv:
            job = self._active.pop(s)
        try:
            if error is not None:
                self._kv[s] = []
                with self.rt._lock:
                    self.rt.target.clear_seqs(s)
        finally:
            stats = job.out.stats
            stats.stop_reason = stats.stop_reason or reason
            if reason == "cancelled" and job.text is not None:
                tail = job.text.flush()
                if tail:
                    c = Chunk(tail, [], [])
                    job.out.add(c)
                    job.chunks.put(c)
            if job.slot is not None:
                job.slot.finish(time.perf_counter())
            self.rt.last_stats = stats
            job.chunks.put(error if error is not None else _END)


def _result(s: Stream) -> Result:
    for _ in s:
        pass
    return Result(s.text, s.tokens, s.stats, s.logprobs)


def _consume(job: _Job):
    """A request's chunks as the batch produces them; leaving early cancels the request (its slot frees)."""
    try:
        while True:
            item = job.chunks.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        job.out.cancel_event.set()

