"""The sampler's fast paths against the reference implementation they replaced, bit for bit.

``_ref_probs`` is the sampler as it was before the fast paths (a full float64 row, argpartition,
dense output); every fast function must give the same bits and leave the generator in the same state.
"""

from __future__ import annotations

import numpy as np
import pytest

from ondevice import sampling
from ondevice.drafters import Drafter, ModelDrafter, Traits
from ondevice.policy import FixedGamma
from ondevice.sampling import (
    SamplingParams,
    probs,
    probs_batch,
    residual,
    sample,
    verify,
    verify_greedy,
    verify_logits,
)
from ondevice.speculative import steps

REPETITION_WINDOW = 64


def _ref_penalize(logits, history, penalty):
    if penalty == 1.0 or not len(history):
        return logits
    seen = np.unique(np.asarray(history[-REPETITION_WINDOW:], dtype=np.int64))
    seen = seen[(seen >= 0) & (seen < logits.shape[-1])]
    out = logits.copy()
    v = out[seen]
    out[seen] = np.where(v > 0, v / penalty, v * penalty)
    return out


def _ref_probs(logits, params, history=(), vocab_limit=None):
    x = np.asarray(logits, dtype=np.float64)
    V = x.shape[-1]
    if vocab_limit is not None and vocab_limit < V:
        x = x.copy()
        x[vocab_limit:] = -np.inf
    x = _ref_penalize(x, history, params.repetition_penalty)
    out = np.zeros(V, dtype=np.float64)
    if params.greedy:
        out[int(np.argmax(x))] = 1.0
        return out
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
            keep = min(keep, int(np.searchsorted(np.cumsum(pr), params.top_p, side="left")) + 1)
        if params.min_p > 0.0:
            keep = min(keep, max(1, int(np.sum(pr >= params.min_p * pr[0]))))
        cand, lc = cand[:keep], lc[:keep]
    z = (lc - lc[0]) / params.temperature
    e = np.exp(z)
    out[cand] = e / e.sum()
    return out


def _ref_probs_batch(logits, params, history, draft, vocab_limit=None):
    hist, rows = list(history), []
    for i in range(logits.shape[0]):
        rows.append(_ref_probs(logits[i], params, hist, vocab_limit))
        if i < len(draft):
            hist.append(int(draft[i]))
    return np.stack(rows)


def _one_hot(tokens, V):
    q = np.zeros((len(tokens), V))
    q[np.arange(len(tokens)), np.asarray(tokens, dtype=np.int64)] = 1.0
    return q


def _logits(rng, V, kind):
    """float32 logits: continuous, coarse (many ties), planted ties at the top, -inf holes, or a NaN."""
    x = (rng.standard_normal(V) * 3).astype(np.float32)
    if kind == "coarse":
        x = np.round(x).astype(np.float32)
    elif kind == "top_ties":
        top = np.argsort(-x)[:6]
        x[top[1:4]] = x[top[0]]
        x[rng.choice(V, 3)] = x[top[5]]
    elif kind == "neg_inf":
        x[rng.choice(V, V // 3, replace=False)] = -np.inf
    elif kind == "nan":
        x[rng.integers(V)] = np.nan
    return x


KINDS = ("plain", "coarse", "top_ties", "neg_inf", "nan")


def _params(rng, V, greedy=None):
    t = rng.choice([0.0, 0.7, 1.5]) if greedy is None else (0.0 if greedy else rng.choice([0.7, 1.5]))
    return SamplingParams(
        temperature=float(t),
        top_k=int(rng.choice([0, 1, 5, 40, V - 1, V, V + 3])),
        top_p=float(rng.choice([1.0, 0.9, 0.5])),
        min_p=float(rng.choice([0.0, 0.05, 0.3])),
        repetition_penalty=float(rng.choice([1.0, 1.0, 1.3, 2.0, 0.7])),
    )


def _history(rng, V):
    n = int(rng.choice([0, 5, 40, 100]))
    return [int(t) for t in rng.integers(-2, V + 3, n)] if n else []


def _same(a, b) -> bool:
    return a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.mark.parametrize("V", [7, 60, 3000])
def test_probs_is_bit_identical_to_the_reference(V):
    rng = np.random.default_rng(V)
    fast_taken = 0
    for case in range(500 if V < 1000 else 250):
        kind = KINDS[case % len(KINDS)]
        x = _logits(rng, V, kind)
        params, hist = _params(rng, V), _history(rng, V)
        limit = [None, None, V // 2, V - 1, 3][case % 5]
        want = _ref_probs(x, params, hist, limit)
        got = probs(x, params, hist, limit)
        assert _same(got, want), (V, case, kind, params, limit)
        assert _same(probs(x.astype(np.float64), params, hist, limit), want)
        k = params.top_k
        fast_taken += (not params.greedy and 0 < k < (limit or V) and
                       sampling._top_k(x[: limit or V], k, np.zeros(0, np.int64), 1.0) is not None)
    assert fast_taken > 20  # the shortcut was exercised, not only the full-partition fallback


def test_greedy_argmax_under_the_penalty_resolves_ties_and_nans_as_argmax_does():
    rng = np.random.default_rng(4)
    values = np.array([-np.inf, -2.0, -1.0, 0.0, 1.0, 2.0, np.nan], dtype=np.float32)
    for case in range(3000):
        V = int(rng.integers(1, 9))
        x = values[rng.integers(0, len(values) - (case % 3 != 0), V)]  # a NaN in one case out of three
        hist = [int(t) for t in rng.integers(0, V, rng.integers(0, 6))]
        for pen in (2.0, 0.5):  # exact halving/doubling: a seen 2.0 ties an unseen 1.0, a seen -1.0 an unseen -2.0
            params = SamplingParams(temperature=0, repetition_penalty=pen)
            limit = None if case % 4 else int(rng.integers(1, V + 1))
            assert _same(probs(x, params, hist, limit), _ref_probs(x, params, hist, limit)), (x, hist, pen, limit)


def test_top_k_shortcut_declines_a_straddling_tie():
    x = np.array([5, 4, 3, 3, 3, 1, 0, -1], dtype=np.float32)
    assert sampling._top_k(x, 3, np.zeros(0, np.int64), 1.0) is None  # which 3 wins is argpartition's choice
    ids, g = sampling._top_k(x, 5, np.zeros(0, np.int64), 1.0)
    assert sorted(ids.tolist()) == [0, 1, 2, 3, 4] and g.dtype == np.float64


def test_probs_batch_is_bit_identical_to_the_reference():
    rng = np.random.default_rng(1)
    for case in range(60):
        V, g = int(rng.choice([9, 400])), int(rng.integers(0, 6))
        logits = np.stack([_logits(rng, V, KINDS[(case + i) % 4]) for i in range(g + 1)])
        params, hist = _params(rng, V), _history(rng, V)
        draft = [int(t) for t in rng.integers(0, V, g)]
        assert _same(probs_batch(logits, params, hist, draft), _ref_probs_batch(logits, params, hist, draft))


def test_sparse_residual_is_bit_identical_to_the_dense_one():
    rng = np.random.default_rng(6)
    for case in range(200):
        V = int(rng.choice([5, 300, 5000]))
        ids = rng.choice(V, int(rng.integers(1, V + 1)), replace=False)
        pr = rng.random(len(ids)) ** 4
        pr[rng.random(len(ids)) < 0.1] = 0.0
        pr = pr / pr.sum() if pr.sum() else np.eye(len(ids))[0]
        p = np.zeros(V)
        p[ids] = pr
        q = np.zeros(V)
        if case % 2:
            q[rng.integers(V)] = 1.0  # one-hot draft
        else:
            q[rng.choice(V, V // 2, replace=False)] = rng.random(V // 2)
            q /= q.sum()
        got = np.zeros(V)
        got[ids] = sampling.residual_sparse(ids, pr, q[ids], V)
        assert _same(got, residual(p, q)), case


def _verify_cases(seed, greedy, n=300):
    """(draft, q, logits, params, history) with drafts that often agree with the target: the argmax
    of the penalised row, the raw argmax (differs when the penalty moves it), or a random id."""
    rng = np.random.default_rng(seed)
    for case in range(n):
        V, g = int(rng.choice([6, 50, 2000])), int(rng.integers(0, 7))
        kind = ["plain", "coarse", "top_ties", "neg_inf"][case % 4]
        logits = np.stack([_logits(rng, V, kind) for _ in range(g + 1)])
        params = _params(rng, V, greedy)
        if params.repetition_penalty == 1.0 and case % 2:
            params = SamplingParams(**{**params.__dict__, "repetition_penalty": 2.0})
        hist = _history(rng, V) or [int(t) for t in rng.integers(0, V, 30)]
        hist += [int(t) for t in np.argsort(-logits[0])[:3]]  # the top ids are seen: the penalty matters
        draft = []
        for i in range(g):
            row = _ref_probs(logits[i], SamplingParams(temperature=0, repetition_penalty=params.repetition_penalty),
                             hist + draft)
            pick = rng.random()
            draft.append(int(np.argmax(row)) if pick < 0.7 else int(np.argmax(logits[i])) if pick < 0.85
                         else int(rng.integers(V)))
        if case % 3 == 0:
            q = None
        elif greedy:
            q = _one_hot(draft, V) if g else None
        else:
            q = np.stack([_ref_probs(rng.standard_normal(V), SamplingParams(temperature=1.0, top_k=0, top_p=1.0,
                                                                          min_p=0.0)) for _ in range(g)]) if g else None
            if q is not None:
                q[np.arange(g), draft] += 0.5
                q /= q.sum(1, keepdims=True)
        yield draft, q, logits, params, hist


def _mismatches(fast, greedy, seed=3):
    """How many cases ``fast`` answers differently from verify(draft, q, reference p) or leaves rng elsewhere."""
    bad = 0
    for case, (draft, q, logits, params, hist) in enumerate(_verify_cases(seed, greedy)):
        V = logits.shape[1]
        p = _ref_probs_batch(logits, params, hist, draft)
        qq = _one_hot(draft, V) if q is None else q
        r1, r2 = np.random.default_rng(case), np.random.default_rng(case)
        want = verify(draft, qq, p, r1)
        got = fast(draft, q, logits, params, hist, r2)
        bad += got != want or r1.random() != r2.random()
    return bad


def test_greedy_fast_path_equals_verify_on_reference_rows():
    assert _mismatches(lambda d, q, lg, pa, h, r: verify_greedy(d, lg, pa, h, r), greedy=True) == 0
    assert _mismatches(verify_logits, greedy=True) == 0


def test_planted_bug_greedy_fast_path_without_the_penalty_is_caught():
    def no_penalty(d, q, lg, pa, h, r):
        return verify_greedy(d, lg, SamplingParams(temperature=0.0), h, r)

    def one_draw_extra(d, q, lg, pa, h, r):
        out = verify_greedy(d, lg, pa, h, r)
        if out[0] == len(d):
            r.random()  # one uniform too many after a full accept: the generator's state drifts
        return out

    assert _mismatches(no_penalty, greedy=True) > 10
    assert _mismatches(one_draw_extra, greedy=True) > 10


def test_sampled_lazy_verify_equals_verify_on_reference_rows():
    assert _mismatches(verify_logits, greedy=False) == 0


class _FakeBackend:
    """A deterministic 'model': logits are a fixed function of the last token and the position."""

    def __init__(self, V, n_ctx=256, seed=0, coarse=False):
        self.vocab_size, self.n_ctx, self.n_past = V, n_ctx, 0
        r = np.random.default_rng(seed)
        self.table = (r.standard_normal((V, V)) * 3).astype(np.float32)
        if coarse:
            self.table = np.round(self.table)
        self.ids: list[int] = []

    def _row(self, pos, tok):
        return np.roll(self.table[tok % self.vocab_size], pos % 3)

    def eval(self, tokens, logits="all"):
        start = len(self.ids)
        self.ids += list(tokens)
        self.n_past = len(self.ids)
        rows = np.stack([self._row(start + i, t) for i, t in enumerate(tokens)])
        return rows[-1:] if logits == "last" else rows

    def rollback(self, n):
        self.ids = self.ids[:n]
        self.n_past = n

    def close(self):
        pass


def _ref_model_propose(backend, context, gamma, params, rng, vocab_limit, target_vocab):
    """The draft loop as it was: dense probs rows, dense sample, stacked and padded/cut q."""
    hist = list(context)
    backend.rollback(0)
    logits = backend.eval([t if 0 <= t < vocab_limit else 0 for t in context], logits="last")[-1]
    tokens, rows = [], []
    for i in range(gamma):
        q = _ref_probs(logits, params, hist, vocab_limit)
        t = sample(q, rng)
        tokens.append(t)
        rows.append(q)
        hist.append(t)
        if i + 1 < gamma:
            logits = backend.eval([t], logits="last")[-1]
    q = np.stack(rows)
    if q.shape[1] < target_vocab:
        q = np.pad(q, ((0, 0), (0, target_vocab - q.shape[1])))
    return tokens, q[:, :target_vocab]


@pytest.mark.parametrize("target_vocab", [40, 48, 30])
def test_model_drafter_draws_the_reference_tokens_and_q(target_vocab):
    rng = np.random.default_rng(5)
    for case in range(40):
        params = _params(rng, 40)
        ctx = [int(t) for t in rng.integers(0, 48, 12)]
        d = ModelDrafter(_FakeBackend(40, coarse=case % 2 == 0), vocab_limit=min(32, target_vocab), target_vocab=target_vocab)
        r1, r2 = np.random.default_rng(case), np.random.default_rng(case)
        want_t, want_q = _ref_model_propose(_FakeBackend(40, coarse=case % 2 == 0), ctx, 5, params, r1,
                                            min(32, target_vocab), target_vocab)
        got_t, got_q = d.propose(ctx, 5, params, r2)
        assert got_t == want_t and r1.random() == r2.random()
        assert _same(_one_hot(got_t, target_vocab) if got_q is None else got_q, want_q)
        assert (got_q is None) == params.greedy


class _Ngram(Drafter):
    """A cheap drafter proposing a fixed pattern (some of it right, some wrong)."""

    traits, last_match_len = Traits(name="fake", cheap=True), 0

    def propose(self, context, gamma, params, rng, keep_drafting=None, constraint=None):
        return [(context[-1] * 7 + i) % 50 for i in range(gamma)], None


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_steps_without_observer_emit_what_the_observed_loop_emits(temperature):
    params = SamplingParams(temperature=temperature, top_k=10, repetition_penalty=1.3)
    runs = []
    for observed in (False, True):
        target = _FakeBackend(50, coarse=True, seed=2)
        ctx = [1, 2, 3, 4]
        target.eval(ctx[:-1])
        seen = []
        it = steps(target, _Ngram(), ctx, params, FixedGamma(4), np.random.default_rng(9),
                   (lambda *a, s=seen: s.append(a)) if observed else None)
        for _ in range(40):
            next(it)
        runs.append(ctx)
        assert bool(seen) == observed
    assert runs[0] == runs[1]
