"""The check a GGUF or MLX conversion ends with, bounded in memory and in time whatever the model's size.

Memory: nothing holds a model. The source's forward pass (``ondevice.formats.decoder.reference_logits``)
runs layer by layer in numpy float32 from the memory-mapped safetensors (or, for a GGUF source, in
llama.cpp, which maps its file); the written model's forward pass runs the same way on the written
tensors, each dequantized when the pass reaches it and compared there with the same source tensor
(``converters.written.TensorCheck``); activations exist for the short probe only.

Time: the two float passes run at BLAS speed in numpy. The runtime's own pass runs on the whole probe in
llama.cpp (GGUF) and in MLX on Metal. MLX on a CPU (Linux: no BLAS, ~4 GFLOP/s, and its quantized matmul
took over ten minutes for one token of a 0.75B model on this shared machine) only loads the output (config,
strict weight loading, tokenizer) and tokenizes the probe; the written model's forward is then the numpy
pass on its weights as ``mx.dequantize`` gives them. Small outputs (≤ ``MLX_CPU_MAX_BYTES``: the tests'
models) still run their first ``MLX_CPU_TOKENS`` positions in MLX on the CPU, against that numpy pass.

Gates (``converters.probe.THRESHOLDS``): the runtime against the float pass on its own written weights
(``written-gguf`` / ``written-mlx``); float outputs also against the source (``float``), lossless
GGUF → MLX outputs against llama.cpp on the source (``lossless``); quantized outputs record their
agreement with the source (quantization costs what it costs) and gate every tensor's rounding.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from converters.probe import MAX_TOKENS, PROBE, check, compare, gguf_reference_logits, llama_backend
from ondevice.errors import OndeviceError, shown

CHECK_TOKENS = 64  # teacher-forced positions of the probe (the tokenizer check covers all of it)
MLX_CPU_TOKENS = 8  # positions MLX runs on a CPU, for models up to MLX_CPU_MAX_BYTES
MLX_CPU_MAX_BYTES = 16 << 20  # written weights; above, MLX's CPU kernels (no BLAS) take minutes per token
NUMPY_ARCHS = ("llama", "mistral", "qwen2", "qwen3")  # the numpy decoder's graphs (others: mlx-lm float32)


def mlx_has_metal() -> bool:
    import mlx.core as mx

    return bool(hasattr(mx, "metal") and mx.metal.is_available())


def runtime_pass(fmt: str, path: Path, ids: list[int], *, where: Path, what: str) -> tuple[list[int], bool, np.ndarray, str]:
    """Load the output in its runtime, tokenize the probe, teacher-force ``ids`` (MLX on a CPU: a prefix).

    Returns:
        (the output's probe ids without BOS, whether it adds BOS, logits [m, vocab], the device it ran on).
    """
    from converters.probe import _open_output

    n = len(ids)
    if fmt == "mlx" and not mlx_has_metal():
        small = sum(f.stat().st_size for f in path.glob("*.safetensors")) <= MLX_CPU_MAX_BYTES
        n = min(n, MLX_CPU_TOKENS) if small else 0
    backend = _open_output(fmt, path, len(ids), where, what)
    try:
        got = backend.tokenize(PROBE, add_bos=True)
        bos = bool(backend.add_bos)
        body = got[1:] if bos and got[:1] == [backend.bos_id] else got
        out = backend.eval(ids[:n]) if n else np.zeros((0, 0), np.float32)
    finally:
        backend.close()
    device = "cpu" if fmt == "gguf" or not mlx_has_metal() else "metal"
    return body, bos, out, device


def tokenizer_record(body: list[int], bos: bool, readings: dict, where: Path, what: str) -> dict:
    """Which reading of the source tokenizer the output follows; one-line error when it follows none.

    ``readings``: {"ids": {name: ids}, "reference": name, "add_bos": bool, "agree": bool, "differences": [...]}
    (``converters.readings``).
    """
    follows = [name for name, ids in readings["ids"].items() if ids == body]
    ref = readings["reference"]
    if not follows or bos != readings["add_bos"]:
        want = readings["ids"][ref]
        first = next((i for i, (a, b) in enumerate(zip(body, want, strict=False)) if a != b), min(len(body), len(want)))
        raise OndeviceError(
            f"{shown(where)}: verification failed: the written {what} tokenizes the probe differently from the source "
            f"({ref}; first difference at token {first}: {body[first:first + 3]} vs {want[first:first + 3]}; "
            f"adds BOS {bos} vs {readings['add_bos']}); nothing was kept")
    rec = {"match": True, "probe_tokens": len(body), "add_bos": bos, "reference": ref,
           "follows": ref if ref in follows else follows[0], "readings_agree": readings["agree"]}
    if not readings["agree"]:
        rec["differences"] = readings["differences"]
    return rec


def _forward(cfg_dict: dict, weights, ids: list[int], where: Path) -> np.ndarray:
    from ondevice.formats.decoder import DecoderConfig, reference_logits

    cfg = DecoderConfig.from_hf(cfg_dict, where, archs=NUMPY_ARCHS, what="the numpy reference")
    return reference_logits(cfg, weights, ids)


def check_hf(src: Path, fmt: str, path: Path, level: str, out: Path, readings: dict) -> dict:
    """HF checkpoint → GGUF / MLX: the streamed check (module docstring). Returns the verification record."""
    from converters import written as w
    from converters.hf import open_checkpoint
    from converters.lazy import hf_weights

    ckpt = open_checkpoint(src)
    if ckpt.arch not in NUMPY_ARCHS:
        return None  # the caller runs the mlx-lm float32 check
    what = f"{fmt.upper()} model (arch {ckpt.arch})"
    bos_id = readings.get("bos_id")
    ids = _ids(readings, bos_id)  # the reference reading's ids: every pass reads the same ids
    body, bos, rt_logits, runtime = runtime_pass(fmt, path, ids, where=out, what=what)
    tok = tokenizer_record(body, bos, readings, out, what)
    _, source = hf_weights(ckpt.path)
    written, bits = w.gguf_written(path, ckpt) if fmt == "gguf" else w.mlx_written(path)
    tensors = w.TensorCheck(source, bits, out)
    written.on_load = tensors
    ref = _forward(ckpt.config, source, ids, ckpt.path / "config.json")
    own = _forward(ckpt.config, written, ids, ckpt.path / "config.json")
    weights = tensors.finish(written)
    return _gate(fmt, level, out, runtime, tok, rt_logits, own, ref, "numpy float32 (source weights, memory-mapped)",
                 weights)


def check_gguf_to_mlx(src: Path, path: Path, summary: dict, out: Path) -> dict:
    """GGUF → MLX: llama.cpp's tokenizer and forward pass on the source, the written tensors against the
    GGUF's dequantized ones (one at a time), the numpy pass on the written weights."""
    from converters import written as w
    from ondevice.formats.gguf import GGUFFile

    b = llama_backend(src, MAX_TOKENS)
    try:
        src_ids, src_bos = b.tokenize(PROBE, add_bos=True), bool(b.add_bos)
        bos_id = b.bos_id
    finally:
        b.close()
    g = GGUFFile(src)
    what = f"MLX model (arch {g.arch}, from GGUF)"
    body_src = src_ids[1:] if src_bos and src_ids[:1] == [bos_id] else src_ids
    readings = {"ids": {"llama.cpp": body_src}, "reference": "llama.cpp", "add_bos": src_bos, "agree": True}
    ids = src_ids[:CHECK_TOKENS]
    body, bos, rt_logits, runtime = runtime_pass("mlx", path, ids, where=out, what=what)
    tok = tokenizer_record(body, bos, readings, out, what)
    written, bits = w.mlx_written(path)
    tensors = w.TensorCheck(w.gguf_source(g), bits, out)
    written.on_load = tensors
    config = json.loads((path / "config.json").read_text())
    own = _forward(config, written, ids, path / "config.json")
    weights = tensors.finish(written)
    ref = gguf_reference_logits(src, ids)
    level = "quantized" if summary.get("requantized_tensors") else "lossless"
    return _gate("mlx", level, out, runtime, tok, rt_logits, own, ref, "llama.cpp (source GGUF)", weights)


def _ids(readings: dict, bos_id: int | None) -> list[int]:
    body = readings["ids"][readings["reference"]]
    return (([bos_id] if readings["add_bos"] and bos_id is not None else []) + body)[:CHECK_TOKENS]


def _gate(fmt: str, level: str, out: Path, runtime: str, tok: dict, rt: np.ndarray, own: np.ndarray, ref: np.ndarray,
          ref_name: str, weights: dict) -> dict:
    """Compare the three passes and apply the gates (module docstring); returns the record."""
    m = rt.shape[0]
    record = {"runtime": "llama.cpp" if fmt == "gguf" else "mlx-lm", "runtime_device": runtime,
              "runtime_positions": m, "positions": own.shape[0], "precision": level, "tokenizer": tok}
    if m and level == "float":  # first: a wrong graph (rope layout, a dropped quirk) is named against the source
        record["runtime_vs_source"] = check(compare(rt, ref[:m]), "float", out)
    if m:
        record["written"] = check({**compare(rt, own[:m]), "reference": "numpy float32 (written weights, dequantized)"},
                                  f"written-{fmt}", out, "its own weights (dequantized, run in float32)")
    else:
        record["written"] = {"runtime_forward": "not run: MLX has no fast CPU path here; mlx-lm loaded the output and "
                                                "tokenized the probe, numpy ran its mx.dequantize'd weights",
                             "positions": 0}
    record["source"] = {**compare(own, ref), "reference": ref_name, "compared": "written weights (numpy) vs source"}
    if level in ("float", "lossless"):
        check(record["source"], level, out)
    record["weights"] = weights
    record["passed"] = True
    return record


def timed(fn, *args) -> tuple[dict, dict]:
    """Run a check under ``converters.memwatch.MemoryWatch``: (its record, {"seconds", "peak_rss_bytes", ...})."""
    from converters.memwatch import MemoryWatch

    t0 = time.perf_counter()
    with MemoryWatch() as mw:
        result = fn(*args)
    cost = mw.record()
    cost["seconds"] = round(time.perf_counter() - t0, 3)
    return result, cost
