"""Issue 25: conversions whose check is bounded in memory, tokenizer readings that disagree, and Core ML
weights that keep a GGUF's blocks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from converters import convert
from ondevice.errors import OndeviceError

ROOT = Path(__file__).resolve().parents[1]


# -- memory ---------------------------------------------------------------------------------------
def _peak_convert(src: Path, out: Path, *args: str) -> tuple[int, dict]:
    """Run ``ondevice convert`` in a subprocess; (peak RssAnon of its process tree, its --json)."""
    from converters.memwatch import MemoryWatch

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-P", "-m", "ondevice", "convert", str(src), "--out", str(out), "--json", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=ROOT)
    with MemoryWatch(proc.pid, tree=True, interval=0.005) as mw:
        stdout, stderr = proc.communicate(timeout=900)
    assert proc.returncode == 0, stderr.decode()[-2000:]
    doc = json.loads(stdout)
    # Both peaks are sampled (every 5 ms, this one from another process on a busy machine): the run's peak is
    # at least the larger of the two, and the growth bound below is judged on that.
    return max(mw.peak_rss_bytes, doc["verify"]["cost"]["peak_rss_bytes"]), doc


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="RssAnon is read from /proc (Linux)")
@pytest.mark.parametrize("to,args", [("gguf", ("--quant", "q4_k_m")), ("mlx", ())], ids=["gguf", "mlx"])
def test_convert_memory_does_not_grow_with_the_model(tmp_path, to, args):
    """A 4-layer (113M parameters, 226 MB of f16) and a 1-layer (38M, 75 MB) synthetic checkpoint convert and
    verify; the larger one's peak private memory (the whole process tree, RssAnon) exceeds the small one's by
    less than 0.75× the difference of their f16 sizes. Holding the model once in f16 is 1×, in float32 2×;
    the old check held ~5×."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from make_synthetic_checkpoint import make

    big = make(tmp_path / "big", params_b=0.11, tokenizer_vocab=512, vocab=8192)
    small = make(tmp_path / "small", params_b=0.0, tokenizer_vocab=512, vocab=8192)
    peak_small, _ = _peak_convert(tmp_path / "small", tmp_path / "small-out", "--to", to, *args)
    peak_big, summary = _peak_convert(tmp_path / "big", tmp_path / "big-out", "--to", to, *args)
    grew = peak_big - peak_small
    growth_allowed = 0.75 * (big["f16_bytes"] - small["f16_bytes"])
    assert summary["verify"]["passed"]
    check = summary["verify"]["cost"]
    assert check["seconds"] > 0 and 0 < check["peak_rss_bytes"] <= peak_big
    assert grew <= growth_allowed, (f"peak RssAnon grew by {grew / 1e6:.0f} MB for {big['f16_bytes'] / 1e6:.0f} MB of "
                                    f"f16 weights (small: {peak_small / 1e6:.0f} MB, big: {peak_big / 1e6:.0f} MB)")


# -- tokenizer readings ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def two_readings(tmp_path_factory):
    """A qwen2 checkpoint whose tokenizer.json is SmolLM2-style (Digits + GPT-2 ByteLevel regex) under a plain
    ``PreTrainedTokenizerFast`` config: transformers 5 loads it as ``Qwen2Tokenizer`` (from config.json's
    model_type), which rebuilds the pre-tokenizer with Qwen2's regex; the tokenizers library keeps the file's.
    They split "\\n    return" differently, as the held-out checkpoint of issue 25 did."""
    from ondevice.testing import make_tiny_hf

    return make_tiny_hf(tmp_path_factory.mktemp("readings") / "qwen2-smollm", "qwen2", tokenizer="smollm")


def test_readings_name_the_strings_that_differ(two_readings):
    from converters.readings import hf_readings

    r = hf_readings(two_readings, add_bos=False, bos_id=None)
    assert r["reference"] == "transformers" and not r["agree"] and r["transformers_class"] == "Qwen2Tokenizer"
    texts = [d["text"] for d in r["differences"]]
    assert "\n   " in texts  # the probe's "\n    return": Qwen2's regex splits the newline off first
    d = r["differences"][texts.index("\n   ")]
    assert d["transformers"] != d["tokenizers"] and "Qwen2Tokenizer" in r["why"]
    assert "split regex ByteLevel's built-in GPT-2 regex → " in r["why"]  # names what was replaced


@pytest.mark.parametrize("to,follows", [("mlx", "transformers"), ("gguf", "tokenizers")])
def test_tokenizer_check_warn_converts_and_reports(two_readings, tmp_path, to, follows):
    s = convert(two_readings, to=to, out=tmp_path / to, progress=False, **({"quant": "q8_0"} if to == "gguf" else {}))
    assert s["verify"]["passed"] and (tmp_path / to).is_dir()
    tok = s["verify"]["tokenizer"]
    assert tok["follows"] == follows and tok["readings_agree"] is False and tok["differences"]
    report = s["tokenizer_check"]
    assert not report["readings_agree"] and "\\n   " in report["summary"] and "strict" in report["choice"]


def test_tokenizer_check_strict_refuses_with_one_line_and_writes_nothing(two_readings, tmp_path):
    out = tmp_path / "strict"
    with pytest.raises(OndeviceError) as e:
        convert(two_readings, to="mlx", out=out, progress=False, tokenizer_check="strict")
    msg = str(e.value)
    assert "\n" not in msg and "tokenizer.json" in msg and "nothing was written" in msg and "--tokenizer-check warn" in msg
    assert not out.exists() and not list(tmp_path.glob(".strict*"))
    # the one-line error collapses whitespace runs: the differing strings keep their spaces visible (␣)
    assert "'\\n␣␣␣'" in msg


def test_tokenizer_check_strict_passes_agreeing_readings(tmp_path):
    from ondevice.testing import make_tiny_hf

    src = make_tiny_hf(tmp_path / "q", "qwen2")
    s = convert(src, to="gguf", quant="q8_0", out=tmp_path / "o", progress=False, tokenizer_check="strict")
    assert s["tokenizer_check"] is None and s["verify"]["tokenizer"]["readings_agree"] is True


# -- Core ML keeps GGUF blocks --------------------------------------------------------------------
@pytest.mark.parametrize("ttype", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_blocks_become_core_ml_blockwise_without_rerounding(ttype):
    import gguf

    from converters.coreml_blocks import from_gguf_block

    rng = np.random.default_rng(0)
    w = (rng.standard_normal((64, 256)) * 0.05).astype(np.float32)
    w[3, :32] = 0.125  # a constant block (Q4_1: d = 0)
    qt = gguf.GGMLQuantizationType[ttype]
    raw = gguf.quantize(w, qt)
    want = gguf.dequantize(raw, qt).reshape(w.shape)
    b = from_gguf_block(raw, ttype, *w.shape)
    assert b.kept and b.bits == (8 if ttype == "Q8_0" else 4)
    got = b.dense().astype(np.float32)
    if ttype == "Q4_1":  # the offset −m/d and n − offset are fp16: ≤ ~1 % of a step
        step = np.repeat(np.abs(b.scale.astype(np.float32)), 32, axis=1)
        assert np.all(np.abs(got - want) <= 0.02 * step + 1e-6)
    else:  # codes and scales as llama.cpp wrote them; Core ML's fp16 product is the only rounding
        np.testing.assert_allclose(got, want.astype(np.float16).astype(np.float32), rtol=2e-3, atol=1e-7)


@pytest.mark.parametrize("quant,gated", [("q8_0", True), ("q4_0", False)])
def test_gguf_to_coreml_keeps_blocks_and_is_checked_against_the_source(tiny_hf, tmp_path, quant, gated):
    """Q8_0 / Q4_0 tensors are kept as blocks; q4_0's Q6_K embedding is re-quantized (named, with its cost),
    and the package is judged against llama.cpp on the source, through the MIL interpreter."""
    convert(tiny_hf["llama"], to="gguf", quant=quant, out=tmp_path / "g", progress=False, verify=False)
    s = convert(tmp_path / "g" / "model.gguf", to="coreml", out=tmp_path / "c", progress=False)
    assert s["weights"] == "gguf-blocks"
    blocks = s["blocks"]
    assert blocks["kept"] == {quant.upper(): 14 if quant == "q4_0" else 15}
    assert blocks["kept_max_rel_error"] < 1e-3
    if quant == "q4_0":
        [r] = blocks["requantized"]
        assert r["tensor"] == "model.embed_tokens.weight" and r["from"] == "Q6_K" and 0 < r["rel_error"] < 0.02
    src = s["verify"]["source"]
    assert src["gated"] is gated and src["reference"].startswith("llama.cpp") and src["top1_agreement"] >= 0.8
    manifest = json.loads((tmp_path / "c" / "manifest.json").read_text())
    assert manifest["verified"]["source"] == src and manifest["blocks"] == blocks
    # the check's cost is reported as for GGUF / MLX: the package check and the source agreement
    for cost in (s["verify"]["cost"], src["cost"]):
        assert cost["seconds"] > 0 and cost["peak_rss_bytes"] > 0
    from ondevice.store.info import describe

    line = describe(tmp_path / "c")["verified"]  # `ondevice info`'s line: the positions compared, no "None"
    assert line.startswith("yes, against the source") and "None" not in line and "positions" in line, line


def test_ggml_dequantize_equals_gguf(tiny_hf, tmp_path):
    """The check dequantizes with ggml's own to_float; it must give gguf-py's floats exactly."""
    import gguf

    from converters.dequant import dequantize

    convert(tiny_hf["llama"], to="gguf", quant="q4_k_m", out=tmp_path / "g", progress=False, verify=False)
    types = set()
    for t in gguf.GGUFReader(str(tmp_path / "g" / "model.gguf")).tensors:
        want = np.asarray(gguf.dequantize(t.data, t.tensor_type), np.float32)
        np.testing.assert_array_equal(dequantize(t.data, t.tensor_type).reshape(want.shape), want)
        types.add(t.tensor_type.name)
    assert {"Q4_K", "Q6_K", "F32"} <= types


# -- Ctrl-C -----------------------------------------------------------------------------------------
def test_ctrl_c_swallowed_by_a_c_callback_is_remembered_and_not_printed():
    """A Ctrl-C landing in llama.cpp's log callback is swallowed by ctypes: the flag stops the conversion,
    and no "Exception ignored ... KeyboardInterrupt" traceback reaches the user's terminal."""
    code = (
        "import ctypes, os, signal\n"
        "from converters.output import check_interrupted, sigint_remembered\n"
        "cb = ctypes.CFUNCTYPE(None)(lambda: os.kill(os.getpid(), signal.SIGINT))\n"
        "try:\n"
        "    with sigint_remembered():\n"
        "        cb()  # raised inside the callback: ctypes reports it and carries on\n"
        "        check_interrupted()\n"
        "except KeyboardInterrupt:\n"
        "    print('stopped')\n")
    r = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.stdout.strip() == "stopped" and "Exception ignored" not in r.stderr, r.stderr


def test_out_that_is_a_file_is_named_as_a_file(tmp_path):
    """--out naming an existing file said "already exists and is not empty"; it says what it is."""
    from converters.output import check_out

    (tmp_path / "f").write_text("x")
    with pytest.raises(OndeviceError, match="is a file, not a directory"):
        check_out(tmp_path / "f")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x").write_text("x")
    with pytest.raises(OndeviceError, match="already exists and is not empty"):
        check_out(tmp_path / "d")
    (tmp_path / "e").mkdir()
    check_out(tmp_path / "e")  # an empty directory is taken
