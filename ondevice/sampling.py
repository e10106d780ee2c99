"""The one sampler: logits → processed probabilities, and the speculative acceptance rule.

Pure numpy; no backend is imported here. Target and draft rows go through the same ``probs`` so the
rejection rule compares like with like.

Speculative sampling (Leviathan et al. 2023; Chen et al. 2023). The draft proposes x_1..x_γ, each
x_i ~ q_i. The target gives p_1..p_{γ+1} for the same prefixes. For i = 1..γ:

    accept x_i with probability  a_i = min(1, p_i(x_i) / q_i(x_i));
    on the first rejection, emit y ~ r_i = max(0, p_i − q_i) / Σ max(0, p_i − q_i) and stop;
    if all γ are accepted, emit a bonus y ~ p_{γ+1}.

Why the output is exactly p_i: for any token y,
    P(emit y) = q(y)·min(1, p(y)/q(y)) + (1 − Σ_x q(x)·min(1, p(x)/q(x))) · r(y)
              = min(q(y), p(y)) + (1 − Σ_x min(q(x), p(x))) · max(0, p(y) − q(y)) / Σ_x max(0, p(x) − q(x)).
Since Σ_x min(p, q) = 1 − Σ_x max(0, p − q), the second term is exactly max(0, p(y) − q(y)), and
min(q, p) + max(0, p − q) = p(y).

Greedy (temperature 0) is the same rule with one-hot p and q: accept iff argmaxes agree, and the
residual of a rejected draft is the target's argmax.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ondevice.params import SamplingParams

__all__ = ["SamplingParams", "probs", "probs_batch", "sample", "verify", "accept_probability", "residual"]

REPETITION_WINDOW = 64  # tokens of history the repetition penalty looks at (llama.cpp's default)


def _penalize(logits: np.ndarray, history: Sequence[int], penalty: float) -> np.ndarray:
    """CTRL repetition penalty: a seen token's logit l becomes l / penalty if l > 0 else l · penalty."""
    if penalty == 1.0 or not len(history):
        return logits
    seen = np.unique(np.asarray(history[-REPETITION_WINDOW:], dtype=np.int64))
    seen = seen[(seen >= 0) & (seen < logits.shape[-1])]
    out = logits.copy()
    v = out[seen]
    out[seen] = np.where(v > 0, v / penalty, v * penalty)
    return out


def probs(
    logits: np.ndarray, params: SamplingParams, history: Sequence[int] = (), vocab_limit: int | None = None
) -> np.ndarray:
    """Turn one row of logits into the distribution the sampler draws from.

    Order (as llama.cpp's default chain): repetition penalty → top-k → top-p → min-p → temperature.
    top-p and min-p are judged on the untempered softmax, as llama.cpp does.

    Args:
        logits: [V] raw logits.
        params: sampling parameters.
        history: token ids before this position (for the repetition penalty).
        vocab_limit: ids >= this get probability 0. Only for a draft (the ids it shares with its
            target); the target's own rows are never masked, or its law would change.
    Returns:
        [V] float64 probabilities summing to 1 (one-hot at the argmax when greedy).
    """
    x = np.asarray(logits, dtype=np.float64)
    V = x.shape[-1]
    if vocab_limit is not None and vocab_limit < V:
        x = x.copy()
        x[vocab_limit:] = -np.inf
    x = _penalize(x, history, params.repetition_penalty)
    out = np.zeros(V, dtype=np.float64)
    if params.greedy:
        out[int(np.argmax(x))] = 1.0
        return out
    # Candidates: the top-k ids (all ids when top_k is off), sorted by logit, descending; ties by id.
    k = params.top_k if 0 < params.top_k < V else V
    cand = np.argpartition(-x, k - 1)[:k] if k < V else np.arange(V)
    cand = cand[np.lexsort((cand, -x[cand]))]
    lc = x[cand]
    finite = np.isfinite(lc)
    cand, lc = cand[finite], lc[finite]
    if params.top_p < 1.0 or params.min_p > 0.0:
        e = np.exp(lc - lc[0])
        pr = e / e.sum()
        keep = len(pr)
        if params.top_p < 1.0:
            # smallest prefix whose mass reaches top_p (at least one token)
            keep = min(keep, int(np.searchsorted(np.cumsum(pr), params.top_p, side="left")) + 1)
        if params.min_p > 0.0:
            keep = min(keep, max(1, int(np.sum(pr >= params.min_p * pr[0]))))
        cand, lc = cand[:keep], lc[:keep]
    z = (lc - lc[0]) / params.temperature
    e = np.exp(z)
    out[cand] = e / e.sum()
    return out


def probs_batch(
    logits: np.ndarray,
    params: SamplingParams,
    history: Sequence[int],
    draft: Sequence[int],
    vocab_limit: int | None = None,
) -> np.ndarray:
    """Process the target's verify rows: row i sees ``history + draft[:i]``.

    Args:
        logits: [n, V] target logits, row i scoring the token after history + draft[:i].
        draft: the drafted tokens (len >= n − 1).
    Returns:
        [n, V] probabilities.
    """
    hist = list(history)
    rows = []
    for i in range(logits.shape[0]):
        rows.append(probs(logits[i], params, hist, vocab_limit))
        if i < len(draft):
            hist.append(int(draft[i]))
    return np.stack(rows)


def sample(p: np.ndarray, rng: np.random.Generator) -> int:
    """Draw one id from distribution ``p`` [V] by inverting its CDF with one uniform from ``rng``."""
    nz = np.flatnonzero(p)
    if len(nz) == 1:
        rng.random()  # keep the number of draws independent of the distribution's shape
        return int(nz[0])
    c = np.cumsum(p[nz])
    i = int(np.searchsorted(c, rng.random() * c[-1], side="right"))
    return int(nz[min(i, len(nz) - 1)])


def accept_probability(p: np.ndarray, q: np.ndarray, x: int) -> float:
    """a = min(1, p(x) / q(x)); a drafted token always has q(x) > 0."""
    if q[x] <= 0.0:
        return 0.0
    return min(1.0, p[x] / q[x])


def residual(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """r = max(0, p − q) / Σ max(0, p − q); falls back to p when p == q (then rejection has probability 0)."""
    r = np.maximum(p - q, 0.0)
    s = r.sum()
    return r / s if s > 0.0 else p


def verify(
    draft_tokens: Sequence[int], q: np.ndarray, p: np.ndarray, rng: np.random.Generator
) -> tuple[int, int]:
    """The speculative acceptance rule.

    Args:
        draft_tokens: [γ] drafted ids; x_i was drawn from q[i].
        q: [γ, V] draft distributions.
        p: [γ+1, V] target distributions for the same prefixes (row γ is the bonus row).
        rng: source of every uniform drawn (one per examined draft token, one for the emitted token).
    Returns:
        (n_accepted, next_token): the first n_accepted drafts are kept, then next_token is emitted.
    """
    gamma = len(draft_tokens)
    for i in range(gamma):
        x = int(draft_tokens[i])
        # u < p/q  ⇔  u·q < p   (no division; q(x) > 0 for a drafted token)
        if rng.random() * q[i, x] < p[i, x]:
            continue
        return i, sample(residual(p[i], q[i]), rng)
    return gamma, sample(p[gamma], rng)
