"""Prompt lookup: drafts copied from earlier in the context, as a chain (``NgramDrafter``) or a tree (``TreeNgram``)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ondevice.drafters.base import Drafter, Guess, Traits
from ondevice.sampling import SamplingParams
from ondevice.tree import Tree


class NgramDrafter(Drafter):
    """Prompt lookup: find the latest earlier occurrence of the context's suffix and copy what followed.

    Tries suffix lengths from ``max_ngram`` down to ``min_ngram``; the longest match wins, the most
    recent occurrence among equals. Deterministic, so q is one-hot (returned as None).
    ``last_match_len`` reports how far back the chosen occurrence really agrees with the context (up
    to ``max_report``): a long agreement means a verbatim copy is under way, which the policy uses.
    The n-grams are indexed incrementally as the context grows, so a step costs O(new tokens), not a
    scan of the whole context.
    A copy survives a one-token divergence (a renamed identifier, a changed number): unless a longer
    n-gram match elsewhere wins, the copy the last guess came from continues, aligned past the token
    that differed, as long as at most one of the tokens since that guess differs from the source and the
    copy had agreed for ``RESUME_AFTER`` tokens since its last divergence. ``guess`` is what the policy
    judges a guess by: (match length, whether it copies the request's prompt).
    """

    traits = Traits(name="ngram", cheap=True)  # proposing costs nothing: the policy trims the longest guess
    RESUME_AFTER = 4  # tokens a copy must agree for before it may survive another differing token

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
    def guess(self) -> Guess:
        """What the policy judges the last guess by: (match length, copying from the prompt)."""
        return Guess(self.last_match_len, self.last_from_prompt)


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


def ngram_paths(context: Sequence[int], max_depth: int, max_ngram: int = 4, min_ngram: int = 1,
                max_paths: int = 8) -> list[list[int]]:
    """Continuations of every earlier occurrence of the context's suffix (prompt lookup, all matches).

    Longer suffix matches come first, the most recent first among equals; each occurrence is used once.
    Returns:
        up to ``max_paths`` lists of up to ``max_depth`` tokens that followed a match.
    """
    a = np.asarray(context, dtype=np.int64)
    n = len(a)
    ends: set[int] = set()
    out: list[list[int]] = []
    for size in range(min(max_ngram, n - 1), min_ngram - 1, -1):
        # windows a[s : s+size] for s + size <= n − 1 (the suffix itself excluded); a match ends at e = s + size
        win = np.lib.stride_tricks.sliding_window_view(a[: n - 1], size)
        for e in (np.flatnonzero((win == a[n - size :]).all(axis=1)) + size)[::-1]:
            if int(e) not in ends:
                ends.add(int(e))
                out.append([int(t) for t in a[e : e + max_depth]])
                if len(out) >= max_paths:
                    return out
    return out


class TreeNgram(Drafter):
    """Prompt lookup as a tree: the continuations of several matches merged into one trie (point masses).

    Args:
        max_nodes: drafted nodes at most (the root not counted).
        max_depth: tokens per continuation at most.
        max_ngram, min_ngram: suffix lengths tried.
        max_paths: matches used at most.
    """

    traits = Traits(name="ngram-tree", trees=True)

    def __init__(self, max_nodes: int = 8, max_depth: int = 4, max_ngram: int = 4, min_ngram: int = 1,
                 max_paths: int = 8) -> None:
        self.max_nodes, self.max_depth = max_nodes, max_depth
        self.max_ngram, self.min_ngram, self.max_paths = max_ngram, min_ngram, max_paths

    def propose_tree(self, context: Sequence[int], max_nodes: int, params: SamplingParams,
                     rng: np.random.Generator) -> Tree | None:
        """A tree rooted at ``context[-1]`` with at most ``min(max_nodes, self.max_nodes)`` drafted nodes."""
        paths = ngram_paths(context, self.max_depth, self.max_ngram, self.min_ngram, self.max_paths)
        tree = Tree.from_paths(context[-1], paths, min(max_nodes, self.max_nodes))
        return tree if len(tree) > 1 else None

    def reset(self) -> None:
        pass

    def close(self) -> None:
        pass
