"""HeadsDrafter: drafts a chain or a tree from the hidden state the target's last pass already produced.

Contract (``ondevice.drafters.base.Drafter``): ``propose(context, gamma, params, rng)`` → (tokens, q) with q
[γ', target V] the distributions the tokens were drawn from. Here q_i is the heads' draft-vocabulary
logits processed by ``ondevice.sampling.probs_sparse`` with the request's own ``SamplingParams``
(temperature, top-k, top-p, min-p, repetition penalty judged on the history mapped into the draft
vocabulary) and scattered into the target's vocabulary, zero elsewhere. The shared rejection sampler
then keeps the target's law whatever the heads guess; greedy drafting is deterministic (q is None).

The heads' input is the target's post-norm hidden state at the last cached position (the row whose
logits chose the pending token): after a verify pass and its rollback that is the row of the last
accepted token, which ``LlamaBackend.hidden`` still holds. A prompt the prefix cache holds whole has
its last cached token evaluated again by the runtime (``Traits.needs``), so the row is there; when it
is not (a caller driving the loop itself), the drafter proposes nothing and the step is a plain one.

**One BLAS thread**: the heads' matrix products run with numpy's BLAS held to one thread (``one_blas_thread``).
OpenBLAS's idle workers spin for a while after each call and took the cores from the target's next decode: a
4-token verify of Qwen2.5-Coder-1.5B cost 156–174 ms after the heads' step against 104 ms alone (2 cores).

**Copies first** (``ondevice.drafters.copies``): where the context repeats a stretch of at least ``copy_min``
tokens, a chain is that prompt-lookup copy instead, and a tree gets it as one more branch.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Callable, Sequence

import numpy as np

from ondevice.constrain import apply_mask
from ondevice.drafters.base import Drafter, Traits
from ondevice.drafters.chain import q_rows
from ondevice.drafters.copies import COPY_MIN, Copies
from ondevice.errors import OndeviceError
from ondevice.heads import store
from ondevice.heads.grow import best_first
from ondevice.heads.model import Heads
from ondevice.sampling import REPETITION_WINDOW, SamplingParams, probs_sparse, sample_sparse
from ondevice.tree import Tree

_BLAS = None  # threadpoolctl's controller of the BLAS libraries numpy loaded (built once: it scans them)


def one_blas_thread():
    """A context holding numpy's BLAS to one thread (``threadpoolctl``; ~6 µs a use): a drafter's small matrix
    products gain nothing from more, and the workers' spin-wait would take the target's cores (module docstring)."""
    global _BLAS
    if _BLAS is None:
        from threadpoolctl import ThreadpoolController

        _BLAS = ThreadpoolController()
    return _BLAS.limit(limits=1, user_api="blas")


def seconds_per_token(hs: Heads, reps: int = 15) -> float:
    """Median seconds of one drafted token (a head step, the draft-vocabulary logits and their processing),
    timed on a random hidden state: no target needed (``draft="auto"`` judges heads without switching the
    target's hidden states on)."""
    import time

    h = np.random.default_rng(0).standard_normal((1, hs.d)).astype(np.float32) / hs.s_h
    times = []
    with one_blas_thread():  # as the heads draft
        for _ in range(reps):
            t0 = time.perf_counter()
            hk = hs.step(0, h, hs.embed(np.array([0])))[0]
            probs_sparse(hs.draft_logits(hk)[0], SamplingParams(temperature=0.0), [])
            times.append(time.perf_counter() - t0)
    return float(np.median(times))


class HeadsDrafter(Drafter):
    """Heads on a target backend that can return hidden states (``enable_hidden``).

    Args:
        target: the target backend (``LlamaBackend``); hidden states are switched on here.
        heads: the trained heads.
        meta: the heads file's metadata (reported by benchmarks).
        copy_min: a prompt-lookup copy whose match agrees for at least this many tokens drafts the chain
            instead of the heads (0: heads only).
    """

    # the policy asks for exactly γ tokens (at most K from the heads, up to γ from a copy); the runtime keeps the
    # target's last row (re-evaluating a wholly cached prompt's last cached token)
    traits = Traits(name="heads", trees=True, needs=frozenset({"hidden"}))

    COPY_MIN = COPY_MIN

    def __init__(self, target, heads: Heads, meta: dict | None = None, copy_min: int = COPY_MIN) -> None:
        d = target.enable_features(self.traits.needs)["hidden"]  # a backend without them refuses in one line
        if d != heads.d:
            raise OndeviceError(f"{target.path}: heads have hidden size {heads.d} but the model has {d}; "
                                f"run `ondevice train-heads {shlex.quote(str(target.path.resolve()))}` for this model")
        self.target = target
        self.heads = heads
        self.meta = meta or {}
        self.target_vocab = target.vocab_size
        self.inv = heads.index(target.vocab_size)
        self.max_gamma = heads.K
        self.branch = 4  # children considered per tree node
        self.copies = Copies(copy_min)  # prompt-lookup copies first (``ondevice.drafters.copies``)
        self._spt: float | None = None

    @classmethod
    def for_target(cls, target, path: str | os.PathLike | None = None) -> HeadsDrafter:
        """The heads stored for ``target`` (or the file at ``path``), checked against the target's sha256."""
        p = path or store.find(target.path)
        if p is None:
            raise OndeviceError(f"{target.path.name}: no heads trained for this model (looked for {store.default_path(target.path)}); "
                                f"run `ondevice train-heads {shlex.quote(str(target.path.resolve()))}` first")
        heads, meta = store.load(p, target.path, target.vocab_size)
        return cls(target, heads, meta)

    def _rows(self, ids: Sequence[int]) -> np.ndarray:
        """Target ids → input rows (−1 outside the input vocabulary; rows below Vd are the draft rows, and
        the repetition penalty ignores the others)."""
        a = np.asarray(ids, np.int64)
        out = np.full(len(a), -1, np.int64)
        ok = (a >= 0) & (a < len(self.inv))
        out[ok] = self.inv[a[ok]]
        return out

    def proposal(self, ask):
        """``Drafter.proposal`` with numpy's BLAS on one thread (``one_blas_thread``)."""
        with one_blas_thread():
            return super().proposal(ask)

    def propose(
        self, context: Sequence[int], gamma: int, params: SamplingParams, rng: np.random.Generator,
        keep_drafting: Callable[[list[float]], bool] | None = None, constraint=None,
    ) -> tuple[list[int], np.ndarray | None]:
        """Draft up to min(γ, K) tokens after ``context`` (its last token is pending, the rest cached), or a
        copy of up to γ (``Copies.chain``).

        ``keep_drafting(confidences)`` may stop early (confidence = q of each drafted token). With a
        ``constraint`` (``ondevice.constrain``) each row's draft logits are masked to the draft rows it allows
        before they are processed, so q is the constrained law and every draft is allowed; the matcher is
        walked along the drafts and left where it started (drafting stops at an end of generation, or where
        no draft row is allowed).
        """
        V = self.target_vocab
        none = ([], None if params.greedy else np.zeros((0, V)))
        guess = self.copies.chain(context, gamma, constraint)
        if guess:
            return guess, None
        h = self.target.feature("hidden", len(context) - 2) if gamma > 0 and len(context) >= 2 else None
        if h is None:
            return none
        hs = self.heads
        hist = [int(r) for r in self._rows(context[-REPETITION_WINDOW:])]
        x = int(self._rows(context[-1:])[0])
        h = h[None, :]
        tokens, rows, confs = [], [], []
        mark = constraint.checkpoint() if constraint is not None else 0
        try:
            for k in range(min(gamma, hs.K)):
                h = hs.step(k, h, hs.embed(np.array([x])))[0]
                lg = hs.draft_logits(h)[0]
                if constraint is not None:
                    lg = apply_mask(lg, constraint.allowed()[hs.vocab])
                    if not np.isfinite(lg).any():
                        break  # the constraint allows nothing in the draft vocabulary here
                ids, pr = probs_sparse(lg, params, hist)  # draft rows, the request's processing
                r = int(ids[0]) if params.greedy else sample_sparse(ids, pr, rng)
                t = int(hs.vocab[r])
                tokens.append(t)
                rows.append((hs.vocab[ids], pr))
                confs.append(float(pr[np.flatnonzero(ids == r)[0]]))
                hist.append(r)
                x = r
                if constraint is not None:
                    if t in constraint.eos_ids:
                        break  # nothing follows an end of generation
                    constraint.advance([t])
                if keep_drafting is not None and k + 1 < min(gamma, hs.K) and not keep_drafting(confs):
                    break
        finally:
            if constraint is not None:
                constraint.restore(mark)
        return tokens, None if params.greedy else q_rows(rows, V)

    def propose_tree(self, context: Sequence[int], max_nodes: int, params: SamplingParams, rng: np.random.Generator):
        """A best-first tree of up to ``max_nodes`` drafted nodes after ``context`` (``best_first``), as an
        ``ondevice.tree.Tree`` of point masses (deterministic, distinct siblings: exact at any temperature)
        with ``scores``; None when there is no hidden row to draft from. A copy (up to ``max_nodes`` long) joins
        the heads' nodes as one more branch (``Copies.graft``)."""
        h = self.target.feature("hidden", len(context) - 2) if max_nodes > 0 and len(context) >= 2 else None
        if h is None:
            return self.copy_tree(context, max_nodes)
        x = int(self._rows(context[-1:])[0])
        rows, parents, scores = best_first(self.heads, h, x, max_nodes, self.branch)
        return self.copies.graft(context, [int(self.heads.vocab[r]) for r in rows], parents, scores, max_nodes)

    def copy_tree(self, context: Sequence[int], max_nodes: int):
        """The copy alone (``Copies.tree``), or None: no head step, so the runtime may offer it on steps the policy
        does not ask the heads to draft (``ondevice.speculative.steps``)."""
        return self.copies.tree(context, max_nodes)

    def seconds_per_token(self, reps: int = 15) -> float:
        """``seconds_per_token(self.heads)``, measured once and cached."""
        if self._spt is None:
            self._spt = seconds_per_token(self.heads, reps)
        return self._spt

    def reset(self) -> None:
        self.copies.reset()  # the target's hidden rows go with its cache

    def close(self) -> None:
        pass  # the target belongs to the runtime


def tree_from_topk(root: int, topk: Sequence[Sequence[int]], choices: Sequence[Sequence[int]]) -> Tree:
    """The heads' hook: a Medusa-style tree from each head's ranked guesses (point masses).

    Args:
        root: the pending token.
        topk: topk[d] = head d's guesses for depth d + 1, best first.
        choices: node paths as ranks, e.g. (0,), (1,), (0, 0), (0, 1): (r_1, .., r_d) is topk[0][r_1] then
            topk[1][r_2] ...; a node's parent path must come earlier, sibling order = priority.
    """
    index = {(): 0}
    tokens, parents = [int(root)], [-1]
    for ch in choices:
        ch = tuple(ch)
        if ch[:-1] not in index:
            raise ValueError(f"tree choice {ch}: its parent {ch[:-1]} must be listed before it")
        index[ch] = len(tokens)
        tokens.append(int(topk[len(ch) - 1][ch[-1]]))
        parents.append(index[ch[:-1]])
    return Tree(tokens, parents)
