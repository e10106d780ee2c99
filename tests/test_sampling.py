"""The sampler's maths on hand-made arrays: exact output law, greedy, one-hot, processing."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats as sps

from ondevice.errors import OndeviceError
from ondevice.sampling import SamplingParams, accept_probability, probs, probs_batch, residual, sample, verify


class FixedRng:
    """A stand-in Generator whose uniforms are scripted."""

    def __init__(self, values):
        self.values = list(values)

    def random(self):
        return self.values.pop(0)


def _random_pair(rng, V):
    p = rng.random(V) ** 3
    q = rng.random(V) ** 3
    # zeros in q where p > 0 and vice versa
    p[rng.choice(V, V // 4, replace=False)] = 0
    q[rng.choice(V, V // 4, replace=False)] = 0
    return p / p.sum(), q / q.sum()


def _law_one_step(p, q):
    """P(emitted = y) for one draft x ~ q, summed exactly over x, using the module's accept/residual rule."""
    law = np.zeros_like(p)
    r = residual(p, q)
    for x in np.flatnonzero(q):
        a = accept_probability(p, q, x)
        law[x] += q[x] * a
        law += q[x] * (1 - a) * r
    return law


@pytest.mark.parametrize("V", [2, 3, 7, 50, 1000])
@pytest.mark.parametrize("seed", range(5))
def test_output_law_equals_target_exactly(V, seed):
    p, q = _random_pair(np.random.default_rng(seed * 100 + V), V)
    assert np.abs(_law_one_step(p, q) - p).max() < 1e-9


def test_law_of_a_planted_bug_is_not_the_target():
    # The classic bug: resample from p instead of the residual after a rejection.
    p, q = _random_pair(np.random.default_rng(7), 20)
    law = np.zeros_like(p)
    for x in np.flatnonzero(q):
        a = accept_probability(p, q, x)
        law[x] += q[x] * a
        law += q[x] * (1 - a) * p
    assert np.abs(law - p).max() > 1e-3


def test_verify_follows_accept_probability_and_residual():
    p = np.array([0.5, 0.3, 0.2, 0.0])
    q = np.array([[0.25, 0.6, 0.05, 0.1]])
    # x = 1: a = 0.3 / 0.6 = 0.5. u just below → accepted, then bonus from p row 1.
    p2 = np.stack([p, np.array([0.0, 0.0, 0.0, 1.0])])
    assert verify([1], q, p2, FixedRng([0.499, 0.3])) == (1, 3)
    # u just above → rejected; the residual is max(0, p − q) = [0.25, 0, 0.15, 0] / 0.4.
    n, y = verify([1], q, p2, FixedRng([0.501, 0.5]))
    assert n == 0 and y == 0  # CDF of the residual: [0.625, 0.625, 1.0, 1.0]; 0.5 → id 0
    n, y = verify([1], q, p2, FixedRng([0.501, 0.7]))
    assert n == 0 and y == 2
    # a token the target gives zero probability is always rejected
    q3 = np.array([[0.0, 0.0, 0.0, 1.0]])
    assert verify([3], q3, p2, FixedRng([0.0, 0.1]))[0] == 0


def test_verify_monte_carlo_matches_target_and_detects_planted_bug():
    rng = np.random.default_rng(0)
    V = 8
    p, q = _random_pair(rng, V)
    q = 0.5 * q + 0.5 * np.eye(V)[np.argmax(p)]  # make sure drafts get accepted and rejected
    n = 40000
    counts = np.zeros(V)
    bug = np.zeros(V)
    pp = np.stack([p, p])
    for _ in range(n):
        x = sample(q, rng)
        acc, y = verify([x], q[None], pp, rng)
        counts[x if acc else y] += 1
        # planted bug: on rejection draw from p itself
        if rng.random() * q[x] < p[x]:
            bug[x] += 1
        else:
            bug[sample(p, rng)] += 1
    keep = p > 0
    assert counts[~keep].sum() == 0
    assert sps.chisquare(counts[keep], n * p[keep]).pvalue > 1e-3
    assert sps.chisquare(bug[keep], n * p[keep] * bug[keep].sum() / n).pvalue < 1e-6


def test_greedy_is_argmax_matching_with_exact_pattern():
    params = SamplingParams(temperature=0)
    logits = np.array([[0.1, 3.0, 0.2], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0], [1.0, 0.0, 0.0]])
    p = probs_batch(logits, params, [], [1, 0, 2])
    assert (p.argmax(1) == [1, 0, 2, 0]).all() and set(np.unique(p)) <= {0.0, 1.0}
    rng = np.random.default_rng(0)
    # draft agrees on the first two, disagrees on the third → 2 accepted, target's argmax follows
    q = np.eye(3)[[1, 0, 1]]
    assert verify([1, 0, 1], q, p, rng) == (2, 2)
    # draft == target: every draft accepted, bonus = argmax of the last row
    q = np.eye(3)[[1, 0, 2]]
    assert verify([1, 0, 2], q, p, rng) == (3, 0)
    # draft wrong at once
    assert verify([2, 0, 2], np.eye(3)[[2, 0, 2]], p, rng) == (0, 1)


def test_one_hot_draft_is_exact():
    # A deterministic drafter (n-gram) has q = one-hot: accept with p(x); else the residual is p without x.
    p = np.array([0.2, 0.5, 0.3])
    q = np.array([0.0, 1.0, 0.0])
    assert np.allclose(residual(p, q), [0.4, 0.0, 0.6])
    assert np.abs(_law_one_step(p, q) - p).max() < 1e-12


def test_probs_processing():
    logits = np.array([3.0, 2.0, 1.0, 0.0, -1.0])
    base = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    full = probs(logits, base)
    assert np.allclose(full, np.exp(logits) / np.exp(logits).sum())
    k2 = probs(logits, SamplingParams(temperature=1.0, top_k=2, top_p=1.0, min_p=0.0))
    assert (k2[2:] == 0).all() and np.isclose(k2[:2].sum(), 1)
    tp = probs(logits, SamplingParams(temperature=1.0, top_k=0, top_p=0.7, min_p=0.0))
    assert np.count_nonzero(tp) == 2  # 0.64 < 0.7 <= 0.88
    mp = probs(logits, SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.3))
    assert np.count_nonzero(mp) == 2  # e^-1 = 0.37 >= 0.3, e^-2 < 0.3
    hot = probs(logits, SamplingParams(temperature=0.5, top_k=0, top_p=1.0, min_p=0.0))
    assert hot[0] > full[0]
    rep = probs(logits, SamplingParams(temperature=0, repetition_penalty=4.0), history=[0])
    assert rep.argmax() == 1  # 3.0 / 4 < 2.0
    lim = probs(logits, base, vocab_limit=3)
    assert (lim[3:] == 0).all() and np.isclose(lim.sum(), 1)


def test_sampling_params_validation():
    for bad in [dict(temperature=-1), dict(top_k=-2), dict(top_p=0.0), dict(top_p=1.5), dict(min_p=1.0),
                dict(repetition_penalty=0), dict(seed=-3), dict(temperature=float("nan"))]:
        with pytest.raises(OndeviceError, match="invalid sampling parameter"):
            SamplingParams(**bad)
    assert SamplingParams.from_dict({"temperature": 0, "unknown": 1}).greedy
