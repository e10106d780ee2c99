"""EAGLE-3 drafts: conversion of both published layouts to GGUF eagle3 (llama.cpp's graph against a numpy forward
of the source weights), refusals of drafts made for another target, and the target's layer features."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from ondevice.errors import OndeviceError


def _target(tmp_path_factory, arch):
    from converters import convert
    from ondevice.testing import make_tiny_hf

    base = tmp_path_factory.mktemp(f"eagle3-{arch}")
    hf = make_tiny_hf(base / "hf", arch=arch, n_layers=4)
    convert(hf, to="gguf", quant="f16", out=base / "gguf", progress=False)
    return hf, base / "gguf" / "model.gguf"


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A 4-layer tiny llama target (hidden 256, vocabulary 512) as an f16 GGUF; returns (HF dir, GGUF)."""
    return _target(tmp_path_factory, "llama")


def _draft(tmp_path, name="draft", **kw):
    from ondevice.testing.eagle3 import make_tiny_eagle3

    return make_tiny_eagle3(tmp_path / name, **kw)


CASES = {
    "specforge-own-f32": dict(layout="specforge", dtype="f32", own_embeddings=True, layer_ids=[1, 2, 3]),
    "specforge-shared-f16": dict(layout="specforge", dtype="f16", own_embeddings=False),
    "specforge-bf16-source-f16": dict(layout="specforge", dtype="f16", src_dtype="bfloat16", own_embeddings=True),
    "specforge-no-d2t-f32": dict(layout="specforge", dtype="f32", with_d2t=False, own_embeddings=False),
    "speculators-own-f16": dict(layout="speculators", dtype="f16", own_embeddings=True),
    "speculators-shared-f32-fcnorm-llama3": dict(
        layout="speculators", dtype="f32", own_embeddings=False, norm_before_fc=True, norm_before_residual=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_convert_and_logits_match_source(target, tmp_path, case):
    """Both layouts, own / target embeddings, f32 / f16: llama.cpp's eagle3 graph on the written GGUF gives the
    numpy forward's logits on the source weights (same target features and tokens)."""
    from converters.eagle3 import convert_eagle3
    from converters.eagle3_check import TOLERANCE

    kw = dict(CASES[case])
    dtype = kw.pop("dtype")
    src_dtype = kw.pop("src_dtype", "float32" if dtype == "f32" else "float16")
    src = _draft(tmp_path, **kw, dtype=src_dtype)
    s = convert_eagle3(src, target=target[1], out=tmp_path / "out", dtype=dtype)
    v = s["verify"]
    assert v["ok"] and v["inf_pattern_ok"] and v["argmax_agree"] == 1.0
    assert v["logit_rel"] <= TOLERANCE[dtype]
    if dtype == "f32":
        assert v["logit_rel"] < 1e-5, v  # f32 weights, f32 KV cache: only summation order differs
    assert s["layout"] == kw["layout"] and s["own_embeddings"] == kw["own_embeddings"]
    assert s["target_layers"] == (kw.get("layer_ids") or [2, 2, 1])
    assert (tmp_path / "out" / "model.gguf").is_file() and (tmp_path / "out" / "manifest.json").is_file()
    from ondevice.formats.gguf import GGUFFile

    g = GGUFFile(tmp_path / "out" / "model.gguf")
    names = {t.name for t in g.reader.tensors}
    assert g.arch == "eagle3" and list(g.get("eagle3.target_layers")) == s["target_layers"]
    assert ("d2t" in names) == kw.get("with_d2t", True) and ("token_embd.weight" in names) == kw["own_embeddings"]
    if src_dtype == "bfloat16":
        from converters.eagle3 import open_eagle3

        assert open_eagle3(src).tensors.index["fc.weight"][1] == "BF16"


@pytest.mark.parametrize("bug", ["no_rope_permutation", "residual_flag_flipped", "d2t_as_offsets"])
def test_check_catches_a_wrong_conversion(target, tmp_path, monkeypatch, bug):
    """Negative control: a converter that forgets llama.cpp's Q/K row order, writes norm_before_residual wrong
    or d2t as the checkpoint's offsets is caught by the logits comparison and leaves no output directory."""
    import gguf

    import converters.eagle3 as conv

    if bug == "no_rope_permutation":
        monkeypatch.setattr(conv, "_permute", lambda t, n_head: t)
    elif bug == "residual_flag_flipped":
        add_bool = gguf.GGUFWriter.add_bool
        monkeypatch.setattr(gguf.GGUFWriter, "add_bool",
                            lambda w, key, v: add_bool(w, key, (not v) if key.endswith("norm_before_residual") else v))
    else:
        tensors = conv.gguf_tensors
        monkeypatch.setattr(conv, "gguf_tensors", lambda src: (
            (n, t - np.arange(t.size) if n == "d2t" else t) for n, t in tensors(src)))
    src = _draft(tmp_path, layout="specforge", dtype="float32")
    with pytest.raises(OndeviceError, match="logits differ"):
        conv.convert_eagle3(src, target=target[1], out=tmp_path / "out", dtype="f32")
    assert not (tmp_path / "out").exists()


def test_hf_target_converts_and_verifies_with_own_embeddings(target, tmp_path):
    from converters.eagle3 import convert_eagle3

    s = convert_eagle3(_draft(tmp_path, layout="specforge"), target=target[0], out=tmp_path / "out")
    assert s["verify"]["ok"]
    s = convert_eagle3(_draft(tmp_path, "d2", own_embeddings=False), target=target[0], out=tmp_path / "out2")
    assert "skipped" in s["verify"]  # the target's table is needed, and an HF target has no GGUF to run


@pytest.mark.parametrize("what,kw,match", [
    ("hidden", dict(target_hidden=128), "hidden size 128"),
    ("vocab", dict(vocab_size=1024), "vocabulary of 1024"),
    ("layers", dict(layer_ids=[1, 2, 7]), r"layers \[1, 2, 7\]"),
    ("shared-embeddings-width", dict(hidden=128, own_embeddings=False), "cannot embed with the target"),
])
def test_refuses_a_draft_for_another_target(target, tmp_path, what, kw, match):
    from converters.eagle3 import convert_eagle3

    src = _draft(tmp_path, **kw)
    with pytest.raises(OndeviceError, match=match) as e:
        convert_eagle3(src, target=target[1], out=tmp_path / "out")
    assert "\n" not in str(e.value)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))


def test_refuses_pickle_unread(target, tmp_path):
    """A pytorch_model.bin is refused with how to convert it, and never unpickled (its payload would run)."""
    from converters.eagle3 import convert_eagle3

    src = _draft(tmp_path)
    (src / "model.safetensors").unlink()
    marker = tmp_path / "unpickled"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    (src / "pytorch_model.bin").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(OndeviceError, match=r"pytorch_model.bin: a PyTorch pickle checkpoint, refused.*safetensors"):
        convert_eagle3(src, target=target[1], out=tmp_path / "out")
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_refuses_damaged_d2t(target, tmp_path):
    from safetensors.numpy import load_file, save_file

    from converters.eagle3 import convert_eagle3

    src = _draft(tmp_path)
    t = load_file(str(src / "model.safetensors"))
    t["d2t"] = np.zeros_like(t["d2t"])  # offsets 0: fine; now make two rows land on one target id
    t["d2t"][1] = -1
    save_file(t, str(src / "model.safetensors"))
    with pytest.raises(OndeviceError, match="same target token"):
        convert_eagle3(src, target=target[1], out=tmp_path / "out")


def test_convert_entry_point(target, tmp_path):
    """``ondevice convert EAGLE_DIR --to gguf --target TARGET --out DIR`` goes through converters.convert."""
    from converters import convert

    src = _draft(tmp_path)
    with pytest.raises(OndeviceError, match="--to gguf --target TARGET"):
        convert(src, to="gguf", out=tmp_path / "a", progress=False)
    with pytest.raises(OndeviceError, match="--target is for EAGLE-3 / DFlash drafts"):
        convert(target[0], to="gguf", out=tmp_path / "b", target=target[1], progress=False)
    s = convert(src, to="gguf", out=tmp_path / "c", target=target[1].parent, progress=False)
    assert s["arch"] == "eagle3" and s["dtype"] == "f16" and s["verify"]["ok"]
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    s = convert(src, to="gguf", out=tmp_path / "d", target=target[1].parent, quant="q8_0", progress=False)
    assert s["dtype"] == "q8_0" and s["verify"]["ok"] and s["verify"]["f16"]["ok"]
    for q in ("iq4_nl", "q4_k_m"):  # a model's quantization, not a draft's: refused (was: f16, silently)
        with pytest.raises(OndeviceError, match=rf"^--quant {q}: an EAGLE-3 draft is written as f32 \| f16 \| q8_0 \| q4_0"):
            convert(src, to="gguf", out=tmp_path / q, target=target[1].parent, quant=q, progress=False)
        assert not (tmp_path / q).exists()


def test_an_empty_quant_is_refused_not_read_as_the_default(target, tmp_path):
    """``--quant ""`` (an unset shell variable) is no quantization: refused, for a model and for a draft (was: the
    default, silently: q4_k_m for a model, f16 for a draft); only None (no --quant) means the default."""
    from converters import convert

    with pytest.raises(OndeviceError, match=r"^--quant : unknown"):
        convert(target[0], to="gguf", out=tmp_path / "m", quant="", progress=False)
    with pytest.raises(OndeviceError, match=r"^--quant : an EAGLE-3 draft is written as"):
        convert(_draft(tmp_path), to="gguf", out=tmp_path / "d", target=target[1], quant="", progress=False)
    assert not (tmp_path / "m").exists() and not (tmp_path / "d").exists()


@pytest.mark.parametrize("dtype", ["q8_0", "q4_0"])
def test_quantized_draft(target, tmp_path, dtype):
    """A quantized draft: the f16 file is verified to f16's tolerance first, then llama.cpp's quantizer writes the
    matrices as ``dtype`` (smaller file) and the quantized graph is checked to its own looser bound."""
    import gguf

    from converters.eagle3 import convert_eagle3
    from converters.eagle3_check import TOLERANCE

    src = _draft(tmp_path, layout="specforge", own_embeddings=False)
    f16 = convert_eagle3(src, target=target[1], out=tmp_path / "f16")
    s = convert_eagle3(src, target=target[1], out=tmp_path / "q", dtype=dtype)
    v = s["verify"]
    assert v["ok"] and 0 < v["logit_rel"] <= TOLERANCE[dtype] and v["f16"]["logit_rel"] <= TOLERANCE["f16"]
    assert v["logit_rel"] > 10 * v["f16"]["logit_rel"]  # the quantized graph is what was checked
    assert s["dtype"] == dtype and s["size_bytes"] < 0.6 * f16["size_bytes"]
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(tmp_path / "q" / "model.gguf")).tensors}
    assert types["blk.0.ffn_up.weight"] == dtype.upper() and types["d2t"] == "I64" and s["fallbacks"] == {}
    assert sorted(p.name for p in (tmp_path / "q").iterdir()) == ["manifest.json", "model.gguf"]


def test_quantized_draft_catches_a_wrong_conversion_before_quantizing(target, tmp_path, monkeypatch):
    """Quantization's own error is far above f16's: a layout bug is caught on the f16 file, to f16's tolerance."""
    import converters.eagle3 as conv

    monkeypatch.setattr(conv, "_permute", lambda t, n_head: t)
    with pytest.raises(OndeviceError, match=r"model\.f16\.gguf: llama\.cpp's logits differ"):
        conv.convert_eagle3(_draft(tmp_path, layout="specforge"), target=target[1], out=tmp_path / "out", dtype="q8_0")
    assert not (tmp_path / "out").exists()
    with pytest.raises(OndeviceError, match="choose one of f32, f16, q8_0, q4_0"):
        conv.convert_eagle3(_draft(tmp_path, "d2"), target=target[1], out=tmp_path / "out", dtype="q4_k")


def test_a_matrix_llama_cpp_cannot_quantize_is_reported(target, tmp_path):
    """Rows not a multiple of the 32-wide q4_0 block: llama.cpp quietly keeps that matrix f16; the summary says so."""
    from converters.eagle3 import convert_eagle3

    src = _draft(tmp_path, own_embeddings=False, intermediate=520)  # ffn_down's rows: 520 wide
    s = convert_eagle3(src, target=target[1], out=tmp_path / "q", dtype="q4_0")
    assert s["verify"]["ok"] and s["fallbacks"] == {"blk.0.ffn_down.weight": "F16"}


def test_a_quantized_draft_past_its_bound_names_the_wider_types(target, tmp_path, monkeypatch):
    """A trained draft whose q4_0 error exceeds the bound: the refusal says which dtype to ask for instead."""
    import converters.eagle3_check as check
    from converters.eagle3 import convert_eagle3

    monkeypatch.setitem(check.TOLERANCE, "q4_0", 1e-3)
    with pytest.raises(OndeviceError, match=r"^model\.gguf: .*q4_0 allows.*convert it q8_0 or f16 \(train-heads "
                                            r"--draft-dtype, convert --quant\)$"):
        convert_eagle3(_draft(tmp_path, own_embeddings=False), target=target[1], out=tmp_path / "q", dtype="q4_0")
    assert not (tmp_path / "q").exists()
