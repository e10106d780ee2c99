"""The DFlash drafter through the runtime (``draft=DIR/x.gguf`` of arch dflash, ``drafter="dflash"``): greedy
speculation equals plain decoding token for token, and the sampled law is the target's (chi-square at T = 0.8,
top-k 6, with planted-bug controls that must fail), on tiny llama, qwen3 and qwen2 targets with random-weight
block drafts (qwen2's graph records no layer inputs: the backend reads them through its cb_eval tap)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import (
    DRAFT_PROMPTS,
    LAW_PROMPT,
    favoured_tokens,
    greedy_equal,
    law_after,
    plant_no_residual,
    plant_wrong_q,
    sampled_law_broken,
    sampled_law_kept,
    tiny_gguf_target,
)

import ondevice
from ondevice.errors import OndeviceError

PROMPTS = DRAFT_PROMPTS


@pytest.fixture(scope="module", params=["llama", "qwen3", "qwen2"])
def pair(request, tmp_path_factory):
    """(target GGUF, greedy draft, law draft, the exact law, its prompt ids) for a tiny target of each
    architecture. Each draft's vocabulary (d2t) is a few tokens the target favours, with a logit bias in order of
    preference, so drafts are both kept and rejected: the greedy draft prefers the tokens greedy answers repeat,
    the law draft the tokens of the law's prompt."""
    from ondevice.testing.dflash import make_tiny_dflash_gguf
    from ondevice.testing.mtp import MtpShape

    base = tmp_path_factory.mktemp(f"dfd-{request.param}")
    target = tiny_gguf_target(base, request.param)
    law, ids = law_after(target)
    by_mass, by_seen = favoured_tokens(target, law)
    layers = (1, 3) if request.param == "qwen2" else (0, 2)  # the qwen2 tap cannot take layer 0's input

    def draft(name, favourites):
        return make_tiny_dflash_gguf(base / name, target=MtpShape(n_layer=4, vocab_size=512), target_layers=layers,
                                     block_size=5, favourites=list(dict.fromkeys(favourites)), preference=6.0, seed=1)

    return (target, draft("greedy.gguf", by_seen[:8] + by_mass[:6]), draft("law.gguf", by_mass[:8] + by_seen[:4]),
            law, ids)


def test_the_draft_file_names_its_kind_and_greedy_equals_plain(pair):
    """``draft=x.gguf`` of arch dflash selects the DFlash drafter; greedy speculation with a fixed γ (beyond the
    block's 4: capped) emits plain decoding's tokens, with drafts both accepted and rejected."""
    target, draft = pair[:2]
    with ondevice.load(target, draft=str(draft), threads=1) as spec, \
            ondevice.load(target, drafter="none", threads=1) as plain:
        assert spec.drafter.name == "dflash"
        drafted, accepted = greedy_equal(spec, plain, PROMPTS, (1, 4, 7), cap=4)  # 7: more than the block's 4
        assert 0 < accepted < drafted, (accepted, drafted)


def test_sampled_law_is_the_targets(pair, monkeypatch):
    """Joint law of 3 tokens at T = 0.8, top-k 6 against the exact target law (γ = 3, one block; q = each block
    row's processed distribution); the planted control, a residual that does not subtract q, must fail."""
    target, _, draft, law, ids = pair
    with ondevice.load(target, drafter="dflash", draft=str(draft), threads=1) as rt:
        sampled_law_kept(rt, ids, law)
        plant_no_residual(monkeypatch)  # the planted bug
        sampled_law_broken(rt, ids, law)


def test_a_wrong_q_fails_the_law(pair, monkeypatch):
    """Second planted control: q rows replaced by a uniform law (not the distribution the tokens were drawn
    from) break the target's law."""
    from ondevice.drafters.dflash import DFlashDrafter

    target, _, draft, law, ids = pair
    with ondevice.load(target, draft=str(draft), threads=1) as rt:
        plant_wrong_q(monkeypatch, DFlashDrafter)
        sampled_law_broken(rt, ids, law)


def test_blocks_are_drafted_from_the_contexts_true_features(pair):
    """After speculative decoding (drafts kept and rejected, the draft's cache rolled back and refilled; earlier
    requests on another prompt and on one sharing a prefix), the block the drafter drafts equals the one a fresh
    draft makes from a fresh target pass over the same context: the cache holds exactly the features of the
    context's positions (fails when the cache keeps positions past the common prefix)."""
    from ondevice.backends.llama import LlamaBackend
    from ondevice.backends.llama_dflash import DFlashGraph

    target, draft = pair[:2]
    with ondevice.load(target, draft=str(draft), threads=1) as spec:
        for prompt in (PROMPTS[0], LAW_PROMPT + " verify"):
            spec.generate(prompt, max_tokens=8, temperature=0, gamma=4)
        res = spec.generate(PROMPTS[1], max_tokens=24, temperature=0, gamma=4)
        assert res.stats.accepted < res.stats.drafted
        context = spec.target.tokenize(PROMPTS[1]) + list(res.tokens)
        d = spec.drafter
        d.target.rollback(len(context) - 1)  # the last token pending, as a step would leave it
        assert d._absorb(context)
        got = d.graph.draft(context[-1], 4)
    b = LlamaBackend(target, n_ctx=256, threads=1)
    g = None
    try:
        g = DFlashGraph(draft, b._model, lambda ids: (b.enable_layer_inputs(ids), b._ctx)[1], n_ctx=256, threads=1)
        b.eval(context[:-1])
        g.observe(np.stack([b.feature("layer_inputs", p) for p in range(len(context) - 1)]), 0)
        want = g.draft(context[-1], 4)
    finally:
        if g is not None:
            g.close()
        b.close()
    fin = np.isfinite(want)
    assert np.array_equal(fin, np.isfinite(got))
    np.testing.assert_allclose(got[fin], want[fin], rtol=1e-3, atol=1e-3 * np.abs(want[fin]).max())


def test_refusals_are_one_line(pair, tmp_path):
    """drafter='dflash' without a draft says what to pass; a draft for another vocabulary is refused naming it."""
    from ondevice.testing.dflash import make_tiny_dflash_gguf
    from ondevice.testing.mtp import MtpShape

    target = pair[0]
    with pytest.raises(OndeviceError, match="needs the draft"):
        ondevice.load(target, drafter="dflash", threads=1)
    other = make_tiny_dflash_gguf(tmp_path / "other.gguf", target=MtpShape(n_layer=4, vocab_size=768),
                                  target_layers=(1, 2))
    with pytest.raises(OndeviceError, match="made for another target") as e:
        ondevice.load(target, draft=str(other), threads=1)
    assert "\n" not in str(e.value)
