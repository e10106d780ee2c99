"""DFlash block drafts on MLX targets: the draft GGUF run in MLX (``mlx_dflash.DFlashMLX``) against the numpy
reference of the converter's check (plain DFlash on the target's table and head, DFlash2's convolutions and selector
lattice, DSpark's chained Markov rows; a causal block sees no later row), greedy speculation equal to plain decoding, the sampled law
the target's (chi-square at T = 0.8 with planted-bug controls that must fail), and the one-line refusals (what the
MLX runner lacks; a draft made for another target).

Target: the tiny random-weight llama of tests/test_mlx_eagle3.py, converted to MLX (float16); drafts: random-weight
DFlash checkpoints (``ondevice.testing.dflash``) converted to f32 GGUFs against it (reference), or random DFlash GGUFs
whose vocabulary is a few tokens the target favours (``favourites``, with a logit preference), so drafts are both
kept and rejected. Everything runs on MLX's CPU device here."""

from __future__ import annotations

from contextlib import contextmanager
from types import SimpleNamespace

import numpy as np
import pytest
from helpers import (
    DRAFT_PROMPTS,
    LAW,
    LAW_PROMPT,
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

SHAPE = dict(n_layer=4, vocab_size=512)  # the target's, as ondevice.testing.mtp.MtpShape


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The tiny MLX target and its drafts: ``hf`` / ``target`` (HF and MLX dirs), ``law`` (its exact law after
    LAW_PROMPT) and ``ids``, ``base`` (a folder), ``draft(name, favoured_by, **variant)`` (a random DFlash GGUF whose
    vocabulary (d2t) is a few tokens the target favours, with a logit bias in order of preference, as in
    tests/test_dflash_drafter.py: favoured_by "greedy" prefers the tokens greedy answers repeat, "law" the tokens of
    the law's prompt), ``greedy`` / ``law_draft`` (plain DFlash drafts of each)."""
    from converters import convert
    from ondevice.testing import make_tiny_hf
    from ondevice.testing.dflash import make_tiny_dflash_gguf
    from ondevice.testing.mtp import MtpShape

    base = tmp_path_factory.mktemp("mlx-dflash")
    hf = make_tiny_hf(base / "hf", arch="llama", n_layers=4)
    convert(hf, to="mlx", out=base / "mlx", bits=16, progress=False)
    target = base / "mlx"
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
    by_seen, by_mass = sorted(seen, key=seen.get, reverse=True), sorted(mass, key=mass.get, reverse=True)
    favoured = {"greedy": by_seen[:8] + by_mass[:6], "law": by_mass[:8] + by_seen[:4]}

    def draft(name, favoured_by, **variant):
        return make_tiny_dflash_gguf(base / name, target=MtpShape(**SHAPE), target_layers=(0, 2), block_size=5,
                                     favourites=list(dict.fromkeys(favoured[favoured_by])), preference=6.0, seed=1,
                                     **variant)

    return SimpleNamespace(hf=hf, target=target, law=law, ids=ids, base=base, draft=draft,
                           greedy=draft("greedy.gguf", "greedy"), law_draft=draft("law.gguf", "law"))


def _open(path):
    from ondevice.backends.mlx import MLXBackend

    return MLXBackend(path, n_ctx=256, device="cpu")


CASES = {"dflash-target-head": dict(own_head=False), "dflash2": dict(variant="dflash2"),
         "dspark": dict(variant="dspark"), "dspark-bonus-anchor": dict(variant="dspark", sample_from_anchor=False)}


@pytest.mark.parametrize("case", list(CASES))
def test_the_mlx_runner_matches_the_numpy_reference(setup, case):
    """``DFlashMLX``'s block rows against ``converters.dflash_check`` (the numpy forward of the checkpoint the GGUF
    was converted from) on the same random features, injected in two ``observe`` calls (the second at a rolled-back
    position): relative logit error ≤ 1e-4 (f32 weights; measured 1e-6 order), DFlash2's selector lattice and DSpark's
    chained Markov rows likewise; the block leaves the cache as it was. Cases: the target's (MLX, tied) token table
    and LM head; DFlash2; DSpark anchor-first; DSpark with a bonus anchor."""
    from converters.dflash import convert_dflash, open_dflash
    from converters.dflash_check import forward, lattice_error, markov_rows
    from ondevice.backends.mlx_dflash import DFlashMLX
    from ondevice.testing.dflash import make_tiny_dflash_hf

    hf, target, base = setup.hf, setup.target, setup.base
    kw = {"own_head": True, **CASES[case]}
    src = make_tiny_dflash_hf(base / f"{case}-src", layer_ids=(0, 2), n_layer=2, seed=3, block_size=5, **kw)
    convert_dflash(src, target=hf, out=base / case, dtype="f32", verify=False)
    gguf = base / case / "model.gguf"
    s = open_dflash(src)
    b = _open(target)
    try:
        g = DFlashMLX(gguf, b, lambda ids: b.enable_layer_inputs(ids), n_ctx=64)
        assert g.layers == [1, 3] and g.variant == kw.get("variant", "dflash") and not g._causal
        table = np.array(b.model.model.embed_tokens(mx.arange(512)).astype(mx.float32))
        embed = s.float32("embed_tokens.weight") if kw["own_head"] else table
        head = s.float32("lm_head.weight") if kw["own_head"] else table
        rng = np.random.default_rng(0)
        feats = rng.normal(size=(9, 2 * 256)).astype(np.float32)
        g.observe(rng.normal(size=(7, 2 * 256)).astype(np.float32), 0)  # rows 5.. replaced next
        g.observe(feats[:5], 0)
        g.observe(feats[5:], 5)
        assert g.n_past == 9
        token, k, first = 17, 4, int(g.max_draft < g.block_size)
        got = g.draft(token, k)
        assert g.n_past == 9
        logits, hidden = forward(s, feats, [token] + [g.mask_id] * (k - 1 + first), embed, head)
        ref = logits[first:]
        if kw.get("variant") == "dspark":
            ref = markov_rows(s, ref, token, got)
        err = float(np.abs(got - ref).max() / np.abs(ref).max())
        if kw.get("variant") == "dflash2":
            err = max(err, lattice_error(s, g.lattice, ref, hidden[first:], token))
        print(f"{case}: relative error {err:.2e}")
        assert err <= 1e-4, err
        np.testing.assert_array_equal(g.draft(token, k), got)  # the block left nothing behind
        with pytest.raises(OndeviceError, match=f"drafts 1..{g.max_draft} tokens"):
            g.draft(token, g.max_draft + 1)
        g.rollback(4)  # fewer features: another block
        assert g.n_past == 4 and np.abs(g.draft(token, k) - got).max() > 1e-2
        g.close()
    finally:
        b.close()


def test_a_causal_block_sees_no_later_row(setup, tmp_path):
    """``dflash.attention.causal`` (a draft trained causal, which the numpy reference does not model): each row is
    the same whatever follows it in the block (a 2-row block = the first rows of a 4-row one, to rounding), while a
    bidirectional block's first rows change with the rows after them."""
    import json

    from converters.dflash import convert_dflash
    from ondevice.backends.mlx_dflash import DFlashMLX
    from ondevice.testing.dflash import make_tiny_dflash_hf

    hf, target = setup.hf, setup.target
    b = _open(target)
    try:
        feats = np.random.default_rng(1).normal(size=(6, 2 * 256)).astype(np.float32)
        for causal in (True, False):
            src = make_tiny_dflash_hf(tmp_path / f"src{causal}", layer_ids=(0, 2), own_head=True, seed=5, block_size=5)
            cfg = json.loads((src / "config.json").read_text())
            (src / "config.json").write_text(json.dumps({**cfg, "is_causal": causal}))
            convert_dflash(src, target=hf, out=tmp_path / f"c{causal}", dtype="f32", verify=False)
            g = DFlashMLX(tmp_path / f"c{causal}" / "model.gguf", b, lambda ids: b.enable_layer_inputs(ids))
            assert g._causal == causal
            g.observe(feats, 0)
            short, full = g.draft(9, 2), g.draft(9, 4)
            gap = float(np.abs(short - full[:2]).max() / np.abs(full).max())
            assert gap < 1e-5 if causal else gap > 1e-3, (causal, gap)
            g.close()
    finally:
        b.close()


VARIANTS = {"dflash": {}, "dflash2": dict(variant="dflash2", selector_gain=1.0, repeat=4.0),
            "dspark": dict(variant="dspark", markov_gain=1.0, repeat=4.0)}  # rows depend on the token before


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_speculation_equals_plain(setup, variant):
    """``draft=x.gguf`` (arch dflash) on an MLX target drafts in MLX; greedy speculation emits plain decoding's tokens
    at γ 1, 4 and 7 (beyond the block's cap: 4, DSpark anchor-first 5), with drafts both accepted and rejected;
    DFlash2 / DSpark drafts whose selector / Markov head favour repeating the previous token (as
    tests/test_dflash_variants.py's) go through the same drafter; DSpark's rows (a reduced draft vocabulary: d2t)
    are the unbiased rows plus ``MarkovHead.bias`` chained on each row's argmax."""
    from ondevice.backends.mlx_dflash import DFlashMLX

    draft = setup.greedy if variant == "dflash" else setup.draft(f"greedy-{variant}.gguf", "greedy", **VARIANTS[variant])
    with ondevice.load(setup.target, draft=str(draft), device="cpu") as spec, \
            ondevice.load(setup.target, drafter="none", device="cpu") as plain:
        assert spec.drafter.name == "dflash" and isinstance(spec.drafter.graph, DFlashMLX)
        assert spec.drafter.graph.variant == variant
        cap = spec.drafter.graph.max_draft
        assert cap == (5 if variant == "dspark" else 4)
        drafted, accepted = greedy_equal(spec, plain, DRAFT_PROMPTS[:2], (1, 4, 7), max_tokens=24, cap=cap)
        assert 0 < accepted < drafted, (accepted, drafted)
        if variant == "dspark":  # the chain in MLX through d2t = MarkovHead's numpy bias of each row's argmax before
            g = spec.drafter.graph
            base, _ = g.forward([7] + [g.mask_id] * 3)
            rows, prev = g.draft(7, 4), 7
            for j in range(4):
                want = base[j] + g.markov.bias(prev)
                np.testing.assert_allclose(rows[j], want, rtol=1e-5, atol=1e-5 * np.abs(want[np.isfinite(want)]).max())
                prev = int(np.argmax(rows[j]))


def test_sampled_law_is_the_targets(setup, monkeypatch):
    """Joint law of 3 tokens at T = 0.8, top-k 6 (γ = 3, one block; q = each row's processed distribution) against
    the exact target law; two planted controls must fail the same test: a residual that does not subtract q, and q
    rows replaced by a uniform law over their support."""
    from ondevice.drafters.dflash import DFlashDrafter

    law, ids = setup.law, setup.ids
    with ondevice.load(setup.target, draft=str(setup.law_draft), device="cpu") as rt:
        sampled_law_kept(rt, ids, law, n=1500)  # both outcomes occur, so the controls can fail
        # the controls fail by far at fewer samples (measured p ~ 1e-29 at 400; the bound is 1e-4): less CI time
        with monkeypatch.context() as mp:
            plant_no_residual(mp)
            sampled_law_broken(rt, ids, law, n=400)
        plant_wrong_q(monkeypatch, DFlashDrafter)
        sampled_law_broken(rt, ids, law, n=400)


def test_refusals_are_one_line(setup, tmp_path, monkeypatch):
    """What llama.cpp's graph has and the MLX runner lacks is refused naming it (a sliding window, an attention-sink
    tensor); a draft made for another target names both shapes."""
    import ondevice.testing.dflash as TD
    from ondevice.testing.mtp import MtpShape

    target = setup.target
    real = TD.gguf_writer

    def planted(extra_key=None, extra_tensor=None):
        @contextmanager
        def writer(out, arch, tensors):
            with real(out, arch, {**tensors, **(extra_tensor or {})}) as w:
                if extra_key:
                    w.add_uint32(*extra_key)
                yield w
        return writer

    cases = [(dict(extra_key=("dflash.attention.sliding_window", 8)), r"sliding-window attention \(dflash.attention"
              r".sliding_window = 8\) is not implemented by the MLX DFlash runner"),
             (dict(extra_tensor={"blk.0.attn_sinks.weight": np.zeros(4, np.float32)}),
              r"tensor blk.0.attn_sinks.weight \(attn_sinks.weight\) is not implemented by the MLX DFlash runner")]
    for i, (plant, msg) in enumerate(cases):
        with monkeypatch.context() as mp:
            mp.setattr(TD, "gguf_writer", planted(**plant))
            path = TD.make_tiny_dflash_gguf(tmp_path / f"r{i}.gguf", target=MtpShape(**SHAPE), target_layers=(0, 2))
        with pytest.raises(OndeviceError, match=msg) as e:
            ondevice.load(target, draft=str(path), device="cpu")
        assert "\n" not in str(e.value) and "llama.cpp (GGUF) target" in str(e.value)
    other = TD.make_tiny_dflash_gguf(tmp_path / "other.gguf", target=MtpShape(n_layer=4, vocab_size=768),
                                     target_layers=(1, 2))
    with pytest.raises(OndeviceError, match=r"made for another target .*vocabulary 768.* 512 tokens") as e:
        ondevice.load(target, draft=str(other), device="cpu")
    assert "\n" not in str(e.value)
