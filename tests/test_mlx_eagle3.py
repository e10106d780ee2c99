"""EAGLE-3 drafts on MLX targets: the target's layer inputs read from its own passes (``mlx_layers``), the draft run
in MLX (``mlx_eagle3.Eagle3MLX``) against the numpy reference, greedy speculation equal to plain decoding, the
sampled law the target's (chi-square at T = 0.8 with planted-bug controls that must fail), and the one-line
refusals (a model without a ``layers`` list; ``draft="mtp"``, whose weights mlx-lm drops).

Targets: a tiny random-weight llama written by our converter to MLX (float16: mlx-lm's 8-bit layers cost ~20× more
per pass on this CPU); drafts: random-weight EAGLE-3 checkpoints (``ondevice.testing.eagle3``) converted to GGUF
against the same HF checkpoint. Everything runs on MLX's CPU device here."""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest
from helpers import (
    DRAFT_PROMPTS,
    LAW,
    exact_law,
    greedy_equal,
    plant_no_residual,
    plant_wrong_q,
    sampled_law_broken,
    sampled_law_kept,
)

import ondevice
from ondevice import sampling
from ondevice.errors import OndeviceError

mx = pytest.importorskip("mlx.core", reason="MLX is not installed (pip install 'ondevice[mlx]')")

LAYERS = (0, 2, 3)
LAW_PROMPT = "The model draft"


def _target(base):
    """(HF checkpoint, MLX directory) of a tiny 4-layer llama, converted by our converter (float16)."""
    from converters import convert
    from ondevice.testing import make_tiny_hf

    hf = make_tiny_hf(base / "hf", arch="llama", n_layers=4)
    convert(hf, to="mlx", out=base / "mlx", bits=16, progress=False)
    return hf, base / "mlx"


def _draft(base, hf, name: str, favourites=None, **kw):
    """A random-weight EAGLE-3 checkpoint for ``hf`` (draft vocabulary = ``favourites`` when given, so drafts are both
    kept and rejected), converted to an f32 GGUF; (checkpoint dir, GGUF)."""
    from safetensors.numpy import load_file, save_file

    from converters.eagle3 import convert_eagle3
    from ondevice.testing.eagle3 import make_tiny_eagle3

    kw = {"own_embeddings": False, "layer_ids": list(LAYERS), **kw}
    src = make_tiny_eagle3(base / f"{name}-src", dtype="float32", draft_vocab=len(favourites or ()) or 128, **kw)
    if favourites:
        t = load_file(src / "model.safetensors")
        ids = np.array(sorted(favourites), np.int64)
        t["d2t"] = ids - np.arange(len(ids), dtype=np.int64)
        mask = np.zeros(512, bool)
        mask[ids] = True
        t["t2d"] = mask
        save_file(t, src / "model.safetensors")
    convert_eagle3(src, target=hf, out=base / name, dtype="f32")
    return src, base / name / "model.gguf"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(HF dir, MLX dir, drafter GGUF whose vocabulary the target favours, the exact law after LAW_PROMPT, its ids,
    base dir)."""
    base = tmp_path_factory.mktemp("mlx-e3")
    hf, target = _target(base)
    with ondevice.load(target, drafter="none", device="cpu") as rt:
        ids = rt.tokenize(LAW_PROMPT)
        law = exact_law(rt.target, ids, sampling.SamplingParams(**LAW))
        seen: dict[int, int] = {}
        for prompt in DRAFT_PROMPTS[:2]:  # the tokens greedy answers repeat
            for t in rt.generate(prompt, max_tokens=24, temperature=0).tokens:
                seen[t] = seen.get(t, 0) + 1
    mass: dict[int, float] = {}
    for seq, pr in law.items():
        for t in seq:
            mass[t] = mass.get(t, 0.0) + pr
    favourites = set(sorted(mass, key=mass.get, reverse=True)[:12]) | set(sorted(seen, key=seen.get, reverse=True)[:10])
    draft = _draft(base, hf, "fav", favourites)[1]
    return hf, target, draft, law, ids, base


def _open(path):
    from ondevice.backends.mlx import MLXBackend

    return MLXBackend(path, n_ctx=256, device="cpu")


def test_layer_inputs_come_from_the_pass_itself(setup):
    """The rows are the inputs of the chosen layers (layer 0's: the token embeddings), one per cached position, from
    eval and from a tree pass alike (its kept path's rows = a chain's), logits unchanged bit for bit; a rollback
    cuts them, ``release_features`` drops consumed ones."""
    target = setup[1]
    b = _open(target)
    try:
        ids = b.tokenize(DRAFT_PROMPTS[1])
        plain = b.eval(ids)
        b.rollback(0)
        width = b.enable_layer_inputs(list(LAYERS))
        assert width == 3 * 256
        np.testing.assert_array_equal(b.eval(ids), plain)
        rows = np.stack([b.feature("layer_inputs", p) for p in range(len(ids))])
        emb = np.array(b.model.model.embed_tokens(mx.array(ids)).astype(mx.float32))
        np.testing.assert_array_equal(rows[:, :256], emb)
        seen = []  # the real inputs of layers 2 and 3, taken by hand on a fresh cache
        h = b.model.model.embed_tokens(mx.array([ids]))
        cache = b._new_cache()
        from mlx_lm.models.base import create_attention_mask

        mask = create_attention_mask(h, cache[0])
        for i, layer in enumerate(b.model.layers):
            seen.append(h)
            h = layer(h, mask, cache=cache[i])
        want = np.concatenate([np.array(seen[i][0].astype(mx.float32)) for i in LAYERS], axis=-1)
        np.testing.assert_allclose(rows, want, rtol=1e-3, atol=1e-3)
        assert b.feature("layer_inputs", len(ids)) is None
        # a tree pass: the path kept [0, 2] equals evaluating the chain of its tokens
        n = len(ids)
        b.eval_tree([5, 7, 9], [-1, 0, 0])
        b.keep_path([0, 2])
        tree_rows = np.stack([b.feature("layer_inputs", p) for p in (n, n + 1)])
        b.rollback(n)
        assert b.feature("layer_inputs", n) is None
        b.eval([5, 9])
        chain_rows = np.stack([b.feature("layer_inputs", p) for p in (n, n + 1)])
        np.testing.assert_allclose(tree_rows, chain_rows, rtol=1e-3, atol=1e-3)
        b.release_features(n)
        assert b.feature("layer_inputs", n - 1) is None and b.feature("layer_inputs", n) is not None
        assert all(type(layer).__name__ != "_Tap" for layer in b.model.layers)  # the list is restored after passes
    finally:
        b.close()


@pytest.mark.parametrize("variant", ["target-table", "own-table-llama3-rope-norms"])
def test_the_mlx_runner_matches_the_numpy_reference(setup, variant):
    """Encoder and decoder of ``Eagle3MLX`` against ``converters.eagle3_check.reference`` on the same random features
    and tokens, the rows fed in two decode calls (the second attends over the cache the first wrote): relative logit
    and pre-norm error ≤ 1e-4 (f32 weights; measured ~1e-6), −inf exactly outside the draft vocabulary. Variants: the
    target's (MLX) token table; its own table with norm_before_fc, norm_before_residual and llama-3 RoPE scaling."""
    from converters.eagle3 import open_eagle3
    from converters.eagle3_check import encode, reference
    from ondevice.backends.mlx_eagle3 import Eagle3MLX

    hf, target, _, _, _, base = setup
    if variant == "target-table":
        src, gguf = _draft(base, hf, "ref1", seed=3)
    else:
        src, gguf = _draft(base, hf, "ref2", seed=4, own_embeddings=True, norm_before_fc=True, norm_before_residual=True,
                           rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                           rope_theta=500000.0)
    b = _open(target)
    try:
        g = Eagle3MLX(gguf, b, lambda ids: b.enable_layer_inputs(ids), n_ctx=64)
        s = open_eagle3(src)
        embed = s.float32("embed_tokens.weight") if variant != "target-table" else \
            np.array(b.model.model.embed_tokens(mx.arange(512)).astype(mx.float32))
        rng = np.random.default_rng(0)
        n = 12
        feats = rng.normal(size=(n, 3 * 256)).astype(np.float32)
        tokens = rng.choice(s.d2t, size=n)
        g_ref = encode(s, feats)
        rows = g.encode(feats)
        assert np.abs(rows - g_ref).max() <= 1e-4 * np.abs(g_ref).max()
        l1, p1 = g.decode(tokens[:5], rows[:5], 0)
        l2, p2 = g.decode(tokens[5:], rows[5:], 5)  # 7 rows after 5 cached: causal within, all of the cache
        ref, pre_ref = reference(s, g_ref, tokens, embed, 512)
        logits, pre = np.concatenate([l1, l2]), np.concatenate([p1, p2])
        finite = np.isfinite(ref)
        assert np.array_equal(np.isfinite(logits), finite) and finite.sum(1).tolist() == [len(s.d2t)] * n
        assert np.abs(logits[finite] - ref[finite]).max() <= 1e-4 * np.abs(ref[finite]).max()
        assert np.abs(pre - pre_ref).max() <= 1e-4 * np.abs(pre_ref).max()
        g.rollback(5)  # a rollback drops the later rows: decoding them again ("last") gives the same last row
        l3, p3 = g.decode(tokens[5:], rows[5:], 5, "last")
        np.testing.assert_allclose(l3, l2[-1:], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(p3, p2[-1:], rtol=1e-5, atol=1e-5)
        g.close()
    finally:
        b.close()


def _chains(rt):
    rt.drafter.traits = dataclasses.replace(rt.drafter.traits, trees=False)
    return rt


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_greedy_speculation_equals_plain(setup, shape):
    """``draft=x.gguf`` (arch eagle3) on an MLX target drafts in MLX; greedy speculation emits plain decoding's tokens
    at γ 1 and 3 (chains) or 3 and 6 (EAGLE-2 trees), with drafts both accepted and rejected."""
    from ondevice.backends.mlx_eagle3 import Eagle3MLX

    target, draft = setup[1], setup[2]
    with ondevice.load(target, draft=str(draft), device="cpu") as spec, \
            ondevice.load(target, drafter="none", device="cpu") as plain:
        assert spec.drafter.name == "eagle3" and isinstance(spec.drafter.graph, Eagle3MLX)
        if shape == "chain":
            _chains(spec)
        drafted, accepted = greedy_equal(spec, plain, DRAFT_PROMPTS[:2], (1, 3) if shape == "chain" else (3, 6),
                                         max_tokens=24)
        assert 0 < accepted < drafted, (accepted, drafted)


def test_sampled_law_is_the_targets(setup, monkeypatch):
    """Joint law of 3 tokens at T = 0.8, top-k 6 (chains, γ = 3; q = the draft's processed distribution) against the
    exact target law; two planted controls must fail the same test: a residual that does not subtract q, and q rows
    replaced by a uniform law over their support."""
    from ondevice.drafters.eagle3 import Eagle3Drafter

    target, draft, law, ids = setup[1:5]
    n = 1500
    with ondevice.load(target, draft=str(draft), device="cpu") as rt:
        _chains(rt)
        sampled_law_kept(rt, ids, law, n=n)  # both outcomes occur, so the controls can fail
        with monkeypatch.context() as mp:
            plant_no_residual(mp)
            sampled_law_broken(rt, ids, law, n=n)
        plant_wrong_q(monkeypatch, Eagle3Drafter)
        sampled_law_broken(rt, ids, law, n=n)


def test_refusals_are_one_line(setup, monkeypatch):
    """An mlx-lm model without a ``layers`` list is refused naming its model type; a draft made for another target
    (its layer ids beyond the target's depth) names both; ``draft="mtp"`` says mlx-lm drops the MTP weights."""
    from mlx_lm.models import llama

    from ondevice.drafters.eagle3 import Eagle3Drafter

    hf, target, draft, *_, base = setup
    with pytest.raises(OndeviceError, match=r"declares no MTP .* mlx-lm [\d.]+ drops MTP weights") as e:
        ondevice.load(target, draft="mtp", device="cpu")
    assert "\n" not in str(e.value) and "GGUF" in str(e.value)
    mtp = base / "mtp-config"  # the same model whose config declares an MTP layer (mlx-lm loads it without one)
    shutil.copytree(target, mtp)
    cfg = json.loads((mtp / "config.json").read_text())
    (mtp / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 1}))
    with pytest.raises(OndeviceError, match=r"declares 1 MTP \(nextn\) layers but mlx-lm [\d.]+ drops MTP weights"):
        ondevice.load(mtp, draft="mtp", device="cpu")
    far = _draft(base, hf, "far", layer_ids=[0, 2, 3])[1]
    b = _open(target)
    try:
        b.model.model.layers.pop()  # a 3-layer target: the draft reads layer 3
        with pytest.raises(OndeviceError, match=r"reads target layers \[0, 2, 3\], this target has 3") as e:
            Eagle3Drafter(b, far)
        assert "\n" not in str(e.value)
    finally:
        b.close()
    b = _open(target)
    try:
        monkeypatch.setattr(llama.Model, "layers", property(lambda self: None))  # a model without the list
        with pytest.raises(OndeviceError, match="mlx-lm's 'llama' model .* has no `layers` list") as e:
            Eagle3Drafter(b, draft)
        assert "\n" not in str(e.value)
    finally:
        monkeypatch.undo()
        b.close()
