"""Drafters: something that guesses the next γ tokens, with the distributions it drew them from.

A drafter returns ``(tokens[γ'], q[γ', V] | None)`` with γ' <= γ; ``q is None`` means the drafter is
deterministic (q is one-hot at each token), which the loop expands lazily.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from ondevice.backends.base import Backend
from ondevice.sampling import SamplingParams, probs_sparse, sample_sparse


class Drafter:
    """The drafter contract; every member the loop, the runtime and the policy use, with defaults.

    Attributes:
        name: "model", "ngram", ... (in ``Stats.drafter`` and the cost model).
        cheap: proposing costs nothing, so the loop asks for the longest guess every step and the policy
            keeps a prefix of it (judged by ``hint``); an expensive drafter is asked for exactly γ tokens.
        backend: the draft model's backend, when there is one (its cost is measured; its context bounds the
            runtime's).
        trees: ``propose_tree`` grows a candidate tree whose prefixes the policy sizes; on a backend that
            verifies trees in one pass the runtime then speculates with trees (``ondevice.tree.tree_steps``).
        reads_last_row: drafts from the target's hidden row of the last cached position (heads): a prompt
            the prefix cache holds whole is then prefilled from its last cached token again, so the first
            step drafts whatever the cache held before (a seeded request gives the same output).
    """

    name: str = "drafter"
    cheap: bool = False
    backend: Backend | None = None
    trees: bool = False
    reads_last_row: bool = False

    @property
    def hint(self) -> int | tuple:
        """What the policy judges the last guess by (0: nothing)."""
        return 0

    def lag(self, context: Sequence[int]) -> int:
        """Tokens of ``context`` the drafter must evaluate before it can draft (charged to a drafting step)."""
        return 0

    def propose(
        self, context: Sequence[int], gamma: int, params: SamplingParams, rng: np.random.Generator,
        keep_drafting: Callable[[list[float]], bool] | None = None, constraint=None,
    ) -> tuple[list[int], np.ndarray | None]:
        """Guess up to ``gamma`` tokens that follow ``context`` (the whole sequence so far).

        Args:
            keep_drafting: asked after each drafted token with the draft's probabilities so far; False stops.
            constraint: the request's ``ondevice.constrain.Constraint`` (None: unconstrained); an expensive
                drafter draws from (and reports) the masked q; a cheap drafter's guess is cut by the loop.
        Returns:
            (tokens[γ'], q[γ', target V] or None for a deterministic drafter), γ' ≤ γ.
        """
        raise NotImplementedError

    def propose_tree(self, context: Sequence[int], max_nodes: int, params: SamplingParams, rng: np.random.Generator):
        """(``trees`` drafters) An ``ondevice.tree.Tree`` rooted at ``context[-1]`` with up to ``max_nodes``
        drafted nodes whose every prefix is a tree, and ``scores`` (the drafter's chance each node's path
        is accepted), or None for a plain step."""
        raise NotImplementedError

    def copy_tree(self, context: Sequence[int], max_nodes: int):
        """A free copy (no drafting cost: heads' prompt lookup) as a chain ``ondevice.tree.Tree`` with
        ``scores``, which the runtime may offer on steps it does not ask this drafter to draft (sized by
        ``Policy.copy_nodes``); None: nothing to offer (the default)."""
        return None

    def seconds_per_token(self) -> float | None:
        """Measured seconds per drafted token of a drafter without a backend (None: free, or measured on
        ``backend``); charged by the adaptive policy."""
        return None

    def reset(self) -> None:
        """Forget any cached state."""

    def close(self) -> None:
        """Free what the drafter holds (a draft model)."""


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class ModelDrafter(Drafter):
    """Drafts by sampling from a smaller model's processed distribution (any ``Backend``).

    The draft cache is kept in step with the context by rolling back to the longest common prefix
    of what it holds and the new context, then evaluating the rest. ``_cached`` is always a prefix of
    what the cache really holds (shortened before a rollback, lengthened after an eval), so an
    interruption anywhere leaves a state the next ``propose`` continues from.

    The draft proposes only ids of the shared vocabulary (its q is 0 beyond). Context ids outside it
    (the target may emit them) are fed to the draft as ``UNKNOWN_ID``: this only changes what the draft
    guesses, never the output law, which the target's verification keeps exact.

    Args:
        backend: the draft model.
        vocab_limit: the shared vocabulary size of the pair.
        target_vocab: width of the target's rows; q rows are padded or cut to it.
    """

    name = "model"
    cheap = False
    UNKNOWN_ID = 0  # stand-in for context ids the draft has no row for

    def __init__(self, backend: Backend, vocab_limit: int, target_vocab: int) -> None:
        self.backend = backend
        self.vocab_limit = vocab_limit
        self.target_vocab = target_vocab
        self._cached: list[int] = []  # the ids whose K/V the draft cache holds

    def lag(self, context: Sequence[int]) -> int:
        """Tokens of ``context`` the draft cache would have to evaluate before drafting."""
        return len(context) - self._keep(context)

    def _feed(self, ids: Sequence[int]) -> list[int]:
        """Ids as the draft model can evaluate them (see ``UNKNOWN_ID``)."""
        lim = self.vocab_limit
        return [int(t) if 0 <= t < lim else self.UNKNOWN_ID for t in ids]

    def _keep(self, context: Sequence[int]) -> int:
        """Cached positions still valid for ``context`` (at least its last token is re-evaluated)."""
        return min(_common_prefix(self._cached, context), len(context) - 1, self.backend.n_past)

    def _sync(self, context: Sequence[int]) -> np.ndarray:
        """Make the cache hold ``context``; return logits [V] after its last token."""
        keep = self._keep(context)
        self._cached = list(context[:keep])
        self.backend.rollback(keep)
        logits = self.backend.eval(self._feed(context[keep:]), logits="last")[-1]
        self._cached = list(context)
        return logits

    def propose(self, context, gamma, params, rng, keep_drafting=None, constraint=None):
        """Sample up to ``gamma`` tokens; ``keep_drafting(confidences)`` may stop early (confidence =
        the draft's probability of each token it drew). Greedy drafting is deterministic: q is None
        (one-hot at each token). With a ``constraint`` (``ondevice.constrain``) every row is masked
        before it is processed, so q is the constrained law and every draft is allowed; the matcher
        is walked along the draft and left where it started."""
        if gamma <= 0:
            return [], np.zeros((0, self.target_vocab))
        if len(context) + gamma > self.backend.n_ctx:
            gamma = self.backend.n_ctx - len(context)
            if gamma <= 0:
                return [], np.zeros((0, self.target_vocab))
        hist = list(context)
        logits = self._sync(context)
        tokens, rows, confs = [], [], []
        mark = constraint.checkpoint() if constraint is not None else 0
        try:
            for i in range(gamma):
                if constraint is not None:
                    logits = constraint.mask_row(logits)
                ids, pr = probs_sparse(logits, params, hist, self.vocab_limit)  # q: pr at ids, 0 elsewhere
                t = sample_sparse(ids, pr, rng)
                tokens.append(t)
                rows.append((ids, pr))
                confs.append(float(pr[np.flatnonzero(ids == t)[0]]))
                hist.append(t)
                if constraint is not None:
                    if t in constraint.eos_ids:
                        break  # nothing follows an end of generation
                    constraint.advance([t])
                if i + 1 < gamma and keep_drafting is not None and not keep_drafting(confs):
                    break
                if i + 1 < gamma:
                    logits = self.backend.eval([t], logits="last")[-1]
                    self._cached.append(t)
        finally:
            if constraint is not None:
                constraint.restore(mark)
        if params.greedy:
            return tokens, None
        q = np.zeros((len(rows), self.target_vocab))  # [γ', target V]: ids past the target's width are cut
        for i, (ids, pr) in enumerate(rows):
            inside = ids < self.target_vocab
            q[i, ids[inside]] = pr[inside]
        return tokens, q

    def reset(self) -> None:
        """Forget the draft cache (after someone else emptied or changed it)."""
        self._cached = []
        self.backend.rollback(0)

    def close(self) -> None:
        self.backend.close()


class NgramDrafter(Drafter):
    """Prompt lookup: find the latest earlier occurrence of the context's suffix and copy what followed.

    Tries suffix lengths from ``max_ngram`` down to ``min_ngram``; the longest match wins, the most
    recent occurrence among equals. Deterministic, so q is one-hot (returned as None).
    ``last_match_len`` reports how far back the chosen occurrence really agrees with the context (up
    to ``max_report``): a long agreement means a verbatim copy is under way, which the policy uses.
    The n-grams are indexed incrementally as the context grows, so a step costs O(new tokens), not a
    scan of the whole context (which cost 2 % of a 135M model's decode time).
    A copy survives a one-token divergence (a renamed identifier, a changed number): unless a longer
    n-gram match elsewhere wins, the copy the last guess came from continues, aligned past the token
    that differed, as long as at most one of the tokens since that guess differs from the source and the
    copy had agreed for ``RESUME_AFTER`` tokens since its last divergence. ``hint`` is what the policy
    judges a guess by: (match length, whether it copies the request's prompt).
    """

    name = "ngram"
    RESUME_AFTER = 4  # tokens a copy must agree for before it may survive another differing token
    cheap = True  # proposing costs nothing: the policy trims the longest guess

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1, max_report: int = 64) -> None:
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.max_report = max_report
        self.last_match_len = 0
        self.last_from_prompt = False  # the guess copies the request's prompt (not the answer so far)
        self._prompt_len = 0
        self._of: list | None = None  # the context list the index describes (drafts never affect exactness,
        self._done = 0  # so a stale index could only cost speed; it is rebuilt when the list changes)
        self._last = None
        self._index: dict[tuple, int] = {}  # n-gram → where its latest occurrence ends
        self._copy: tuple[int, int, int, int] | None = None  # (context length, source position, agreement, since a differing token) of the last guess

    def _sync(self, context) -> None:
        """Index every n-gram that ends before the context's last position."""
        done = self._done
        if context is not self._of or len(context) < done or (done and context[done - 1] != self._last):
            self._of, self._index, done, self._copy = context, {}, 1, None
            self._prompt_len = len(context)
        n = len(context)
        for end in range(done, n):  # n-grams ending at end ≤ n − 1 (the suffix itself excluded)
            for size in range(self.min_ngram, min(self.max_ngram, end) + 1):
                self._index[tuple(context[end - size : end])] = end
        self._done = max(done, n)
        self._last = context[self._done - 1]

    @property
    def hint(self) -> tuple[int, bool]:
        """What the policy judges the last guess by: (match length, copying from the prompt)."""
        return self.last_match_len, self.last_from_prompt

    def propose(self, context, gamma, params, rng, keep_drafting=None, constraint=None):
        self.last_match_len, self.last_from_prompt = 0, False
        n = len(context)
        if gamma <= 0 or n < 2:
            return [], None
        self._sync(context)
        resumed = self._resume(context)
        end = None
        for size in range(min(self.max_ngram, n - 1), self.min_ngram - 1, -1):
            end = self._index.get(tuple(context[n - size :]))
            if end is not None:
                break
        if resumed is not None and (end is None or size < 2 or resumed[0] == end):
            end, self.last_match_len, fresh = resumed  # the copy goes on (past a differing token, if one was emitted)
        elif end is not None:
            self.last_match_len = fresh = size + self._agree_before(context, end - size, n - size, self.max_report - size)
        else:
            self._copy = None
            return [], None
        self._copy = (n, end, self.last_match_len, fresh)
        self.last_from_prompt = end < self._prompt_len
        return list(context[end : end + gamma]), None

    def _resume(self, context) -> tuple[int, int, int] | None:
        """(source position, agreement, agreement since the last differing token) of the last guess's copy,
        continued past at most one differing token; a copy that differs again before it has agreed for
        ``RESUME_AFTER`` tokens has ended (it was not a rename)."""
        if self._copy is None:
            return None
        n0, src0, agree0, fresh0 = self._copy
        n = len(context)
        end = src0 + (n - n0)
        if not 0 < n - n0 <= 64 or end >= n - 1:  # too far from the last guess, or nothing left to copy
            return None
        diffs = [i for i in range(n - n0) if context[src0 + i] != context[n0 + i]]
        if not diffs:
            return end, min(agree0 + n - n0, self.max_report), fresh0 + n - n0
        if len(diffs) > 1 or fresh0 + diffs[0] < self.RESUME_AFTER:  # the copy has ended
            return None
        return end, min(agree0 + n - n0 - 1, self.max_report), n - n0 - diffs[0] - 1

    @staticmethod
    def _agree_before(ctx, a: int, b: int, limit: int) -> int:
        """How many tokens before positions a < b agree (ctx[a-1] == ctx[b-1], ...), at most ``limit``."""
        k = 0
        while k < limit and k < a and ctx[a - 1 - k] == ctx[b - 1 - k]:
            k += 1
        return k
