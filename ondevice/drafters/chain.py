"""One drafted chain's bookkeeping, shared by the drafters that draw a chain row by row from a draft model's
logits (``eagle3``, ``mtp``): each row is masked by the request's constraint, processed with the request's own
``SamplingParams`` (``probs_sparse``) and drawn from (greedy: its top token), and its sparse q row kept, so the
shared rejection rule keeps the target's law.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from ondevice.sampling import SamplingParams, probs_sparse, sample_sparse


def q_rows(rows: Sequence[tuple[np.ndarray, np.ndarray]], vocab: int) -> np.ndarray:
    """The dense q matrix [len(rows), vocab] of sparse rows ``(ids, probs)``: probs at ids, 0 elsewhere."""
    q = np.zeros((len(rows), vocab))
    for i, (ids, pr) in enumerate(rows):
        q[i, ids] = pr
    return q


class Chain:
    """Tokens drafted so far after ``context``, their sparse q rows and confidences.

    Args:
        context: the tokens before the chain (the repetition history starts with them).
        gamma: the most tokens to draft.
        params, rng: the request's sampling parameters and generator.
        keep_drafting: the policy's stop rule, asked with the confidences so far (None: draft ``gamma``).
        constraint: the request's constraint (None: unconstrained); ``take`` advances it, ``__exit__`` restores it.
    """

    def __init__(self, context: Sequence[int], gamma: int, params: SamplingParams, rng: np.random.Generator,
                 keep_drafting: Callable[[list[float]], bool] | None = None, constraint=None) -> None:
        self.gamma, self.params, self.rng = gamma, params, rng
        self.keep_drafting, self.constraint = keep_drafting, constraint
        self.hist = [int(t) for t in context]
        self.tokens: list[int] = []
        self.rows: list[tuple[np.ndarray, np.ndarray]] = []
        self.confs: list[float] = []

    def __enter__(self) -> Chain:
        self._mark = self.constraint.checkpoint() if self.constraint is not None else 0
        return self

    def __exit__(self, *exc) -> None:
        if self.constraint is not None:
            self.constraint.restore(self._mark)

    def take(self, logits: np.ndarray) -> bool:
        """Draw the next token from the draft's ``logits`` row and record it (``tokens[-1]``); returns whether
        drafting goes on after it. False without a token when the constraint allows nothing in the row; False
        after an end of generation, the ``gamma``-th token or the policy's stop."""
        c = self.constraint
        row = logits if c is None else c.mask_row(logits)
        if not np.isfinite(row).any():
            return False  # the constraint allows nothing the draft can propose
        ids, pr = probs_sparse(row, self.params, self.hist)
        t = int(ids[0]) if self.params.greedy else sample_sparse(ids, pr, self.rng)
        self.tokens.append(t)
        self.rows.append((ids, pr))
        self.confs.append(float(pr[np.flatnonzero(ids == t)[0]]))
        self.hist.append(t)
        if c is not None:
            if t in c.eos_ids:
                return False  # nothing follows an end of generation
            c.advance([t])
        return len(self.tokens) < self.gamma and (self.keep_drafting is None or self.keep_drafting(self.confs))

    def result(self, vocab: int) -> tuple[list[int], np.ndarray | None]:
        """(tokens, q rows [len(tokens), vocab]; None when greedy)."""
        return self.tokens, None if self.params.greedy else q_rows(self.rows, vocab)
