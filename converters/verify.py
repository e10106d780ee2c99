"""Verify a conversion in the runtime that will run it: load, tokenize a probe, teacher-force it.

Every ``ondevice convert`` ends here, before its output directory is renamed into place:

1. the output is loaded by its own backend (llama.cpp for GGUF, mlx-lm for MLX);
2. a multilingual probe (accents, CJK, emoji, digits, code, leading spaces, newlines) is tokenized by
   the output and by the source tokenizer (transformers' and the ``tokenizers`` library's readings of
   an HF source, ``converters.readings``; llama.cpp for a GGUF source): the output must follow one of
   them, and the record says which, and where the readings differ;
3. every written tensor, read back and dequantized one at a time, must be within its type's rounding of
   the source tensor (``converters.written``: catches swapped, transposed or mis-permuted tensors);
4. the probe ids are teacher-forced through the output in its runtime, through a numpy float32 pass on
   its written weights and through the source's own forward pass (numpy float32 from the memory-mapped
   HF weights, or llama.cpp on a GGUF source), all streamed layer by layer (``converters.check``):
   top-1 agreement and max |Δlogit| / max |logit| are recorded and gated by THRESHOLDS.

A failure raises ``OndeviceError`` (one line), so nothing is left behind. Hooks for other converters
(Core ML): ``PROBE``, ``hf_probe_ids``, ``hf_reference_logits`` (mlx-lm's forward of the source),
``compare`` and ``check`` (a one-line error when the logits disagree).
"""

from __future__ import annotations

import time
from pathlib import Path

from converters.probe import (
    MAX_TOKENS,
    PROBE,
    hf_probe_ids,
    hf_reference_logits,
    llama_backend,
    precision,
    record,
    verify_output,
)
from ondevice.backends import is_gguf_file
from ondevice.errors import OndeviceError, shown


def verify_conversion(src: Path, to: str, written: Path, summary: dict, out: Path, readings: dict | None = None) -> dict | None:
    """Verify ``written`` (a GGUF or MLX output of ``src``) in its runtime; record it in its manifest.json.

    Args:
        src: the source (HF checkpoint directory or GGUF file).
        to: "gguf" | "mlx" | "coreml" (Core ML is checked by ``converters.coreml``; here its record is kept).
        written: the directory just written (still temporary).
        summary: the converter's summary (``quant``, ``bits``, ``requantized_tensors``).
        out: the directory the user asked for, named in errors.
        readings: an HF source's tokenizer readings (``converters.readings.hf_readings``; read here if None).
    Returns:
        The verification record (also in ``written/manifest.json`` under "verify"), with ``cost``: its
        wall time, CPU time and peak private memory (``converters.memwatch``).
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
    from converters.check import check_gguf_to_mlx, check_hf, timed

    if to == "gguf" and is_gguf_file(src):
        result, cost = timed(_requantized, src, written / "model.gguf", summary, out)
    else:
        fmt = "gguf" if to == "gguf" else "mlx"
        path = written / "model.gguf" if fmt == "gguf" else written
        level = precision(fmt, summary["quant"], summary.get("bits"))
        if is_gguf_file(src):
            result, cost = timed(check_gguf_to_mlx, src, path, summary, out)
        else:
            if readings is None:
                readings = source_readings(src)
            result, cost = timed(check_hf, src, fmt, path, level, out, readings)
            if result is None:  # an architecture the numpy decoder does not run (gemma3): mlx-lm float32
                result, cost = timed(_mlx_lm_check, src, fmt, path, level, out)
    result["cost"] = cost
    record(written, result)
    return result


def source_readings(src: Path) -> dict:
    """An HF source's tokenizer readings (transformers and tokenizers), with its BOS facts."""
    from converters.hf import open_checkpoint
    from converters.readings import hf_readings
    from converters.tokenizer import read_hf_vocab

    ckpt = open_checkpoint(src)
    vocab = read_hf_vocab(ckpt.path, ckpt.vocab_size, ckpt.config)
    return hf_readings(ckpt.path, vocab.add_bos, vocab.bos_id)


def _mlx_lm_check(src: Path, fmt: str, path: Path, level: str, out: Path) -> dict:
    """The whole-model check (mlx-lm float32 on the source's and the written weights) for architectures the
    numpy decoder does not run; its memory grows with the model (two float32 copies)."""
    from converters import written as w
    from converters.hf import open_checkpoint
    from converters.lazy import hf_weights
    from converters.tokenizer import read_hf_vocab

    ckpt = open_checkpoint(src)
    vocab = read_hf_vocab(ckpt.path, ckpt.vocab_size, ckpt.config)
    tok = f"{vocab.model}/{vocab.pre}" if vocab.model == "gpt2" else f"{vocab.model} (SentencePiece)"
    lazy, bits = w.gguf_written(path, ckpt) if fmt == "gguf" else w.mlx_written(path)
    tensors = w.TensorCheck(hf_weights(ckpt.path)[1], bits, out)
    weights_record = tensors.finish(lazy)
    weights = {k: lazy[k] for k in lazy}
    side = {"source_ids": hf_probe_ids(ckpt.path, vocab.add_bos, vocab.bos_id), "source_bos": vocab.add_bos,
            "reference": lambda ids: hf_reference_logits(ckpt.path, ids),
            "reference_name": "mlx-lm float32 (source weights)", "level": level,
            "what": f"{fmt.upper()} model (arch {ckpt.arch}, tokenizer {tok})",
            "written": (lambda ids: hf_reference_logits(ckpt.path, ids, weights)) if level == "quantized" else None}
    result = verify_output(fmt, path, where=out, **side)
    result["weights"] = weights_record
    return result


def _requantized(src: Path, path: Path, summary: dict, out: Path) -> dict:
    """GGUF → GGUF (llama.cpp's quantizer): the output loads in llama.cpp and tokenizes the probe as the source
    does. Its logits were already compared with the source's by ``converters.quantize.quality`` (top-1, KL),
    which is recorded, not gated: a requantization loses quality by design, and the user chose how much."""
    t0 = time.perf_counter()
    ids = {}
    for name, p in (("source", src), ("written", path)):
        try:
            b = llama_backend(p, MAX_TOKENS)
        except OndeviceError as e:
            raise OndeviceError(f"{shown(out)}: verification failed: llama.cpp cannot load the requantized file ({e}); "
                                "nothing was kept") from None
        try:
            ids[name] = (b.tokenize(PROBE, add_bos=True), bool(b.add_bos))
        finally:
            b.close()
    if ids["source"] != ids["written"]:
        raise OndeviceError(f"{shown(out)}: verification failed: the requantized file tokenizes the probe differently from "
                            f"{Path(src).name}; nothing was kept")
    return {"runtime": "llama.cpp", "precision": "requantized",
            "tokenizer": {"match": True, "probe_tokens": len(ids["source"][0]), "add_bos": ids["source"][1]},
            "source": {"reference": "llama.cpp (source GGUF)", **(summary.get("quality") or {})},
            "passed": True, "seconds": round(time.perf_counter() - t0, 3)}
