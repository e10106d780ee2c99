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

``verify`` states the rule on dense [γ+1, V] rows. The decoding loop calls ``verify_logits``, the same
rule on the target's raw logits: it processes only the rows the rule examines, keeps rows sparse
(the candidates that survive top-k/top-p/min-p) and, when greedy, computes only argmaxes. Its
results and the uniforms it draws are bit-identical to ``verify`` on ``probs_batch`` (tested against
the dense reference).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ondevice.params import SamplingParams

__all__ = [
    "SamplingParams", "probs", "probs_batch", "probs_sparse", "sample", "sample_sparse", "verify", "verify_greedy",
    "verify_logits", "accept_probability", "residual", "residual_sparse",
]

REPETITION_WINDOW = 64  # tokens of history the repetition penalty looks at (llama.cpp's default)
_NO_IDS = np.zeros(0, dtype=np.int64)


def _seen(history: Sequence[int], n: int) -> np.ndarray:
    """Sorted distinct ids in [0, n) among the last ``REPETITION_WINDOW`` tokens of ``history``."""
    seen = np.unique(np.asarray(history[-REPETITION_WINDOW:], dtype=np.int64))
    return seen[(seen >= 0) & (seen < n)]


def _penalty_of(v: np.ndarray, penalty: float) -> np.ndarray:
    """CTRL repetition penalty on float64 logits of seen tokens: l → l / penalty if l > 0 else l · penalty."""
    return np.where(v > 0, v / penalty, v * penalty)


def _argmax(x: np.ndarray, seen: np.ndarray, penalty: float) -> int:
    """``np.argmax`` of the penalised float64 row (first index on ties, first NaN if any), without building it.

    The unseen ids keep their values, so their first maximum is found on ``x`` as it is (an exact
    float32 → float64 conversion keeps order and ties); only it and the ≤ 64 seen ids can win.
    """
    m = int(np.argmax(x))
    if not len(seen):
        return m
    if _has(seen, m):  # the raw winner is penalised: find the first maximum among the unseen ids
        y = x.copy()
        y[seen] = -np.inf
        m = int(np.argmax(y))  # if no unseen id beats -inf this is 0, whose value then is the unseen maximum
    v = _penalty_of(x[seen].astype(np.float64), penalty)
    i = int(np.argmax(v))
    a, va = int(seen[i]), float(v[i])
    if not _has(seen, m):  # the unseen winner against the seen one, as argmax would judge: NaN first, then ties by id
        vm = float(x[m])
        if (vm != vm and (va == va or m < a)) or (va == va and (vm > va or (vm == va and m < a))):
            a = m
    return a


def _has(sorted_ids: np.ndarray, i: int) -> bool:
    pos = int(np.searchsorted(sorted_ids, i))
    return pos < len(sorted_ids) and int(sorted_ids[pos]) == i


def _top_k(x: np.ndarray, k: int, seen: np.ndarray, penalty: float) -> tuple[np.ndarray, np.ndarray] | None:
    """The set ``np.argpartition(-g, k - 1)[:k]`` picks, g the penalised float64 row, and g there — or None
    when that set is not unique (ties straddle the k-th value, or fewer than k finite values) and
    only the full partition reproduces it.

    A 1-in-s subsample gives a value t0 that at least k unseen ids reach, so the top k of g lie among
    {unseen: x ≥ t0} ∪ seen (every id outside has g < t0 ≤ the k-th value): only that short list is
    converted to float64 and partitioned. Costs two passes over ``x`` instead of a float64 partition.

    Args:
        x: [n] logits (float32 or float64), n > k.
        seen: sorted ids in [0, n) the penalty applies to (empty when it is off).
    Returns:
        (ids [k], float64 processed logits [k]) in no particular order, or None.
    """
    n, m = len(x), k + len(seen)
    s = max(1, min(64, int(np.sqrt(n / m) / 2), n // (8 * m)))  # balances the two partitions' lengths (n/s, ~k·s)
    sub = x[::s].copy()
    if len(seen):
        sub[seen[seen % s == 0] // s] = np.nan  # a penalised value may fall: judge t0 on unseen ids only
    t0 = -np.partition(-sub, k - 1)[k - 1] if len(sub) >= k else np.nan
    if not t0 > -np.inf:  # NaN (too few values) or -inf (too many ties): take the full partition
        return None
    mask = x >= t0
    if len(seen):
        mask[seen] = False
    ids = np.concatenate([np.flatnonzero(mask), seen])
    g = x[ids].astype(np.float64)
    if len(seen):
        g[len(ids) - len(seen) :] = _penalty_of(g[len(ids) - len(seen) :], penalty)
    neg = -g
    tk = np.partition(neg, k - 1)[k - 1]  # −(the k-th largest of g); NaN sorts last, as in argpartition
    keep = neg <= tk
    if np.isnan(tk) or np.count_nonzero(keep) != k:
        return None
    return ids[keep], g[keep]


def _full(x: np.ndarray, k: int, seen: np.ndarray, penalty: float, vocab_limit: int | None) -> tuple[np.ndarray, np.ndarray]:
    """The reference candidate step on the whole float64 row: (top-k ids by argpartition or all ids, their g)."""
    V = x.shape[-1]
    g = np.asarray(x, dtype=np.float64)
    if vocab_limit is not None and vocab_limit < V:
        g = g.copy()
        g[vocab_limit:] = -np.inf
    if len(seen):
        g = g.copy()
        g[seen] = _penalty_of(g[seen], penalty)
    cand = np.argpartition(-g, k - 1)[:k] if k < V else np.arange(V)
    return cand, g[cand]


def probs_sparse(
    logits: np.ndarray, params: SamplingParams, history: Sequence[int], vocab_limit: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """``probs`` in sparse form: the ids with a probability and their probabilities (float64).

    Args and the processing are those of ``probs``.
    Returns:
        (ids, pr): ``probs(...)[ids] == pr`` and ``probs`` is 0 elsewhere; ids in the sampler's order
        (processed logit descending, ties by id); pr float64, 0.0 where an exp underflowed.
    """
    x = np.asarray(logits)
    if x.dtype.kind != "f":
        x = x.astype(np.float64)
    V = x.shape[-1]
    n = V if vocab_limit is None or vocab_limit >= V else vocab_limit
    pen = params.repetition_penalty
    seen = _seen(history, V) if pen != 1.0 and len(history) else _NO_IDS
    if params.greedy:
        if n < 1:
            cand, g = _full(x, V, seen, pen, vocab_limit)
            return np.array([int(cand[np.argmax(g)])]), np.ones(1)
        return np.array([_argmax(x[:n], seen[seen < n], pen)]), np.ones(1)
    # Candidates: the top-k ids (all ids when top_k is off), sorted by logit, descending; ties by id.
    k = params.top_k if 0 < params.top_k < V else V
    found = _top_k(x[:n], k, seen[seen < n], pen) if k < n else None
    cand, lc = found if found is not None else _full(x, k, seen, pen, vocab_limit)
    order = np.lexsort((cand, -lc))
    cand, lc = cand[order], lc[order]
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
    return cand, e / e.sum()


def probs(
    logits: np.ndarray, params: SamplingParams, history: Sequence[int] = (), vocab_limit: int | None = None
) -> np.ndarray:
    """Turn one row of logits into the distribution the sampler draws from.

    Order (as llama.cpp's default chain): repetition penalty → top-k → top-p → min-p → temperature.
    top-p and min-p are judged on the untempered softmax, as llama.cpp does. The penalty and the
    softmax are computed in float64 (with top-k on, for the candidates only).

    Args:
        logits: [V] raw logits.
        params: sampling parameters.
        history: token ids before this position (for the repetition penalty).
        vocab_limit: ids >= this get probability 0. Only for a draft (the ids it shares with its
            target); the target's own rows are never masked, or its law would change.
    Returns:
        [V] float64 probabilities summing to 1 (one-hot at the argmax when greedy).
    """
    ids, pr = probs_sparse(logits, params, history, vocab_limit)
    out = np.zeros(np.shape(logits)[-1], dtype=np.float64)
    out[ids] = pr
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
    out = np.zeros(logits.shape, dtype=np.float64)
    for i in range(logits.shape[0]):
        ids, pr = probs_sparse(logits[i], params, _window(history, draft, i), vocab_limit)
        out[i, ids] = pr
    return out


def _window(history: Sequence[int], draft: Sequence[int], i: int) -> list[int]:
    """The last ``REPETITION_WINDOW`` ids of ``history + draft[:i]`` (all the penalty of row i looks at)."""
    tail = list(history[-REPETITION_WINDOW:]) + [int(t) for t in draft[:i]]
    return tail[-REPETITION_WINDOW:]


def sample(p: np.ndarray, rng: np.random.Generator) -> int:
    """Draw one id from distribution ``p`` [V] by inverting its CDF with one uniform from ``rng``."""
    nz = np.flatnonzero(p)
    return sample_sparse(nz, p[nz], rng)


def sample_sparse(ids: np.ndarray, pr: np.ndarray, rng: np.random.Generator) -> int:
    """Draw one id from the distribution that is ``pr`` at ``ids`` (distinct) and 0 elsewhere, by inverting
    its CDF over the non-zero entries in id order with one uniform from ``rng``."""
    order = np.argsort(ids)
    ids, pr = ids[order], pr[order]
    nz = pr != 0
    ids, pr = ids[nz], pr[nz]
    if len(ids) == 1:
        rng.random()  # keep the number of draws independent of the distribution's shape
        return int(ids[0])
    c = np.cumsum(pr)
    i = int(np.searchsorted(c, rng.random() * c[-1], side="right"))
    return int(ids[min(i, len(ids) - 1)])


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


def residual_sparse(ids: np.ndarray, pr: np.ndarray, qv: np.ndarray, V: int) -> np.ndarray:
    """``residual(p, q)`` at p's ids, bit for bit: p is ``pr`` at ``ids`` (0 elsewhere), ``qv`` is q there.

    max(0, p − q) is 0 wherever p is 0, so only p's ids are computed; the sum alone runs over the
    dense [V] row, because summing in another order could change its last bits.
    """
    rv = np.maximum(pr - qv, 0.0)
    dense = np.zeros(V, dtype=np.float64)
    dense[ids] = rv
    s = dense.sum()
    return rv / s if s > 0.0 else pr


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


def verify_greedy(
    draft_tokens: Sequence[int], logits: np.ndarray, params: SamplingParams, history: Sequence[int], rng: np.random.Generator
) -> tuple[int, int]:
    """``verify(draft, q, probs_batch(logits, params, history, draft), rng)`` for greedy ``params``, any q.

    Greedy target rows are one-hot, p_i = e_{a_i} with a_i the argmax of row i after the repetition
    penalty; q_i is any distribution (one-hot e_{x_i} for an n-gram or greedy model draft). With
    u ∈ [0, 1) and 0 <= q_i(x_i) <= 1:
        accept x_i  ⇔  u·q_i(x_i) < p_i(x_i) = [a_i = x_i]  ⇔  a_i = x_i;
        after a rejection (a_i ≠ x_i) r_i = max(0, e_{a_i} − q_i) / Σ = (1 − q_i(a_i))·e_{a_i} / Σ = e_{a_i}
        (or p_i = e_{a_i} itself when that sum is 0), so the emitted token is a_i;
        if all γ are accepted, the bonus p_γ = e_{a_γ} emits a_γ.
    Only the rows up to the first disagreement are examined, and only their argmax is computed. The
    uniforms ``verify`` would draw (one per examined draft, one for the emitted token) are drawn too,
    so ``rng`` ends in the same state.

    Args:
        draft_tokens: [γ] drafted ids.
        logits: [γ+1, V] target logits, row i scoring the token after history + draft[:i].
        history: the ids before row 0 (for the repetition penalty).
    Returns:
        (n_accepted, next_token), as ``verify``.
    """
    gamma = len(draft_tokens)
    for i in range(gamma + 1):
        a = int(probs_sparse(logits[i], params, _window(history, draft_tokens, i))[0][0])
        if i == gamma or a != int(draft_tokens[i]):
            for _ in range(i + 2 if i < gamma else gamma + 1):
                rng.random()
            return i, a
    raise AssertionError("unreachable")


def verify_logits(
    draft_tokens: Sequence[int],
    q: np.ndarray | None,
    logits: np.ndarray,
    params: SamplingParams,
    history: Sequence[int],
    rng: np.random.Generator,
) -> tuple[int, int]:
    """``verify(draft, q, probs_batch(logits, params, history, draft), rng)``, same uniforms, same result,
    processing only the target rows the rule examines (rows after the first rejection are never read).

    Args:
        draft_tokens: [γ] drafted ids.
        q: [γ, V] draft distributions, or None for a deterministic draft (q_i one-hot at x_i).
        logits: [γ+1, V] target logits, row i scoring the token after history + draft[:i].
        history: the ids before row 0 (for the repetition penalty).
    Returns:
        (n_accepted, next_token), as ``verify``.
    """
    gamma = len(draft_tokens)
    if params.greedy and (q is None or all(0.0 <= q[i, int(x)] <= 1.0 for i, x in enumerate(draft_tokens))):
        return verify_greedy(draft_tokens, logits, params, history, rng)
    for i in range(gamma):
        x = int(draft_tokens[i])
        ids, pr = probs_sparse(logits[i], params, _window(history, draft_tokens, i))
        hit = np.flatnonzero(ids == x)
        px = pr[hit[0]] if len(hit) else 0.0
        qx = 1.0 if q is None else q[i, x]
        if rng.random() * qx < px:  # as in verify: u < p/q  ⇔  u·q < p
            continue
        qv = (ids == x).astype(np.float64) if q is None else q[i, ids]  # q_i at p's ids
        return i, sample_sparse(ids, residual_sparse(ids, pr, qv, logits.shape[-1]), rng)
    ids, pr = probs_sparse(logits[gamma], params, _window(history, draft_tokens, gamma))
    return gamma, sample_sparse(ids, pr, rng)
