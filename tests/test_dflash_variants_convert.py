"""``ondevice convert DIR --to gguf --target T --out DIR`` for DFlash2 (DFlash2DraftModel: block convolutions +
candidate selector) and DSpark (Qwen3DSparkModel: Markov head + confidence head) checkpoints in the HF layout
(``ondevice.testing.dflash.make_tiny_dflash_hf``): written as GGUF arch dflash with llama.cpp's extra tensors and
keys, verified against a numpy forward of the checkpoint (llama.cpp's block logits, DFlash2's selector lattice,
DSpark's Markov-biased rows and confidences; f32 with the draft's own head ≤ 1e-4 relative, f16 ≤ 1e-2), refused in one line
with nothing written when wrong or unsupported (the other DSpark families by architecture)."""

from __future__ import annotations

import json

import pytest

from ondevice.errors import OndeviceError


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from converters import convert
    from ondevice.testing import make_tiny_hf

    base = tmp_path_factory.mktemp("dfvc")
    hf = make_tiny_hf(base / "hf", arch="qwen3", n_layers=4)
    convert(hf, to="gguf", quant="f16", out=base / "gguf", progress=False)
    return hf, base / "gguf" / "model.gguf"


@pytest.mark.parametrize("variant,extra", [("dflash2", {}), ("dspark", {}), ("dspark", {"sample_from_anchor": False})])
def test_converts_and_verifies_against_the_checkpoint(target, tmp_path, variant, extra):
    """Own head f32 within 1e-4 and the target's shared head f16 within 1e-2 of the numpy forward; the GGUF carries
    the variant's keys and tensors (DFlash2: conv + selector; DSpark: Markov + confidence heads, anchor flag)."""
    from converters import convert
    from ondevice.formats.gguf import GGUFFile
    from ondevice.testing.dflash import make_tiny_dflash_hf

    for own, dt, tol in ((True, "f32", 1e-4), (False, "f16", 1e-2)):
        src = make_tiny_dflash_hf(tmp_path / f"src{own}", layer_ids=(0, 2), n_layer=2, own_head=own, seed=3,
                                  variant=variant, **extra)
        r = convert(src, to="gguf", target=target[1], out=tmp_path / f"o{own}", quant=dt, progress=False)
        assert r["arch"] == "dflash" and r["variant"] == variant and r["target_layers"] == [1, 3]
        assert r["verify"]["ok"] and r["verify"]["logit_rel"] <= tol and r["verify"]["argmax_agree"] == 1.0, r
        g = GGUFFile(tmp_path / f"o{own}" / "model.gguf")
        names = {t.name for t in g.reader.tensors}
        keys = {f.name: f for f in g.reader.fields.values()}
        if variant == "dflash2":
            assert {"selector_predecessor.weight", "selector_successor.weight", "selector_hidden.weight",
                    "blk.1.attn_conv_base", "blk.1.ffn_conv_proj.weight"} <= names
            assert {"dflash.conv_kernel_size", "dflash.conv_group_size", "dflash.selector_rank",
                    "dflash.selector_top_k"} <= set(keys)
        else:
            assert {"markov_w1.weight", "markov_w2.weight", "conf_proj.weight", "conf_proj.bias"} <= names
            anchor = keys["dflash.sample_from_anchor"]
            assert bool(anchor.parts[anchor.data[0]][0]) == extra.get("sample_from_anchor", True)


@pytest.mark.parametrize("variant,swap", [
    ("dspark", ("markov_head.markov_w1.weight", "markov_head.markov_w2.weight")),
    ("dflash2", ("attention_conv.base_kernel", "mlp_conv.base_kernel")),
    ("dflash2", ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")),
    ("dspark", ("confidence_head.proj.bias", None))])
def test_the_check_fails_a_wrong_conversion(target, tmp_path, monkeypatch, variant, swap):
    """A converter writing the Markov head's two matrices, the attention and MLP convolutions, or the selector's two
    codebooks swapped, or dropping the confidence head's bias, is refused by the numpy check, nothing left."""
    import converters.dflash_source as S
    from converters import convert
    from ondevice.testing.dflash import make_tiny_dflash_hf

    src = make_tiny_dflash_hf(tmp_path / "src", own_head=True, seed=4, variant=variant)
    table = S.CONV if swap[0] in S.CONV else S.TOP
    if swap[1] is None:
        monkeypatch.delitem(table, swap[0])
    else:
        a, b = table[swap[0]], table[swap[1]]
        monkeypatch.setitem(table, swap[0], b)
        monkeypatch.setitem(table, swap[1], a)
    with pytest.raises(OndeviceError, match="differ from the source's"):
        convert(src, to="gguf", target=target[1], out=tmp_path / "bad", quant="f32", progress=False)
    assert not (tmp_path / "bad").exists()


def _edit(path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_refusals_are_one_line_and_write_nothing(target, tmp_path):
    """The other DSpark families by architecture, an EAGLE-3-style export, a gated Markov head, a reduced draft
    vocabulary and DFlash2 shapes llama.cpp cannot run: each one line, nothing written."""
    from converters import convert
    from ondevice.testing.dflash import make_tiny_dflash_hf

    cases = [("dspark", {"architectures": ["DeepseekV4DSparkModel"]}, "DeepseekV4DSparkModel .DeepSeek-V4"),
             ("dspark", {"architectures": ["Gemma4DSparkModel"]}, "Gemma4DSparkModel .Gemma4"),
             ("dspark", {"architectures": ["Lfm2DSparkDraftModel"]}, "Lfm2DSparkDraftModel .LFM2"),
             ("dspark", {"architectures": ["LingDSparkModel"]}, "LingDSparkModel .Ling"),
             ("dspark", {"transformer_layer_config": {}}, "EAGLE-3-style"),
             ("dspark", {"markov_head_type": "gated"}, "markov_head_type 'gated'"),
             ("dspark", {"draft_vocab_size": 256}, "draft_vocab_size 256"),
             ("dflash2", {"dflash_config": {"target_layer_ids": [0, 2], "mask_token_id": 511, "conv_kernel_size": 3,
                                            "conv_group_size": 48, "selector_rank": 16, "selector_top_k": 4}},
              "divisible by conv_group_size 48")]
    for i, (variant, changes, msg) in enumerate(cases):
        src = make_tiny_dflash_hf(tmp_path / f"s{i}", variant=variant)
        _edit(src, **changes)
        with pytest.raises(OndeviceError, match=msg) as e:
            convert(src, to="gguf", target=target[1], out=tmp_path / f"o{i}", progress=False)
        assert "\n" not in str(e.value) and not (tmp_path / f"o{i}").exists()


def test_the_two_commands(target, tmp_path):
    """``ondevice convert DSPARK_DIR --to gguf --target T --out DIR`` then ``ondevice generate T --draft
    DIR/model.gguf --temperature 0`` drafts with it (stats.drafted > 0); without --target it is refused."""
    from helpers import convert_then_generate

    from ondevice.testing.dflash import make_tiny_dflash_hf

    convert_then_generate(make_tiny_dflash_hf(tmp_path / "src", seed=5, variant="dspark"), target[1], tmp_path, "dflash")
