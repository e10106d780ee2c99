"""Verify a conversion in the runtime that will run it: load, tokenize a probe, teacher-force it.

Every ``ondevice convert`` ends here, before its output directory is renamed into place:

1. the output is loaded by its own backend (llama.cpp for GGUF, mlx-lm for MLX);
2. a multilingual probe (accents, CJK, emoji, digits, code, leading spaces, newlines) is tokenized by
   the output and by the source tokenizer (the HF ``tokenizer.json``, or llama.cpp for a GGUF source):
   the ids, and whether a BOS is added, must be identical;
3. every written tensor, read back and dequantized, must be within its type's rounding of the source
   tensor (``converters.written``: catches swapped, transposed or mis-permuted tensors at any precision);
4. the probe ids are teacher-forced through the output and through the source model's own forward pass
   (mlx-lm in float32 on the HF weights, or llama.cpp on a GGUF source): top-1 agreement and
   max |Δlogit| / max |logit| are recorded, and for float (and lossless GGUF → MLX) outputs must meet
   THRESHOLDS. Quantized outputs cannot match a float source to 2 %, so they must instead match mlx-lm
   float32 run on their own written weights (names, layouts and hyperparameters without quantization noise).

A failure raises ``OndeviceError`` (one line), so nothing is left behind. Hooks for other converters
(Core ML): ``PROBE``, ``hf_probe_ids``, ``hf_reference_logits`` (the source's forward), ``compare`` and
``check`` (a one-line error when the logits disagree).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from ondevice.backends import is_gguf_file
from ondevice.errors import OndeviceError

PROBE = (
    "Hello, world! Héllo wörld: café, naïve façade, Ærøskøbing, straße. 東京は晴れ。中文测试，谢谢！ "
    "😀🚀👍🏽 0123456789 3.14159 1,000,000 2024-05-17\n"
    "def add(a, b):\n    return a + b  # sum\n\n"
    "   three leading spaces\n\tTab\r\nCRLF  two  spaces {x: [1, 2]} != <tag/> it's we'll"
)
MAX_TOKENS = 128  # teacher-forced positions (the tokenizer check covers the whole probe)
TIE_MARGIN = 0.01  # reference top-1 leads by less than this × max |logit|: a tie, not counted for top-1
MAX_TOKENS_MLX_QUANTIZED = 64  # MLX's CPU quantized matmul costs ~0.1 s per position even on a tiny model

# precision of the output → (min top-1 agreement, max relative logit error) against the source's forward.
THRESHOLDS: dict[str, tuple[float, float]] = {
    "float": (0.98, 0.02),  # f16 weights (GGUF f16, MLX float16)
    # GGUF blocks re-laid as MLX arrays: the same weights, but llama.cpp rounds activations to 8 bits for
    # quantized matmuls and MLX does not; random tiny models amplify that (real SmolLM2 Q4_1: top-1 ≈ 0.95)
    "lossless": (0.80, 0.20),
    # a quantized output against mlx-lm float32 on its own (dequantized) weights; llama.cpp also rounds
    # activations to 8 bits for quantized matmuls, MLX does not
    "written-gguf": (0.85, 0.15),
    "written-mlx": (0.90, 0.08),
}


def precision(fmt: str, quant: str, bits: int | None = None) -> str:
    """"float", "lossless" or "quantized" for an output format and quantization."""
    if fmt == "gguf":
        return "float" if quant == "f16" else "quantized"
    if quant == "from-gguf":
        return "lossless"
    return "float" if bits == 16 else "quantized"


def compare(out: np.ndarray, ref: np.ndarray) -> dict:
    """Top-1 agreement and max |out − ref| / max |ref| of two [n, vocab] logit arrays (shared vocab prefix).

    ``top1_agreement`` counts the positions where the reference's top-1 leads its runner-up by more
    than ``TIE_MARGIN`` of max |ref| (a near-tie can flip under any rounding, and random tiny models
    have many); ``top1_agreement_all`` counts every position.
    """
    v = min(out.shape[1], ref.shape[1])
    out, ref = np.asarray(out[:, :v], np.float64), np.asarray(ref[:, :v], np.float64)
    scale = max(np.abs(ref).max(), 1e-9)
    same = out.argmax(1) == ref.argmax(1)
    top2 = np.sort(ref, axis=1)[:, -2:]
    decisive = (top2[:, 1] - top2[:, 0]) > TIE_MARGIN * scale
    return {"positions": int(out.shape[0]), "decisive_positions": int(decisive.sum()),
            "top1_agreement": round(float(same[decisive].mean()) if decisive.any() else 1.0, 4),
            "top1_agreement_all": round(float(same.mean()), 4),
            "max_rel_error": round(float(np.abs(out - ref).max() / scale), 5)}


def check(result: dict, level: str, where: Path | str, against: str = "its source") -> dict:
    """Add the thresholds of ``level`` to a ``compare`` result; raise a one-line error when it fails them."""
    min_top1, max_rel = THRESHOLDS[level]
    result.update(min_top1=min_top1, max_rel_error_allowed=max_rel)
    if result["top1_agreement"] < min_top1 or result["max_rel_error"] > max_rel:
        raise OndeviceError(
            f"{where}: verification failed: the converted model disagrees with {against} on a probe "
            f"(top-1 agreement {result['top1_agreement']:.3f}, need ≥ {min_top1}; max relative logit error "
            f"{result['max_rel_error']:.4f}, need ≤ {max_rel}); the converter wrote a wrong model, nothing was kept"
        )
    return result


# -- the source side --------------------------------------------------------------------------------
def hf_probe_ids(src: Path, add_bos: bool, bos_id: int | None) -> list[int]:
    """The HF tokenizer's ids for the probe (``tokenizer.json``, else ``tokenizer.model``), with BOS when it adds one."""
    from tokenizers import Tokenizer

    if (src / "tokenizer.json").is_file():
        ids = Tokenizer.from_file(str(src / "tokenizer.json")).encode(PROBE, add_special_tokens=False).ids
    else:  # a SentencePiece tokenizer.model alone: sentencepiece itself is the source tokenizer
        from converters.spm import encode

        ids = encode(src / "tokenizer.model", PROBE)
    return ([bos_id] if add_bos and bos_id is not None else []) + ids


def hf_reference_logits(src: Path, ids: list[int], weights: dict[str, np.ndarray] | None = None) -> np.ndarray:
    """The source model's own forward pass: mlx-lm in float32 on the HF checkpoint's weights, or on
    ``weights`` (HF or mlx-lm names: what a conversion wrote, dequantized) in that model."""
    import mlx.core as mx
    from mlx.utils import tree_map
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(src))
    model.update(tree_map(lambda x: x.astype(mx.float32), model.parameters()))
    if weights is not None:
        # HF and mlx-lm name these architectures' parameters alike; strict: every parameter is given
        model.load_weights([(k, mx.array(v)) for k, v in weights.items()], strict=True)
    out = np.array(model(mx.array([ids]))[0].astype(mx.float32))
    del model
    mx.clear_cache()
    return out


def mlx_float_logits(config: dict, weights: dict[str, np.ndarray], ids: list[int]) -> np.ndarray:
    """mlx-lm's model for ``config`` (quantization dropped) in float32 with ``weights``: [n, vocab] logits."""
    import mlx.core as mx
    from mlx_lm.utils import _get_classes

    cfg = {k: v for k, v in config.items() if k not in ("quantization", "quantization_config")}
    model_class, args_class = _get_classes(cfg)
    model = model_class(args_class.from_dict(cfg))
    model.load_weights([(k, mx.array(v, dtype=mx.float32)) for k, v in weights.items()], strict=True)
    return np.array(model(mx.array([ids]))[0].astype(mx.float32))


def llama_backend(path: Path, n: int):
    """A llama.cpp backend with room for ``n`` probe tokens (one batch)."""
    from ondevice.backends.llama import LlamaBackend

    return LlamaBackend(path, n_ctx=max(64, n + 8), n_batch=max(64, n + 8))


def gguf_reference_logits(src: Path, ids: list[int]) -> np.ndarray:
    """A GGUF source's own forward pass, in llama.cpp."""
    b = llama_backend(src, len(ids))
    try:
        return b.eval(ids)
    finally:
        b.close()


# -- the output side --------------------------------------------------------------------------------
def _open_output(fmt: str, path: Path, n: int, where: Path, what: str):
    """The output in the backend the runtime would use for it; a load failure is a verification failure."""
    try:
        if fmt == "gguf":
            return llama_backend(path, n)
        from ondevice.backends.mlx import MLXBackend

        return MLXBackend(path, n_ctx=max(64, n + 8))
    except OndeviceError as e:
        reason = str(e).split(": ", 1)[-1]  # drop the temporary path it names
        runtime = "llama.cpp" if fmt == "gguf" else "mlx-lm"
        raise OndeviceError(f"{where}: verification failed: the written {what} does not load in {runtime} ({reason}); "
                            "nothing was kept") from e


def verify_output(fmt: str, path: Path, *, where: Path, source_ids: list[int], source_bos: bool, level: str,
                  reference, reference_name: str, written=None, what: str) -> dict:
    """Load ``path`` in its runtime, compare its tokenization and its logits with the source's.

    Args:
        fmt: "gguf" (``path`` is the .gguf file) or "mlx" (``path`` is the directory).
        where: the output directory the user asked for (for error messages).
        source_ids: the source tokenizer's probe ids, BOS included when it adds one.
        source_bos: whether the source tokenizer adds BOS.
        level: ``precision()``: "float" and "lossless" outputs must match ``reference`` to THRESHOLDS[level];
            "quantized" ones must match ``written`` (the source model run on the output's own weights).
        reference: ``ids → [n, vocab]`` logits of the source model's own forward pass.
        reference_name: what ``reference`` runs, for the record.
        written: for quantized outputs, ``ids → [n, vocab]`` logits of mlx-lm float32 on the written weights.
        what: words for error messages (e.g. "GGUF model (arch llama, tokenizer gpt2/smollm)").
    Returns:
        The verification record for manifest.json and --json.
    Raises:
        OndeviceError: one line, when the output does not load, tokenizes differently or computes differently.
    """
    t0 = time.perf_counter()
    body = source_ids[1:] if source_bos else source_ids
    backend = _open_output(fmt, path, len(source_ids), where, what)
    try:
        got = backend.tokenize(PROBE, add_bos=True)
        got_bos = bool(backend.add_bos)
        got_body = got[1:] if got_bos and got[:1] == [backend.bos_id] else got
        if got_body != body or got_bos != source_bos:
            first = next((i for i, (a, b) in enumerate(zip(got_body, body, strict=False)) if a != b),
                         min(len(got_body), len(body)))
            raise OndeviceError(
                f"{where}: verification failed: the written {what} tokenizes the probe differently from the source "
                f"(first difference at token {first}: {got_body[first:first + 3]} vs {body[first:first + 3]}; "
                f"adds BOS {got_bos} vs {source_bos}); nothing was kept"
            )
        ids = source_ids[:MAX_TOKENS_MLX_QUANTIZED if fmt == "mlx" and level != "float" else MAX_TOKENS]
        out = backend.eval(ids)
    finally:
        backend.close()
    record = {"runtime": "llama.cpp" if fmt == "gguf" else "mlx-lm", "precision": level,
              "tokenizer": {"match": True, "probe_tokens": len(body), "add_bos": source_bos}}
    record["source"] = {**compare(out, reference(ids)), "reference": reference_name}
    if level == "quantized":
        record["written"] = check({**compare(out, written(ids)), "reference": "mlx-lm float32 (written weights)"},
                                  f"written-{fmt}", where, "its own weights run by mlx-lm")
    else:
        check(record["source"], level, where)
    record.update(passed=True, seconds=round(time.perf_counter() - t0, 3))
    return record


def record(directory: Path, result: dict) -> None:
    """Add the verification record to ``directory/manifest.json``."""
    from converters.output import write_manifest

    path = directory / "manifest.json"
    manifest = json.loads(path.read_text()) if path.is_file() else {}
    manifest["verify"] = result
    write_manifest(directory, manifest)


# -- one conversion -------------------------------------------------------------------------------
def verify_conversion(src: Path, to: str, written: Path, summary: dict, out: Path) -> dict | None:
    """Verify ``written`` (a GGUF or MLX output of ``src``) in its runtime; record it in its manifest.json.

    Args:
        src: the source (HF checkpoint directory or GGUF file).
        to: "gguf" | "mlx" | "coreml" (Core ML is checked by ``converters.coreml``; here its record is kept).
        written: the directory just written (still temporary).
        summary: the converter's summary (``quant``, ``bits``, ``requantized_tensors``).
        out: the directory the user asked for, named in errors.
    Returns:
        The verification record (also in ``written/manifest.json`` under "verify").
    Raises:
        OndeviceError: one line naming ``out`` when the output does not load, tokenizes differently from
            the source, has a tensor that is not the source's, or computes differently.
    """
    if to == "coreml":  # checked by converters.coreml itself (the MIL interpreter runs the saved program)
        check = summary.get("verified")  # kept too: scripts/macos_check.py reads it
        if check is None:
            return None
        result = {"runtime": "MIL interpreter (coremltools op semantics; Core ML itself needs macOS)",
                  "precision": summary.get("quant"), "passed": True, **check}
        record(written, result)
        return result
    if to == "gguf" and is_gguf_file(src):
        result = _requantized(src, written / "model.gguf", summary, out)
        record(written, result)
        return result
    fmt = "gguf" if to == "gguf" else "mlx"
    path = written / "model.gguf" if fmt == "gguf" else written
    level = precision(fmt, summary["quant"], summary.get("bits"))
    side = _gguf_source(src, path, summary, out) if is_gguf_file(src) else _hf_source(src, fmt, path, level, out)
    weights_record = side.pop("weights_record")
    if side["level"] is None:
        side["level"] = level
    result = verify_output(fmt, path, where=out, **side)
    result["weights"] = weights_record
    record(written, result)
    return result


def _hf_source(src: Path, fmt: str, path: Path, level: str, out: Path) -> dict:
    """The HF side: its tokenizer, mlx-lm float32 on its weights, and the written tensors against its own."""
    from converters import written as w
    from converters.hf import open_checkpoint
    from converters.tokenizer import read_hf_vocab

    ckpt = open_checkpoint(src)
    vocab = read_hf_vocab(ckpt.path, ckpt.vocab_size, ckpt.config)
    tok = f"{vocab.model}/{vocab.pre}" if vocab.model == "gpt2" else f"{vocab.model} (SentencePiece)"
    weights, bits = w.gguf_written(path, ckpt) if fmt == "gguf" else w.mlx_written(path)
    side = {"source_ids": hf_probe_ids(ckpt.path, vocab.add_bos, vocab.bos_id), "source_bos": vocab.add_bos,
            "reference": lambda ids: hf_reference_logits(ckpt.path, ids),
            "reference_name": "mlx-lm float32 (source weights)", "written": None, "level": None,
            "what": f"{fmt.upper()} model (arch {ckpt.arch}, tokenizer {tok})",
            "weights_record": w.weight_errors(weights, bits, ckpt.tensors(), out)}
    if level == "quantized":
        side["written"] = lambda ids: hf_reference_logits(ckpt.path, ids, weights)
    return side


def _gguf_source(src: Path, path: Path, summary: dict, out: Path) -> dict:
    """The GGUF side (GGUF → MLX): llama.cpp's tokenizer and forward pass, the written tensors against the
    GGUF's dequantized ones; requantized outputs are also judged on their own weights."""
    from converters import written as w
    from ondevice.formats.gguf import GGUFFile, float_tensors

    b = llama_backend(src, MAX_TOKENS)
    try:
        ids, bos = b.tokenize(PROBE, add_bos=True), bool(b.add_bos)
    finally:
        b.close()
    g = GGUFFile(src)
    weights, bits = w.mlx_written(path)
    side = {"source_ids": ids, "source_bos": bos, "reference": lambda ids: gguf_reference_logits(src, ids),
            "reference_name": "llama.cpp (source GGUF)", "written": None, "level": None,
            "what": f"MLX model (arch {g.arch}, from GGUF)",
            "weights_record": w.weight_errors(weights, bits, float_tensors(g), out)}
    if summary.get("requantized_tensors"):  # not lossless: judge the MLX kernels on their own weights too
        config = json.loads((path / "config.json").read_text())
        side["level"] = "quantized"
        side["written"] = lambda ids: mlx_float_logits(config, weights, ids)
    return side


def _requantized(src: Path, path: Path, summary: dict, out: Path) -> dict:
    """GGUF → GGUF (llama.cpp's quantizer): the output loads in llama.cpp and tokenizes the probe as the source
    does. Its logits were already compared with the source's by ``converters.quality.quality`` (top-1, KL),
    which is recorded, not gated: a requantization loses quality by design, and the user chose how much."""
    t0 = time.perf_counter()
    ids = {}
    for name, p in (("source", src), ("written", path)):
        try:
            b = llama_backend(p, MAX_TOKENS)
        except OndeviceError as e:
            raise OndeviceError(f"{out}: verification failed: llama.cpp cannot load the requantized file ({e}); "
                                "nothing was kept") from None
        try:
            ids[name] = (b.tokenize(PROBE, add_bos=True), bool(b.add_bos))
        finally:
            b.close()
    if ids["source"] != ids["written"]:
        raise OndeviceError(f"{out}: verification failed: the requantized file tokenizes the probe differently from "
                            f"{Path(src).name}; nothing was kept")
    return {"runtime": "llama.cpp", "precision": "requantized",
            "tokenizer": {"match": True, "probe_tokens": len(ids["source"][0]), "add_bos": ids["source"][1]},
            "source": {"reference": "llama.cpp (source GGUF)", **(summary.get("quality") or {})},
            "passed": True, "seconds": round(time.perf_counter() - t0, 3)}
