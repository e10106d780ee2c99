"""``ondevice convert DFLASH_DIR --to gguf --target TARGET --out DIR``: a DFlash checkpoint in the HF layout
(ondevice.testing.dflash.make_tiny_dflash_hf) becomes a GGUF of arch dflash, verified against a numpy forward of
the checkpoint (llama.cpp's block logits), refused in one line (nothing written) when made for another target,
and drafts through ``ondevice generate --draft DIR/model.gguf``."""

from __future__ import annotations

import pytest
from helpers import convert_then_generate, tiny_gguf_target

from ondevice.errors import OndeviceError


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """(HF checkpoint, its f16 GGUF) of a tiny qwen3 target."""
    base = tmp_path_factory.mktemp("dfc")
    gguf = tiny_gguf_target(base, "qwen3")
    return base / "hf", gguf


@pytest.mark.parametrize("own_head", [False, True])
def test_converts_and_verifies_against_the_checkpoint(target, tmp_path, own_head):
    """Both published shapes (sharing the target's embeddings / LM head, or with their own) convert and verify
    within tolerance (f32: the draft's own head ≤ 1e-4); the GGUF names the layers whose inputs it reads."""
    from converters import convert
    from ondevice.drafters.dflash import is_dflash_gguf
    from ondevice.testing.dflash import make_tiny_dflash_hf

    src = make_tiny_dflash_hf(tmp_path / "src", layer_ids=(0, 2), n_layer=2, own_head=own_head, seed=3)
    for dt in ("f32", "f16"):
        r = convert(src, to="gguf", target=target[1], out=tmp_path / dt, quant=dt, progress=False)
        assert r["arch"] == "dflash" and r["target_layers"] == [1, 3] and r["verify"]["ok"]
        assert r["verify"]["argmax_agree"] == 1.0
        assert is_dflash_gguf(str(tmp_path / dt / "model.gguf"))
    assert r["verify"]["logit_rel"] < 1e-2
    if own_head:
        f32 = convert(src, to="gguf", target=target[1], out=tmp_path / "again", quant="f32", progress=False)
        assert f32["verify"]["logit_rel"] < 1e-4


def test_the_check_fails_a_wrong_conversion(target, tmp_path, monkeypatch):
    """The verification can fail: a converter that writes k_proj where q_proj belongs is refused, nothing left."""
    import converters.dflash as D
    from converters import convert
    from ondevice.testing.dflash import make_tiny_dflash_hf

    src = make_tiny_dflash_hf(tmp_path / "src", own_head=True, seed=4, n_kv_head=4)
    monkeypatch.setitem(D.LAYER, "self_attn.q_proj.weight", "attn_k.weight")
    monkeypatch.setitem(D.LAYER, "self_attn.k_proj.weight", "attn_q.weight")
    with pytest.raises(OndeviceError, match="differ from the source's"):
        convert(src, to="gguf", target=target[1], out=tmp_path / "bad", quant="f32", progress=False)
    assert not (tmp_path / "bad").exists()


def test_a_draft_for_another_target_is_refused_unwritten(target, tmp_path):
    from converters import convert
    from ondevice.testing.dflash import make_tiny_dflash_hf

    cases = [(dict(vocab_size=768), "vocabulary of 768"), (dict(layer_ids=(0, 3)), "reads target layers"),
             (dict(hidden=128, n_head=2, n_kv_head=1), "hidden size 128")]
    for i, (kw, msg) in enumerate(cases):
        src = make_tiny_dflash_hf(tmp_path / f"s{i}", **kw)
        with pytest.raises(OndeviceError, match=msg) as e:
            convert(src, to="gguf", target=target[0], out=tmp_path / f"o{i}", progress=False)
        assert "\n" not in str(e.value) and not (tmp_path / f"o{i}").exists()
    pick = make_tiny_dflash_hf(tmp_path / "pickle")
    (pick / "model.safetensors").rename(pick / "pytorch_model.bin")  # never opened: refused by its name
    with pytest.raises(OndeviceError, match="pickle checkpoint, refused"):
        convert(pick, to="gguf", target=target[0], out=tmp_path / "p", progress=False)


def test_the_two_commands(target, tmp_path):
    """``ondevice convert DFLASH_DIR --to gguf --target TARGET --out DIR`` then ``ondevice generate TARGET --draft
    DIR/model.gguf --gamma 3 --temperature 0 --json`` drafts with it (stats.drafted > 0)."""
    from ondevice.testing.dflash import make_tiny_dflash_hf

    convert_then_generate(make_tiny_dflash_hf(tmp_path / "src", seed=5), target[1], tmp_path, "dflash")
