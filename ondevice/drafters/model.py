"""The model drafter: a smaller model of the same vocabulary drafts by sampling from its processed distribution."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ondevice.backends.base import Backend
from ondevice.drafters.base import Drafter, Traits, common_prefix
from ondevice.sampling import probs_sparse, sample_sparse


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

    traits = Traits(name="model", model=True)
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
        return min(common_prefix(self._cached, context), len(context) - 1, self.backend.n_past)

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
