"""The speculative engine on llama.cpp: batch invariance, rollback, greedy equality, exact sampling law."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from helpers import PROMPT, batch_invariant, chisquare, exact_joint_law, sampled_counts

import ondevice
from ondevice import sampling
from ondevice.backends.llama import LlamaBackend
from ondevice.errors import OndeviceError


@pytest.mark.parametrize("name,quant", [("llama", "q8_0"), ("qwen2", "q8_0"), ("llama", "q4_0")])
def test_tiny_models_are_batch_invariant(tiny_gguf, name, quant):
    # Greedy equality below is asserted only because this holds (K-quants on CPU need not).
    assert batch_invariant(tiny_gguf(name, quant))


def test_rollback_parity_bit_for_bit(tiny_gguf):
    path = tiny_gguf("qwen2")
    b = LlamaBackend(path, n_ctx=256)
    ids = b.tokenize(PROMPT + " and the cache rolls back")
    a, bb, c = ids[:6], ids[6:11], ids[11:14]
    b.eval(a)
    b.eval(bb)
    b.rollback(8)
    assert b.n_past == 8
    after = b.eval(c)
    b.close()
    fresh = LlamaBackend(path, n_ctx=256)
    fresh.eval(a)
    fresh.eval(bb[:2])
    ref = fresh.eval(c)
    fresh.close()
    assert np.array_equal(after, ref)


def _gen(rt, prompt, **kw):
    return rt.generate(prompt, **kw)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_speculative_equals_plain(tiny_gguf, arch):
    target, draft = tiny_gguf(arch), tiny_gguf(f"{arch}_draft")
    with ondevice.load(target, drafter="none") as plain_rt:
        ref = _gen(plain_rt, PROMPT, max_tokens=48, temperature=0, gamma=0)
    assert len(ref.tokens) == 48 or ref.stats.stop_reason == "eos"
    with ondevice.load(target, draft) as rt:
        for gamma in (1, 3, 5):
            res = _gen(rt, PROMPT, max_tokens=48, temperature=0, gamma=gamma)
            assert res.tokens == ref.tokens, f"gamma={gamma}"
            assert res.text == ref.text
            assert 0 < res.stats.accepted < res.stats.drafted  # both branches of the rule were taken
    with ondevice.load(target, drafter="ngram") as rt:
        assert _gen(rt, PROMPT, max_tokens=48, temperature=0, gamma=4).tokens == ref.tokens


def test_draft_equal_to_target_accepts_every_draft(tiny_gguf):
    path = tiny_gguf("llama")
    gamma = 3
    with ondevice.load(path, path) as rt:
        res = rt.generate(PROMPT, max_tokens=8 * (gamma + 1), temperature=0, gamma=gamma)
    s = res.stats
    if s.stop_reason == "length":
        assert s.target_forwards == 8
        assert s.accept_counts == [0] * gamma + [8]
        assert s.drafted == s.accepted == 8 * gamma and s.acceptance_rate == 1.0
        assert s.mean_accepted_per_forward == gamma + 1


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_sampled_speculative_matches_target_law(tiny_gguf, temperature, monkeypatch):
    """Joint law of the first 3 tokens, speculative (draft != target) vs the exact target law.

    Negative control: the same test with a planted bug (resample from p instead of the residual)
    must fail, which shows the test has the power to catch a broken sampler.
    """
    target, draft = tiny_gguf("qwen2"), tiny_gguf("qwen2_draft")
    top_k, n = 6, 3000
    with ondevice.load(target, draft) as rt:
        ids = rt.tokenize(PROMPT)
        params = sampling.SamplingParams(temperature=temperature, top_k=top_k, top_p=1.0, min_p=0.0)
        law = exact_joint_law(target, ids, params)
        assert abs(sum(law.values()) - 1) < 1e-9
        counts = sampled_counts(rt, ids, n, temperature, top_k, gamma=2)
        acc = rt.generate(ids, max_tokens=32, temperature=temperature, top_k=top_k, top_p=1.0, min_p=0.0,
                          seed=1, gamma=2).stats.acceptance_rate
        assert 0.2 < acc < 0.95, acc  # drafts are both accepted and rejected: the test exercises both
        assert chisquare(counts, law, n) > 1e-3
        monkeypatch.setattr(sampling, "residual", lambda p, q: p)  # the planted bug
        monkeypatch.setattr(sampling, "residual_sparse", lambda ids, pr, qv, V: pr)  # the loop's sparse form
        bug = sampled_counts(rt, ids, n, temperature, top_k, gamma=2)
        assert chisquare(bug, law, n) < 1e-4


def test_plain_sampling_matches_target_law(tiny_gguf):
    target = tiny_gguf("llama")
    with ondevice.load(target, drafter="none") as rt:
        ids = rt.tokenize(PROMPT)
        params = sampling.SamplingParams(temperature=1.0, top_k=6, top_p=1.0, min_p=0.0)
        law = exact_joint_law(target, ids, params)
        counts = sampled_counts(rt, ids, 2000, 1.0, 6, gamma=0)
    assert chisquare(counts, law, 2000) > 1e-3


def test_stream_chunks_add_up_and_stop_strings(tiny_gguf):
    target, draft = tiny_gguf("llama"), tiny_gguf("llama_draft")
    with ondevice.load(target, draft) as rt:
        full = rt.generate(PROMPT, max_tokens=40, temperature=0, gamma=3)
        s = rt.stream(PROMPT, max_tokens=40, temperature=0, gamma=3)
        chunks = list(s)
        assert "".join(c.text for c in chunks) == full.text
        assert list(itertools.chain.from_iterable(c.tokens for c in chunks)) == full.tokens
        assert all(len(c.tokens) == len(c.from_draft) for c in chunks)
        assert any(any(c.from_draft) for c in chunks)
        stop = full.text[10:14]
        cut = rt.generate(PROMPT, max_tokens=40, temperature=0, gamma=3, stop=[stop])
        assert cut.text == full.text[: full.text.index(stop)]
        assert cut.stats.stop_reason == "stop"
        assert rt.generate(PROMPT, max_tokens=5, temperature=0).stats.tokens == 5


def test_cancel_stops_within_one_step(tiny_gguf):
    with ondevice.load(tiny_gguf("llama"), drafter="ngram") as rt:
        s = rt.stream(PROMPT, max_tokens=200, temperature=0, gamma=4)
        first = next(s)
        s.cancel()
        rest = list(s)
        assert len(rest) <= 1 and s.stats.stop_reason == "cancelled"
        assert s.stats.target_forwards <= 2 and first.tokens


def test_prefix_reuse_evaluates_only_new_tokens(tiny_gguf):
    with ondevice.load(tiny_gguf("llama"), drafter="none") as rt:
        a = rt.generate(PROMPT, max_tokens=4, temperature=0)
        assert a.stats.prompt_eval_tokens == a.stats.prompt_tokens
        b = rt.generate(PROMPT + " again", max_tokens=4, temperature=0)
        assert b.stats.prompt_eval_tokens < b.stats.prompt_tokens
        again = rt.generate(PROMPT, max_tokens=4, temperature=0)
        assert again.tokens == a.tokens


def test_bad_inputs_are_one_line_errors(tiny_gguf, tmp_path):
    with pytest.raises(OndeviceError, match="no such"):
        ondevice.load(tmp_path / "missing.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOTAGGUF" + b"\0" * 64)
    with pytest.raises(OndeviceError, match="not a GGUF"):
        ondevice.load(bad)
    trunc = tmp_path / "trunc.gguf"
    trunc.write_bytes(tiny_gguf("llama").read_bytes()[:5000])
    with pytest.raises(OndeviceError, match="could not load"):
        ondevice.load(trunc)
    with pytest.raises(OndeviceError, match="vocab mismatch"):
        ondevice.load(tiny_gguf("llama"), tiny_gguf("qwen2"))
    with pytest.raises(OndeviceError, match="unknown model"):
        ondevice.load("no-such-model")
    with pytest.raises(OndeviceError, match="device="):
        ondevice.load(tiny_gguf("llama"), device="tpu")
    with ondevice.load(tiny_gguf("llama"), n_ctx=256) as rt:
        n_ctx = rt.target.n_ctx
        ids = (rt.tokenize(PROMPT) * n_ctx)[:n_ctx]
        with pytest.raises(OndeviceError, match="n_ctx"):
            rt.generate(ids, max_tokens=4)
        with pytest.raises(OndeviceError, match="temperature"):
            rt.generate(PROMPT, temperature=-1)
        with pytest.raises(OndeviceError, match="top_p"):
            rt.generate(PROMPT, top_p=2.0)
        with pytest.raises(OndeviceError, match="max_tokens"):
            rt.generate(PROMPT, max_tokens=0)
        with pytest.raises(OndeviceError, match="gamma"):
            rt.generate(PROMPT, gamma="fast")
        for gamma in (0, 4):  # runs into the end of the context: stops cleanly, never overflows
            res = rt.generate(ids[: n_ctx - 6], max_tokens=100, temperature=0, gamma=gamma)
            assert res.stats.stop_reason in ("context", "eos") and res.stats.tokens <= 7
