"""GGUF quantization with llama.cpp's own quantizer.

- ``llama_quantize``: one call of ``llama_model_quantize`` (F16 → q8_0 | q4_0 | iq4_nl | q4_k_m, or a
  quantized GGUF → another format with ``allow_requantize``), optionally with the output projection and
  the token embedding given their own tensor type (llama-quantize's ``--output-tensor-type`` /
  ``--token-embedding-type``: every format but q8_0 otherwise gives the output Q6_K, which x86 llama.cpp
  runs through vec-dot instead of the repacked GEMM kernels its Q4_0 / IQ4_NL / Q8_0 get).
- ``requantize``: GGUF → GGUF into a new directory (``ondevice convert SRC.gguf --to gguf --quant FMT``).
  Requantizing stacks two quantizations (llama.cpp dequantizes the source, then quantizes again), so it is
  refused without ``allow_requantize`` when the source is already quantized, refused outright when it would
  not lose bits, and its quality cost (``converters.quality``) is always measured against the source and reported.
Local variants of catalog models: ``converters.variants``; the type tables: ``converters.quant_types``.
"""

from __future__ import annotations

import ctypes
import os
import time
from collections import Counter
from pathlib import Path

from converters.quality import quality, report
from converters.quant_types import (
    FTYPES,
    LOW_BIT,
    QUANT_BITS,
    check_tensor_types,
    precision,
    tensor_types,
    weight_fallbacks,
)
from ondevice.errors import OndeviceError, shown


def _init():
    import llama_cpp

    from ondevice.backends.llama import init_llama

    init_llama()
    return llama_cpp


def llama_quantize(src: Path, dst: Path, quant: str, *, allow_requantize: bool = False, threads: int = 0,
                   output_type: str | None = None, embedding_type: str | None = None, name: str | None = None) -> None:
    """Quantize GGUF ``src`` into ``dst`` with llama.cpp's ``llama_model_quantize``.

    Args:
        src, dst: GGUF paths (``dst`` is overwritten).
        quant: a key of ``FTYPES`` other than f16.
        allow_requantize: let llama.cpp dequantize already-quantized tensors and quantize them again.
        threads: quantizer threads (0 = all cores).
        output_type, embedding_type: a ``TENSOR_TYPES`` name for the output projection (``output.weight``, or
            ``token_embd.weight`` when the two are tied) and for the token embedding; None: llama.cpp's choice.
        name: what error messages call the source (default: ``src``; a caller quantizing a temporary file names
            the file the user gave).
    """
    name = name or shown(src)
    if quant not in FTYPES or quant == "f16":
        raise OndeviceError(f"--quant {quant}: llama.cpp can quantize to {', '.join(q for q in FTYPES if q != 'f16')}")
    output_type, embedding_type = check_tensor_types(quant, output_type, embedding_type)
    if output_type and embedding_type and output_type != embedding_type:
        if "output.weight" not in tensor_types(src):  # llama.cpp would quietly give the tied tensor the embedding's
            raise OndeviceError(f"{name}: the output projection is the token embedding (tied weights); give it one type "
                                f"(--output-type {output_type} or --embedding-type {embedding_type}), not two")
    llama_cpp = _init()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[quant]
    params.nthread = threads
    params.allow_requantize = allow_requantize
    if output_type:
        params.output_tensor_type = getattr(llama_cpp, f"GGML_TYPE_{output_type.upper()}")
    if embedding_type:
        params.token_embedding_type = getattr(llama_cpp, f"GGML_TYPE_{embedding_type.upper()}")
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    from converters.output import check_interrupted

    check_interrupted()  # a Ctrl-C that landed in llama.cpp's log callback was swallowed there
    if rc != 0:
        raise OndeviceError(f"{name}: llama_model_quantize to {quant} failed (code {rc})")


def check_requantize(src: Path, quant: str, allow_requantize: bool) -> tuple[dict, str | None]:
    """Decide whether ``src`` may be requantized to ``quant``.

    Returns:
        (the source's precision, a warning to print or None).
    Raises:
        OndeviceError: the target has more bits than the (quantized) source (a bigger file, no precision
            back), or the source is quantized and ``allow_requantize`` is off. Same-bits requantization is
            allowed with consent: its point is a layout that verifies cheaply (Q4_K → Q4_0 / IQ4_NL).
    """
    prec = precision(src)
    src_bits = prec["bits_per_weight"]
    main = ", ".join(f"{k}×{v}" for k, v in sorted(prec["types"].items(), key=lambda kv: -kv[1])[:3])
    if prec["quantized"] and QUANT_BITS[quant] > src_bits + 0.25:
        raise OndeviceError(
            f"{shown(src)}: already {src_bits:.2f} bits per weight ({main}); {quant} ({QUANT_BITS[quant]:.1f} bits) would grow "
            "the file without restoring the precision lost; convert from the original f16/HF weights instead")
    if not prec["quantized"]:
        return prec, None
    if not allow_requantize:
        raise OndeviceError(
            f"{shown(src)}: already quantized ({src_bits:.2f} bits per weight: {main}); requantizing to {quant} stacks two "
            "quantizations; pass --allow-requantize to do it anyway (the quality cost is measured and printed)")
    warn = (f"{src.name} is already quantized ({src_bits:.2f} bits per weight: {main}); {quant} stacks a second "
            "quantization on it")
    if src_bits <= LOW_BIT:
        warn += " of an already low-bit file: check the quality numbers below before using it"
    return prec, warn


def requantize_file(src: Path, dst: Path, quant: str, *, allow_requantize: bool = False, measure: bool = True,
                    reference: Path | None = None, threads: int | None = None, output_type: str | None = None,
                    embedding_type: str | None = None, quantize_from: Path | None = None) -> dict:
    """Requantize GGUF ``src`` to ``dst`` (written beside it as a temp file, then renamed) and measure it.

    Args:
        reference: judge quality against this file instead of ``src`` (a more precise source when one exists).
        output_type, embedding_type: tensor types for the output projection / token embedding (``llama_quantize``).
        quantize_from: hand the quantizer this file instead of ``src``: ``src`` already quantized to ``quant``
            by the same quantizer, whose tensors of the asked type are copied, so only the others are redone
            (the same bytes, in seconds). Checks and the summary still describe ``src``.
    Returns:
        Summary: source precision, warning, sizes, tensor types, quality (if ``measure``), seconds.
    """
    from ondevice.formats.gguf import check_gguf_file

    src, dst = Path(src), Path(dst)
    output_type, embedding_type = check_tensor_types(quant, output_type, embedding_type)
    check_gguf_file(src)
    prec, warning = check_requantize(src, quant, allow_requantize)
    t0 = time.perf_counter()
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.partial")
    try:
        llama_quantize(quantize_from or src, tmp, quant, allow_requantize=prec["quantized"], threads=threads or 0,
                       output_type=output_type, embedding_type=embedding_type)
        os.replace(tmp, dst)
    finally:
        tmp.unlink(missing_ok=True)
    out_prec = precision(dst)
    types_by_name = tensor_types(dst)
    asked = {t.upper() for t in (output_type, embedding_type) if t}
    wider = weight_fallbacks(types_by_name, quant, asked)
    if prec["quantized"] and out_prec["bits_per_weight"] > prec["bits_per_weight"] + 0.05 and (wider or not asked):
        kinds = ", ".join(f"{t}×{c}" for t, c in Counter(wider.values()).most_common(3)) or "wider types"
        warning = (f"{warning}; " if warning else "") + (
            f"the output has more bits per weight than the source ({prec['bits_per_weight']:.2f} → "
            f"{out_prec['bits_per_weight']:.2f}): llama.cpp fell back to {kinds} for tensors whose rows are not a "
            f"multiple of the {quant} block size; the file grows and gains no precision")
    summary = {"format": "gguf", "quant": quant, "output_type": output_type, "embedding_type": embedding_type,
               "source": str(src), "source_bits_per_weight": prec["bits_per_weight"],
               "source_types": prec["types"], "requantized": prec["quantized"], "warning": warning,
               "size_bytes": dst.stat().st_size, "source_size_bytes": src.stat().st_size,
               "bits_per_weight": out_prec["bits_per_weight"], "tensor_types": out_prec["types"],
               "fallbacks": wider, "tensor_types_by_name": types_by_name, "seconds": round(time.perf_counter() - t0, 3)}
    if measure:
        summary["quality"] = quality(dst, reference or src, threads=threads)
    return summary


def requantize(src: Path, out: Path, *, quant: str, allow_requantize: bool = False, reference: Path | None = None,
               output_type: str | None = None, embedding_type: str | None = None, progress: bool = True) -> dict:
    """``ondevice convert SRC.gguf --to gguf --quant FMT [--output-type T] --out DIR``: ``DIR/model.gguf`` +
    manifest + quality.

    The warning and the measured quality cost are printed to stderr (unless ``progress`` is off) and
    recorded in ``DIR/manifest.json``.
    """
    from converters.output import write_manifest
    from ondevice.store.fetch import sha256_file

    summary = requantize_file(src, out / "model.gguf", quant, allow_requantize=allow_requantize, reference=reference,
                              output_type=output_type, embedding_type=embedding_type)
    types = summary.pop("tensor_types_by_name")
    write_manifest(out, {"source": str(Path(src).resolve()), "source_sha256": sha256_file(Path(src)), "format": "gguf",
                         "quant": quant, "output_type": summary["output_type"],
                         "embedding_type": summary["embedding_type"], "requantized_from": summary["source_types"],
                         "quality": summary["quality"], "tensor_types": types})
    if progress:
        report(summary)
    summary["path"] = "model.gguf"
    return summary
