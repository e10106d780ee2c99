"""Many answers at once: batched generation on one llama.cpp context (one sequence id per answer).

A decode step of S independent sequences costs far less than S single decodes on a CPU (the weights
are read once per step), so recording the target's answers for ``train-heads`` — and letting it
write its own prompts — runs several times faster than one answer after another. On a context with one
KV buffer per sequence (``LlamaBackend(..., kv_unified=False)``, as ``train-heads`` makes it), each prompt
prefilled on its own, every answer and hidden row is bit for bit the one ``data.record_answer`` records
alone (tested on the tiny model), so a resumed run records what an uninterrupted one would have.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ondevice.heads.data import GREEDY, Record, _save, load_record
from ondevice.sampling import SamplingParams, probs_sparse


@dataclass
class _Slot:
    index: int
    prompt: list[int]
    pos: int  # position of the pending token
    toks: list[int]
    hid: list[np.ndarray] = field(default_factory=list)
    rng: np.random.Generator | None = None


def generate_many(
    backend,
    prompts: Sequence[list[int]],
    *,
    max_new: int,
    on_done: Callable[[int, Record], None],
    params: SamplingParams = GREEDY,
    seed: int = 0,
    hidden: bool = True,
    slots: int | None = None,
    more: Callable[[], bool] = lambda: True,
    keys: Sequence[int] | None = None,
) -> None:
    """Generate an answer to every prompt, ``slots`` sequences at a time.

    Args:
        backend: a ``LlamaBackend`` (``enable_hidden()`` first when ``hidden``; ``kv_unified=False`` for
            answers equal to those generated alone); its cache is cleared before and after.
        prompts: rendered prompt ids; each needs len + max_new <= n_ctx_seq (the cells of one sequence).
        max_new: most tokens per answer (an end-of-generation token ends one earlier).
        on_done: called as ``on_done(i, record)`` when answer i finishes (any order).
        params, seed: greedy by default; otherwise each answer's tokens are drawn from ``probs_sparse`` with
            a generator of its own, seeded by (``seed``, its key): an answer does not depend on what else is
            decoded with it, so a run resumed with the unfinished prompts writes the same answers.
        hidden: keep every row's hidden state (``Record.hidden``; an empty [0, 0] array otherwise).
        slots: sequences decoded together (default: all the context's sequence ids).
        more: called once before admitting each prompt; False admits none now (asked again later; when
            nothing is under way the call ends).
        keys: per prompt, the key of its generator (default: its index).
    """
    S = min(slots or backend.n_seq_max, backend.n_seq_max)
    keys = list(range(len(prompts))) if keys is None else [int(k) for k in keys]
    queue = deque((i, list(p)) for i, p in enumerate(prompts))
    for i, p in queue:
        if len(p) < 1 or len(p) + max_new > backend.n_ctx_seq:
            raise ValueError(f"prompt {i} has {len(p)} tokens: with max_new={max_new} it does not fit "
                             f"n_ctx={backend.n_ctx_seq} per sequence")
    active: dict[int, _Slot] = {}
    backend.clear_seqs()
    try:
        while active or queue:
            _admit(backend, queue, active, S, max_new, more, seed, keys)
            if not active:
                break  # nothing admitted: ``more`` said no
            order = sorted(active)
            logits, H = backend.eval_seqs([(s, active[s].pos, active[s].toks[-1]) for s in order], hidden=hidden)
            for r, s in enumerate(order):
                sl = active[s]
                if hidden:
                    sl.hid.append(H[r])
                ids, pr = probs_sparse(logits[r], params, sl.toks[1:])
                t = int(ids[0]) if params.temperature == 0 else int(sl.rng.choice(ids, p=pr / pr.sum()))
                sl.toks.append(t)
                sl.pos += 1
                if len(sl.toks) - 1 >= max_new or backend.is_eog(t):
                    hid = np.asarray(sl.hid, np.float32) if hidden else np.zeros((0, 0), np.float32)
                    on_done(sl.index, Record(np.asarray(sl.toks, np.int64), hid, np.asarray(sl.prompt, np.int64)))
                    backend.clear_seqs(s)
                    del active[s]
    finally:
        backend.clear_seqs()


def _admit(backend, queue: deque, active: dict[int, _Slot], S: int, max_new: int, more: Callable[[], bool],
           seed: int, keys: list[int]) -> None:
    """Prefill waiting prompts (all but their last token, no outputs) into free sequence ids while the
    cache has room for every admitted answer's full length.

    Each prompt is prefilled on its own, in ``n_batch`` chunks from its first token, as ``LlamaBackend.eval``
    prefills one prompt: a prefill batch mixing several prompts' rows is not batch-invariant in llama.cpp
    (logits ~0.3 off on the tiny q8_0 models, so greedy answers flip), while decode steps of one row per
    sequence are; the answers then equal ``data.record_answer``'s whatever else shares the batch.
    """
    reserved = sum(len(sl.prompt) + max_new for sl in active.values())
    while queue and len(active) < S and reserved + len(queue[0][1]) + max_new <= backend.n_ctx:
        if not more():
            break
        i, p = queue.popleft()
        s = min(set(range(S)) - set(active))
        active[s] = _Slot(i, p, len(p) - 1, [p[-1]], rng=np.random.default_rng([seed, keys[i]]))
        reserved += len(p) + max_new
        rows = [(s, j, t) for j, t in enumerate(p[:-1])]
        for c in range(0, len(rows), backend.n_batch):
            chunk = rows[c : c + backend.n_batch]
            backend.eval_seqs(chunk, outputs=[False] * len(chunk))


def collect_many(backend, prompts: Sequence[tuple[str, list[int]]], work: Path, *, budget: int, max_new: int,
                 slots: int | None = None, on_record: Callable[[int, int], None] | None = None) -> list[Record]:
    """``data.collect`` batched: greedy answers with hidden states to (class, prompt ids) until ``budget``
    answer tokens are held; answer i is the file ``work/rec-iiii.npz`` (existing ones are read, not redone,
    unless they answer another prompt or were cut at another ``max_new``: e.g. the target's own prompts of
    another ``--seed``, which are recorded after the shipped ones).

    Prompts are admitted in order while the tokens held plus those expected from answers under way are
    below the budget (an answer is expected to take ``max_new``); answers under way always finish.
    Returns the records in prompt order.
    """
    recs: dict[int, Record] = {}
    todo: list[int] = []
    for i in range(len(prompts)):
        path = work / f"rec-{i:04d}.npz"
        rec = load_record(path) if path.is_file() else None
        n = 0 if rec is None else len(rec.tokens) - 1
        if rec is not None and rec.prompt.tolist() == list(prompts[i][1]) and (
                n == max_new or n < max_new and backend.is_eog(int(rec.tokens[-1]))):
            recs[i] = rec
        else:
            todo.append(i)
    held = [sum(len(r.hidden) for r in recs.values()), 0]  # tokens held, answers under way
    if on_record is not None and held[0]:
        on_record(held[0], held[0])
    if held[0] >= budget:  # enough already: the longest prefix of finished answers that reaches it
        out, n = [], 0
        for i in sorted(recs):
            if n >= budget:
                break
            out.append(recs[i])
            n += len(recs[i].hidden)
        return out

    def done(j: int, rec: Record) -> None:
        i = todo[j]
        rec.cls = prompts[i][0]
        rec = _save(work / f"rec-{i:04d}.npz", rec)
        recs[i] = rec
        held[0] += len(rec.hidden)
        held[1] -= 1
        if on_record is not None:
            on_record(held[0], len(rec.hidden))

    def more() -> bool:
        if held[0] + held[1] * max_new >= budget:
            return False
        held[1] += 1
        return True

    fits = [i for i in todo if len(prompts[i][1]) + max_new <= backend.n_ctx_seq]
    todo[:] = fits
    generate_many(backend, [prompts[i][1] for i in todo], max_new=max_new, on_done=done, slots=slots, more=more)
    return [recs[i] for i in sorted(recs)]
