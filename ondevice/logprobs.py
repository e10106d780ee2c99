"""Log probabilities of emitted tokens, from the target's own processed rows (the same with or without drafts).

The number reported for a token is log p(token), p being the distribution the sampler draws that
token from: ``sampling.probs_sparse`` of the target's row (after a constraint's mask, the repetition
penalty, top-k / top-p / min-p and the temperature). Greedy decoding's law is one-hot, which says
nothing, so at temperature 0 p is the softmax of the same (masked, penalised) row at temperature 1
without truncation: the law whose argmax greedy decoding takes. Speculation changes which pass
computes a row, never the row, so the numbers do not depend on the drafter (tested).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ondevice.sampling import REPETITION_WINDOW, SamplingParams, probs_sparse


@dataclass
class TokenLogprob:
    """One emitted token's log probability and the most likely alternatives at its position.

    Attributes:
        token: the id emitted.
        logprob: log p(token) (natural log; -inf if p underflowed).
        top: up to n (id, log p) pairs, most likely first.
    """

    token: int
    logprob: float
    top: list[tuple[int, float]]


def logprob_params(params: SamplingParams) -> SamplingParams:
    """The law logprobs are read from: ``params`` itself, or for greedy the untruncated softmax at temperature 1."""
    if not params.greedy:
        return params
    return dataclasses.replace(params, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)


def token_logprobs(
    logits: np.ndarray, emitted: Sequence[int], params: SamplingParams, history: Sequence[int], n_top: int
) -> list[TokenLogprob]:
    """Logprobs of ``emitted[j]`` from row j of ``logits`` (the row that scored it).

    Args:
        logits: [≥ len(emitted), V] target rows as the sampler saw them (masked when constrained);
            row j scores the token after ``history + emitted[:j]``.
        emitted: the tokens emitted by one step.
        params: the request's sampling parameters.
        history: the ids before row 0 (for the repetition penalty).
        n_top: alternatives per token (0-20).
    Returns:
        One ``TokenLogprob`` per emitted token.
    """
    lp_params = logprob_params(params)
    out = []
    for j, tok in enumerate(emitted):
        ids, pr = probs_sparse(logits[j], lp_params, [*history[-REPETITION_WINDOW:], *emitted[:j]])
        with np.errstate(divide="ignore"):
            lps = np.log(pr)
        hit = np.flatnonzero(ids == int(tok))
        lp = float(lps[hit[0]]) if len(hit) else -math.inf
        top = [(int(i), float(v)) for i, v in zip(ids[:n_top], lps[:n_top], strict=True)]
        out.append(TokenLogprob(int(tok), lp, top))
    return out
