"""Converters: parity between independent implementations, quantization really applied, bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from helpers import mlx_float32, mlx_logits

from converters import convert
from ondevice.backends.llama import LlamaBackend
from ondevice.errors import OndeviceError

TEXT = "The model draft and the target verify 12345; def add(a, b): return a + b — café 東京"


def _tokens64(backend):
    ids = backend.tokenize(TEXT * 4)
    return ids[:64]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gguf_f16_matchesmlx_float32(tiny_hf, tiny_gguf, arch):
    """Our GGUF writer (run by llama.cpp) and mlx-lm (reading the HF checkpoint) agree."""
    b = LlamaBackend(tiny_gguf(arch, "f16"), n_ctx=256)
    ids = _tokens64(b)
    assert len(ids) == 64
    ref = b.eval(ids)
    b.close()
    model, tok = mlx_float32(tiny_hf[arch])
    assert tok.encode(TEXT * 4)[:64] == ids  # same tokenizer on both sides
    out = mlx_logits(model, ids)
    delta = float(np.abs(out - ref).max())
    print(f"{arch}: max |Δ| logits, GGUF f16 (llama.cpp) vs mlx-lm float32, 64 tokens: {delta:.4f}")
    assert delta < 0.05 * float(np.abs(ref).max())
    assert (out.argmax(1) == ref.argmax(1)).mean() >= 0.95


def test_q8_0_stays_close_to_float(tiny_gguf):
    f16 = LlamaBackend(tiny_gguf("qwen2", "f16"), n_ctx=256)
    ids = _tokens64(f16)
    ref = f16.eval(ids)
    f16.close()
    q8 = LlamaBackend(tiny_gguf("qwen2", "q8_0"), n_ctx=256)
    out = q8.eval(ids)
    q8.close()
    cos = (out * ref).sum(1) / np.linalg.norm(out, axis=1) / np.linalg.norm(ref, axis=1)
    assert cos.min() >= 0.99, cos.min()


def test_quantized_types_are_what_was_asked(tiny_hf, tmp_path):
    s = convert(tiny_hf["qwen2"], to="gguf", out=tmp_path / "q4km", quant="q4_k_m", progress=False)
    assert s["tensor_types"].get("Q4_K", 0) >= 10 and s["fallbacks"] == {}
    assert 4.0 < s["bits_per_weight"] < 6.5
    manifest = json.loads((tmp_path / "q4km" / "manifest.json").read_text())
    assert {"source", "source_sha256", "format", "quant", "arch", "vocab_sha256", "tensor_types"} <= set(manifest)
    assert "Q4_K" in manifest["tensor_types"].values()
    s = convert(tiny_hf["qwen2"], to="gguf", out=tmp_path / "q40", quant="q4_0", progress=False)
    assert s["tensor_types"].get("Q4_0", 0) >= 10 and s["fallbacks"] == {}
    m = convert(tiny_hf["qwen2"], to="mlx", out=tmp_path / "mlx", bits=4, group_size=64, progress=False)
    n_layers = 2
    assert m["unquantized_linear_layers"] == []
    assert m["quantized_layers"] == 7 * n_layers + 2  # every linear layer, the embedding and the untied head
    assert all(v == "affine4g64" for v in json.loads((tmp_path / "mlx" / "manifest.json").read_text())["tensor_types"].values())
    from mlx_lm import load

    load(str(tmp_path / "mlx"))  # loadable by mlx_lm.load


def test_gguf_to_mlx_is_lossless_for_q8_0_and_q4_0(tiny_gguf, tmp_path):
    import gguf
    import mlx.core as mx

    from ondevice.formats.gguf import unpermute_rows

    for quant in ("q8_0", "q4_0"):
        src = tiny_gguf("llama", quant)
        s = convert(src, to="mlx", out=tmp_path / quant, progress=False)
        other = sum(n for t, n in s["source_types"].items() if t not in ("Q4_0", "Q4_1", "Q8_0", "F32", "F16"))
        assert s["requantized_tensors"] == other and s["lossless_tensors"] >= 14  # q4_0 gives the tied embedding Q6_K
        # lossless: MLX's dequantized weights equal gguf's dequantization of the source, value for value
        conv = mx.load(str(tmp_path / quant / "model.safetensors"))
        reader = gguf.GGUFReader(str(src))
        for t in reader.tensors:
            if t.name not in ("blk.0.ffn_up.weight", "blk.1.attn_q.weight"):
                continue
            ref = gguf.dequantize(t.data, t.tensor_type).reshape([int(d) for d in reversed(t.shape)])
            if "attn_q" in t.name:
                ref = unpermute_rows(ref, 4)
            base = "model.layers.0.mlp.up_proj" if "ffn_up" in t.name else "model.layers.1.self_attn.q_proj"
            bits = 8 if quant == "q8_0" else 4
            got = mx.dequantize(conv[base + ".weight"], conv[base + ".scales"], conv[base + ".biases"], group_size=32, bits=bits)
            assert np.allclose(np.array(got.astype(mx.float32)), ref, atol=1e-3), (quant, t.name)
        if quant == "q8_0":
            b = LlamaBackend(src, n_ctx=256)
            ids = _tokens64(b)
            ref_logits = b.eval(ids)
            b.close()
            from mlx_lm import load

            model, tok = load(str(tmp_path / quant))
            assert tok.encode(TEXT * 4)[:64] == ids
            out = mlx_logits(model, ids)
            assert (out.argmax(1) == ref_logits.argmax(1)).mean() >= 0.9


def test_gguf_to_mlx_requantizes_k_quants(tiny_gguf, tmp_path):
    s = convert(tiny_gguf("qwen2", "q4_k_m"), to="mlx", out=tmp_path / "m", progress=False)
    assert s["requantized_tensors"] >= 10 and s["lossless_tensors"] == 0


def test_pair_conversion_and_check(tiny_hf, tmp_path):
    s = convert(tiny_hf["llama"], to="gguf", out=tmp_path / "pair", quant="q8_0", draft=tiny_hf["llama_draft"], progress=False)
    assert (tmp_path / "pair" / "target" / "model.gguf").is_file() and (tmp_path / "pair" / "draft" / "model.gguf").is_file()
    assert s["target"]["quant"] == s["draft"]["quant"] == "q8_0"
    r = _cli("check-pair", str(tmp_path / "pair" / "target"), str(tmp_path / "pair" / "draft"))
    assert r.returncode == 0 and "compatible" in r.stdout
    with pytest.raises(OndeviceError, match="vocab mismatch.*id \\d+"):
        convert(tiny_hf["llama"], to="gguf", out=tmp_path / "bad", draft=tiny_hf["qwen2"], progress=False)
    assert not (tmp_path / "bad").exists()


def _cli(*args):
    return subprocess.run([sys.executable, "-P", "-m", "ondevice", *args], capture_output=True, text=True, timeout=600)


def _one_line_error(r, needle):
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode != 0, r.stdout
    assert len(lines) == 1 and needle in lines[0], r.stderr
    assert "Traceback" not in r.stderr


def test_bad_input_is_one_line_and_leaves_nothing(tiny_hf, tiny_gguf, tmp_path):
    import shutil

    def clone(name):
        d = tmp_path / name
        shutil.copytree(tiny_hf["llama"], d)
        return d

    no_cfg = clone("nocfg")
    (no_cfg / "config.json").unlink()
    arch = clone("arch")
    cfg = json.loads((arch / "config.json").read_text())
    cfg["model_type"] = "mamba"
    (arch / "config.json").write_text(json.dumps(cfg))
    trunc = clone("trunc")
    st = trunc / "model.safetensors"
    st.write_bytes(st.read_bytes()[: st.stat().st_size // 2])
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 100)
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("keep me")
    afile = tmp_path / "afile"
    afile.write_text("a file, not a directory")
    cases = [
        (["convert", str(no_cfg), "--out", str(tmp_path / "o1")], "config.json", tmp_path / "o1"),
        (["convert", str(arch), "--out", str(tmp_path / "o2")], "unsupported architecture", tmp_path / "o2"),
        (["convert", str(trunc), "--out", str(tmp_path / "o3")], "model.safetensors", tmp_path / "o3"),
        (["convert", str(corrupt), "--to", "mlx", "--out", str(tmp_path / "o4")], "corrupt.gguf", tmp_path / "o4"),
        (["convert", str(tiny_hf["llama"]), "--draft", str(tiny_hf["qwen2"]), "--out", str(tmp_path / "o5")], "vocab mismatch", tmp_path / "o5"),
        (["convert", str(tiny_hf["llama"]), "--out", str(busy)], "not empty", None),
    ]
    cases.append((["convert", str(tiny_hf["llama"]), "--out", str(afile / "o6")], "cannot write", None))
    for args, needle, out in cases:
        _one_line_error(_cli(*args), needle)
        if out is not None:
            assert not out.exists(), args
    assert (busy / "x").read_text() == "keep me" and len(list(busy.iterdir())) == 1
    assert not list(tmp_path.glob(".*.partial"))


def test_interrupted_conversion_leaves_nothing(tiny_hf, tmp_path, monkeypatch):
    import converters.to_gguf as tg

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(tg, "llama_quantize", boom)
    with pytest.raises(KeyboardInterrupt):
        convert(tiny_hf["llama"], to="gguf", out=tmp_path / "x", quant="q4_0", progress=False)
    assert not (tmp_path / "x").exists() and not list(tmp_path.glob(".*"))


def test_block_conversion_matches_mx_load(tiny_gguf, smollm2):
    """Our numpy Q4_0/Q4_1/Q8_0 → MLX affine conversion gives the arrays mx.load gives, bit for bit."""
    import gguf
    import mlx.core as mx

    from converters.gguf_blocks import to_mlx_affine

    for path in (tiny_gguf("llama", "q4_0"), tiny_gguf("llama", "q8_0"), smollm2):
        loaded = mx.load(str(path))
        n = 0
        for t in gguf.GGUFReader(str(path)).tensors:
            if t.tensor_type.name not in ("Q4_0", "Q4_1", "Q8_0"):
                continue
            w, s, b = to_mlx_affine(t.data, t.tensor_type.name, int(t.shape[1]), int(t.shape[0]))
            stem = t.name[: -len(".weight")]
            assert np.array_equal(w, np.array(loaded[t.name]))
            assert np.array_equal(s, np.array(loaded[stem + ".scales"]).astype(np.float16))
            assert np.array_equal(b, np.array(loaded[stem + ".biases"]).astype(np.float16))
            n += 1
        assert n >= 14


def test_missing_tensor_and_corrupt_gguf_are_one_line_errors(tiny_hf, tiny_gguf, tmp_path):
    """Review: a checkpoint missing one tensor failed late (GGUF: "does not load in llama.cpp", MLX: a
    ValueError, Core ML: a KeyError); a truncated GGUF given to requantization or as a --draft was a bare
    ValueError. Each is now one line naming the file, exit code 2, nothing written."""
    import shutil

    from safetensors.numpy import load_file, save_file

    miss = tmp_path / "miss"
    shutil.copytree(tiny_hf["llama"], miss)
    w = load_file(str(miss / "model.safetensors"))
    del w["model.layers.1.mlp.down_proj.weight"]
    save_file(w, str(miss / "model.safetensors"), metadata={"format": "pt"})
    trunc = tmp_path / "trunc.gguf"
    trunc.write_bytes(tiny_gguf("llama", "q8_0").read_bytes()[:-100])
    cases = [
        (["convert", str(miss), "--to", "gguf", "--quant", "q8_0"], "model.layers.1.mlp.down_proj.weight"),
        (["convert", str(trunc), "--to", "gguf", "--quant", "q4_0", "--allow-requantize"], "trunc.gguf: corrupt GGUF"),
        (["convert", str(tiny_hf["llama"]), "--draft", str(trunc), "--quant", "q8_0"], "trunc.gguf: corrupt GGUF"),
    ]
    for i, (args, needle) in enumerate(cases):
        out = tmp_path / f"o{i}"
        r = _cli(*args, "--out", str(out))
        _one_line_error(r, needle)
        assert r.returncode == 2 and not out.exists(), args
    for to in ("mlx", "coreml"):  # the same refusal, before any backend is imported
        with pytest.raises(OndeviceError, match=r"miss/model.safetensors: 1 tensor\(s\) missing"):
            convert(miss, to=to, out=tmp_path / to, compress="none", progress=False)
    assert not list(tmp_path.glob(".*.partial"))


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_ctrl_c_swallowed_by_a_llama_cpp_callback_keeps_nothing(tiny_hf, tmp_path, monkeypatch):
    """Review: a Ctrl-C that lands while llama.cpp runs its Python log callback raises inside a ctypes
    callback, where Python prints "Exception ignored" and carries on; the conversion then finished, exit 0,
    output kept. Reproduced with a real ctypes callback sending SIGINT to this process."""
    import ctypes
    import os
    import signal

    import converters.to_gguf as tg

    swallowed = []

    @ctypes.CFUNCTYPE(None)
    def callback():
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(10_000):  # the handler runs here, inside the callback
            pass

    real = tg.llama_quantize

    def quantize(*a, **k):
        real(*a, **k)
        qsort = ctypes.CDLL(None).qsort  # any C function calling back into Python: qsort of 2 items
        cmp = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)(lambda x, y: callback() or 0)
        qsort((ctypes.c_int * 2)(1, 2), 2, ctypes.sizeof(ctypes.c_int), cmp)
        swallowed.append(True)  # reached: the KeyboardInterrupt did not propagate (the defect's premise)

    monkeypatch.setattr(tg, "llama_quantize", quantize)
    with pytest.raises(KeyboardInterrupt):
        convert(tiny_hf["llama"], to="gguf", out=tmp_path / "x", quant="q4_0", progress=False)
    assert swallowed, "the negative control: the interrupt must have been swallowed by the callback"
    assert not (tmp_path / "x").exists() and not list(tmp_path.glob(".*"))
    monkeypatch.setattr(tg, "llama_quantize", real)
    s = convert(tiny_hf["llama"], to="gguf", out=tmp_path / "x", quant="q4_0", progress=False, verify=False)
    assert (tmp_path / "x" / "model.gguf").is_file() and s["quant"] == "q4_0"  # the next run works


def test_info_reports_each_kind_of_verification(tiny_hf, tiny_gguf, tmp_path):
    """Review: `ondevice info` said "verified: no" for a Core ML package the MIL interpreter had checked, and
    "top-1 0.375 (max rel. error None)" as a pass for a requantized GGUF whose quality is recorded, not gated;
    convert()'s JSON said "verify": null for Core ML."""
    from ondevice.store.info import describe

    c = convert(tiny_hf["llama"], to="coreml", out=tmp_path / "c", compress="none", context=32, progress=False)
    assert c["verify"]["runtime"].startswith("MIL interpreter") and c["verify"]["top1"] >= 0.9
    line = describe(tmp_path / "c")["verified"]
    assert line.startswith("program only, not against the source model: mil-interpreter") and "None" not in line, line
    convert(tiny_gguf("llama", "q8_0"), to="gguf", quant="q4_0", out=tmp_path / "r", allow_requantize=True,
            progress=False)
    line = describe(tmp_path / "r")["verified"]
    assert "not gated" in line and "mean KL" in line and "None" not in line, line
    assert describe(tiny_gguf("llama", "q8_0"))["verified"].startswith("yes, in llama.cpp: tokenizer identical")
    (tmp_path / "pair" / "target").mkdir(parents=True)
    (tmp_path / "pair" / "draft").mkdir()
    with pytest.raises(OndeviceError, match="a converted pair .*pair/target"):  # was "unrecognised model format"
        describe(tmp_path / "pair")


def test_requantize_warns_when_llama_cpp_falls_back_to_wider_types(tmp_path):
    """Review: `pull smollm2 --quant q4_k_m` wrote a bigger file (5.74 → 6.16 bits per weight: rows of 576 are
    not a multiple of 256, so llama.cpp used Q5_0/Q8_0) with no word about it. Rows of 384 here."""
    from ondevice.testing import make_tiny_hf

    src = make_tiny_hf(tmp_path / "hf", "llama", hidden_size=384, intermediate_size=768, num_attention_heads=3,
                       num_key_value_heads=1)
    convert(src, to="gguf", quant="q4_0", out=tmp_path / "q4", progress=False, verify=False)
    s = convert(tmp_path / "q4" / "model.gguf", to="gguf", quant="q4_k_m", out=tmp_path / "k", allow_requantize=True,
                progress=False)
    assert s["bits_per_weight"] > s["source_bits_per_weight"] and s["fallbacks"], s
    assert "more bits per weight than the source" in s["warning"], s["warning"]
    s = convert(tmp_path / "q4" / "model.gguf", to="gguf", quant="q4_0", out=tmp_path / "same", allow_requantize=True,
                progress=False)  # the negative control: no fallback, no such warning
    assert s["bits_per_weight"] <= s["source_bits_per_weight"] + 0.05 and "more bits" not in s["warning"], s


def test_requantize_messages_are_one_line_each_and_keep_brackets(tiny_gguf, tmp_path):
    """Review: the warning and quality lines were wrapped at 80 columns on a pipe, and a "[...]" in a file
    name was read as rich markup (dropped, or a MarkupError traceback for "[/x]")."""
    import shutil

    d = tmp_path / "a [b] [red]"
    d.mkdir()
    shutil.copy(tiny_gguf("llama", "q8_0"), d / "m[red]1.gguf")
    r = _cli("convert", str(d / "m[red]1.gguf"), "--to", "gguf", "--quant", "q4_0", "--allow-requantize",
             "--out", str(tmp_path / "o"))
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 2, r.stderr
    assert lines[0].startswith("warning: m[red]1.gguf is already quantized") and "second quantization" in lines[0]
    assert lines[1].startswith("quality vs m[red]1.gguf on") and lines[1].endswith("bits per weight"), lines[1]


def test_sigterm_mid_conversion_leaves_no_temp_dir(tiny_hf, tmp_path):
    """Review: `kill` (SIGTERM) mid-conversion ended the process at once and left `.OUT.<hex>.partial` beside
    the output for good. Now it unwinds like Ctrl-C: nothing is left. The signal is sent from inside the
    conversion (after the f16 GGUF is written), so the test does not depend on timing."""
    code = f"""
import os, signal, sys
import converters.to_gguf as tg
from converters import convert
tg.llama_quantize = lambda *a, **k: os.kill(os.getpid(), signal.SIGTERM)
try:
    convert({str(tiny_hf["llama"])!r}, to="gguf", quant="q4_0", out={str(tmp_path / "x")!r}, progress=False)
except KeyboardInterrupt:
    sys.exit(130)
sys.exit(0)
"""
    r = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 130, (r.returncode, r.stderr[-2000:])
    assert list(tmp_path.iterdir()) == [], list(tmp_path.iterdir())


def test_a_gguf_output_dir_is_a_source_and_an_mlx_quantized_dir_is_refused(tiny_hf, tiny_gguf, tmp_path):
    """Review: `convert OUT_DIR` (a directory written by `convert --to gguf`, which `run` and `info` accept)
    failed with "config.json: missing"; an MLX 4-bit directory given as the source failed with "tensor
    model.embed_tokens.biases has no GGUF name"."""
    gguf_dir = tiny_gguf("llama", "q8_0").parent
    s = convert(gguf_dir, to="gguf", quant="q4_0", out=tmp_path / "rq", allow_requantize=True, progress=False)
    assert s["source"].endswith("model.gguf") and s["verify"]["passed"]
    convert(tiny_hf["llama"], to="mlx", out=tmp_path / "m", progress=False, verify=False)
    r = _cli("convert", str(tmp_path / "m"), "--to", "gguf", "--out", str(tmp_path / "g"))
    _one_line_error(r, "m/config.json: already quantized weights ('quantization')")
    assert r.returncode == 2 and not (tmp_path / "g").exists()
