"""The MTP drafter: a model's own MTP (NextN) heads — the extra blocks Qwen3.5 / 3.6, GLM-4.5+, DeepSeek-V3 or
MiMo ship inside their GGUF — run by llama.cpp's MTP graph (``ondevice.backends.llama_mtp.MtpHead``).

The target hosts the head (``Traits.needs``: "nextn"; ``LlamaBackend.enable_nextn``): every decode chunk hands
it the target's h rows, so its cache holds the pairs (x_p, h_{p−1}) of every cached position and drafting costs
no extra target pass; the target's rollback rolls it back. A chain starts from the pending token at position
n_past and runs to any depth (past the trained blocks the first block reads its own output).

q: each drafted token is drawn from the head's logits processed with the request's own ``SamplingParams``
(``probs_sparse``) after the request's constraint mask, so the shared rejection rule keeps the target's law at
any temperature / top-k / top-p / min-p and under a grammar. Greedy drafting is deterministic (q None).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from ondevice.drafters.base import Drafter, Traits
from ondevice.drafters.chain import Chain
from ondevice.sampling import SamplingParams, probs_sparse

_GREEDY = SamplingParams(temperature=0.0)


class _Stop(Exception):
    """Ends a chain from inside the head's ``choose`` (the head cleans its cache up on the way out)."""


class MtpDrafter(Drafter):
    """Chains from the target's own MTP head (see the module docstring).

    Args:
        target: a backend that runs the model's MTP heads (``Backend.mtp``; a llama.cpp target whose GGUF carries
            MTP layers of an architecture with an MTP graph); others are refused in one line.
    """

    traits = Traits(name="mtp", needs=frozenset({"nextn"}))

    def __init__(self, target) -> None:
        target.enable_features(self.traits.needs)  # a target without MTP layers refuses in one line
        self.target = target
        self.head = target.mtp()
        self.target_vocab = target.vocab_size
        self._spt: float | None = None

    def propose(self, context: Sequence[int], gamma, params, rng, keep_drafting=None, constraint=None):
        """Up to ``gamma`` tokens after ``context`` (its last token pending at position n_past), each drawn from the
        head's processed (and constrained) distribution; (tokens, q rows [γ', V] or None greedy). Nothing (a
        plain step) when the head is not in step with the target's cache."""
        V = self.target_vocab
        none = ([], None if params.greedy else np.zeros((0, V)))
        n_past = len(context) - 1
        gamma = min(gamma, self.target.n_ctx - len(context))
        if gamma <= 0 or self.head.n_past != n_past or self.target.n_past != n_past:
            return none
        chain = Chain(context, gamma, params, rng, keep_drafting, constraint)

        def choose(logits: np.ndarray, depth: int) -> int:
            if not chain.take(logits):
                raise _Stop  # the chain ends (at the γ-th token the head's loop ends there too)
            return chain.tokens[-1]

        with chain:
            try:
                self.head.draft(int(context[-1]), gamma, choose)
            except _Stop:
                pass
        return chain.result(V)

    def seconds_per_token(self, reps: int = 5, depth: int = 3) -> float:
        """Median seconds of one drafted token (a head pass, its logits and their processing), timed once on a chain
        of ``depth`` from the head's current position (its cache is left as it was); charged by the policy."""
        if self._spt is None:
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                self.head.draft(0, depth, lambda logits, d: int(probs_sparse(logits, _GREEDY, [])[0][0]))
                times.append((time.perf_counter() - t0) / depth)
            self._spt = float(np.median(times))
        return self._spt

    def close(self) -> None:
        pass  # the head belongs to the target (closed with it)
