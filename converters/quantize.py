"""GGUF quantization with llama.cpp's own quantizer, and what it costs in quality.

Three jobs:
- ``llama_quantize``: one call of ``llama_model_quantize`` (F16 → q8_0 | q4_0 | iq4_nl | q4_k_m, or a
  quantized GGUF → another format with ``allow_requantize``), optionally with the output projection and
  the token embedding given their own tensor type (llama-quantize's ``--output-tensor-type`` /
  ``--token-embedding-type``: every format but q8_0 otherwise gives the output Q6_K, which x86 llama.cpp
  runs through vec-dot instead of the repacked GEMM kernels its Q4_0 / IQ4_NL / Q8_0 get).
- ``requantize``: GGUF → GGUF into a new directory (``ondevice convert SRC.gguf --to gguf --quant FMT``).
  Requantizing stacks two quantizations (llama.cpp dequantizes the source, then quantizes again), so it is
  refused without ``allow_requantize`` when the source is already quantized, refused outright when it would
  not lose bits, and its quality cost is always measured against the source and reported.
- ``pull_variant``: a locally requantized copy of a catalog model, cached beside the published file and
  recorded with the source's sha256 (``ondevice pull NAME --quant FMT [--output-type TYPE]``, named
  ``NAME:FMT`` or ``NAME:FMT+out-TYPE``: ``catalog.variant_tag``); never presented as published.

Quality is teacher-forced: both models read the same held-back text in one pass; we report the share
of positions where their top-1 tokens agree and the mean KL(source ‖ candidate) of the next-token
distributions.
"""

from __future__ import annotations

import ctypes
import os
import time
from collections import Counter
from pathlib import Path

import numpy as np

from ondevice.errors import OndeviceError

# --quant name → llama_ftype (llama.h). f16 is written directly by gguf, never by the quantizer.
FTYPES = {"f16": 1, "q8_0": 7, "q4_0": 2, "iq4_nl": 25, "q4_k_m": 15}
# a format name → the tensor type most of its weights get (q4_1 / q5_0: published files we only read)
MAIN_TYPE = {"f16": "F16", "q8_0": "Q8_0", "q4_0": "Q4_0", "iq4_nl": "IQ4_NL", "q4_k_m": "Q4_K", "q4_1": "Q4_1",
             "q5_0": "Q5_0"}
# Bits per weight of each GGML tensor type (block scales included).
TYPE_BITS = {"F32": 32.0, "F16": 16.0, "BF16": 16.0, "Q8_0": 8.5, "Q6_K": 6.5625, "Q5_1": 6.0, "Q5_0": 5.5,
             "Q5_K": 5.5, "Q4_1": 5.0, "Q4_0": 4.5, "IQ4_NL": 4.5, "Q4_K": 4.5, "IQ4_XS": 4.25, "Q3_K": 3.4375,
             "IQ3_S": 3.4375, "IQ3_XXS": 3.0625, "Q2_K": 2.625, "IQ2_XS": 2.3125, "IQ2_XXS": 2.0625,
             "IQ1_S": 1.5625}
# Nominal bits per weight of the main type of each --quant.
QUANT_BITS = {q: TYPE_BITS[MAIN_TYPE[q]] for q in FTYPES}
LOW_BIT = 6.0  # a source at or below this many bits per weight is "already low-bit"
# ggml tensor types that --output-type / --embedding-type take (llama_cpp.GGML_TYPE_<NAME>); the types below
# 4 bits that need an importance matrix, and the integer / intermediate types, are left out.
TENSOR_TYPES = ("f32", "f16", "bf16", "q8_0", "q6_k", "q5_k", "q5_1", "q5_0", "q4_k", "q4_1", "q4_0", "iq4_nl",
                "iq4_xs", "q3_k", "q2_k")

# The held-back text for quality checks: not in the benchmark prompts; prose, code and a list.
HELD_OUT_TEXT = """\
The lighthouse keeper kept a ledger of every ship that passed, the hour, the wind and the state of the sea.
In winter the entries grew short: fog, no ships, fog again. In spring they grew long and careful, because the
fishing fleet came back and every boat had to be counted home before the lamp could be trimmed for the night.

def merge_intervals(intervals):
    \"\"\"Merge overlapping [start, end] intervals; returns a new sorted list.\"\"\"
    out = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return out

Steps to re-pot a plant: water it the day before; loosen the root ball with your fingers; choose a pot one size
larger with a drainage hole; add fresh soil to the bottom, set the plant at the same depth as before, fill the
sides, press gently and water until it drains. Keep it out of direct sun for a week while the roots settle.
"""


def _init():
    import llama_cpp

    from ondevice.backends.llama import init_llama

    init_llama()
    return llama_cpp


def check_tensor_types(quant: str, output_type: str | None, embedding_type: str | None) -> tuple[str | None, str | None]:
    """Validate ``--output-type`` / ``--embedding-type`` for ``--quant quant``; returns them lower-cased.

    Raises:
        OndeviceError (one line): an unknown type name (the accepted ones listed), or a type asked for a
            format llama.cpp's quantizer does not write (f16 is written directly, tensor by tensor).
    """
    out = []
    for flag, t in (("--output-type", output_type), ("--embedding-type", embedding_type)):
        if t is not None and t.lower() not in TENSOR_TYPES:
            raise OndeviceError(f"{flag} {t}: unknown tensor type; choose one of {', '.join(TENSOR_TYPES)}")
        out.append(t.lower() if t is not None else None)
    if any(out) and (quant not in FTYPES or quant == "f16"):
        raise OndeviceError(f"--output-type / --embedding-type need a quantized --quant "
                            f"({', '.join(q for q in FTYPES if q != 'f16')}), not {quant}")
    return out[0], out[1]


def llama_quantize(src: Path, dst: Path, quant: str, *, allow_requantize: bool = False, threads: int = 0,
                   output_type: str | None = None, embedding_type: str | None = None) -> None:
    """Quantize GGUF ``src`` into ``dst`` with llama.cpp's ``llama_model_quantize``.

    Args:
        src, dst: GGUF paths (``dst`` is overwritten).
        quant: a key of ``FTYPES`` other than f16.
        allow_requantize: let llama.cpp dequantize already-quantized tensors and quantize them again.
        threads: quantizer threads (0 = all cores).
        output_type, embedding_type: a ``TENSOR_TYPES`` name for the output projection (``output.weight``, or
            ``token_embd.weight`` when the two are tied) and for the token embedding; None: llama.cpp's choice.
    """
    if quant not in FTYPES or quant == "f16":
        raise OndeviceError(f"--quant {quant}: llama.cpp can quantize to {', '.join(q for q in FTYPES if q != 'f16')}")
    output_type, embedding_type = check_tensor_types(quant, output_type, embedding_type)
    if output_type and embedding_type and output_type != embedding_type:
        from converters.gguf_writer import tensor_types

        if "output.weight" not in tensor_types(src):  # llama.cpp would quietly give the tied tensor the embedding's
            raise OndeviceError(f"{src}: the output projection is the token embedding (tied weights); give it one type "
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
        raise OndeviceError(f"{src}: llama_model_quantize to {quant} failed (code {rc})")


def precision(path: Path) -> dict:
    """Bits per weight of a GGUF's 2-D weights (parameter-weighted) and the count of each tensor type."""
    from ondevice.formats.gguf_reader import GGUFFile

    reader = GGUFFile(path).reader  # a truncated or corrupt file: one line naming it
    bits, n, types = 0.0, 0, Counter()
    for t in reader.tensors:
        if len(t.shape) < 2:
            continue
        name = t.tensor_type.name
        types[name] += 1
        size = int(np.prod([int(x) for x in t.shape]))
        bits += TYPE_BITS.get(name, 16.0) * size
        n += size
    bpw = bits / n if n else 0.0
    return {"bits_per_weight": round(bpw, 3), "types": dict(types),
            "quantized": any(k not in ("F32", "F16", "BF16") for k in types)}


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
            f"{src}: already {src_bits:.2f} bits per weight ({main}); {quant} ({QUANT_BITS[quant]:.1f} bits) would grow "
            "the file without restoring the precision lost; convert from the original f16/HF weights instead")
    if not prec["quantized"]:
        return prec, None
    if not allow_requantize:
        raise OndeviceError(
            f"{src}: already quantized ({src_bits:.2f} bits per weight: {main}); requantizing to {quant} stacks two "
            "quantizations; pass --allow-requantize to do it anyway (the quality cost is measured and printed)")
    warn = (f"{src.name} is already quantized ({src_bits:.2f} bits per weight: {main}); {quant} stacks a second "
            "quantization on it")
    if src_bits <= LOW_BIT:
        warn += " of an already low-bit file: check the quality numbers below before using it"
    return prec, warn


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x -= x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def _logits_on(path: Path, ids: list[int] | None, text: str, n_tokens: int, threads: int | None):
    from ondevice.backends import open_backend

    b = open_backend(path, n_ctx=n_tokens + 16, threads=threads)
    try:
        if ids is None:
            ids = b.tokenize(text)[:n_tokens]
        return ids, b.eval(ids), b.vocab_size
    finally:
        b.close()


def quality(candidate: Path, reference: Path, *, text: str = HELD_OUT_TEXT, n_tokens: int = 256,
            threads: int | None = None) -> dict:
    """Teacher-forced agreement of ``candidate`` with ``reference`` on ``text``.

    Args:
        candidate, reference: GGUF files of one model (same tokenizer).
        text: the held-back text both read (tokenized by the reference).
        n_tokens: at most this many tokens of it.
    Returns:
        {"top1_agreement", "mean_kl", "max_kl", "tokens", "reference"}: KL(reference ‖ candidate) in nats
        per position, averaged over every position of the text.
    """
    ids, ref, v_ref = _logits_on(Path(reference), None, text, n_tokens, threads)
    if len(ids) < 2:
        raise OndeviceError("quality text is too short: it needs at least 2 tokens")
    _, cand, v_cand = _logits_on(Path(candidate), ids, text, n_tokens, threads)
    if v_ref != v_cand:
        raise OndeviceError(f"{candidate} and {reference} have different vocabularies ({v_cand} vs {v_ref} tokens)")
    agree, kls = 0, []
    for s in range(0, len(ids), 32):  # rows [32, V] at a time: float64 over a 150k vocabulary is large
        lp, lq = _log_softmax(ref[s : s + 32]), _log_softmax(cand[s : s + 32])
        kls.extend((np.exp(lp) * (lp - lq)).sum(axis=-1).tolist())
        agree += int((lp.argmax(-1) == lq.argmax(-1)).sum())
    return {"top1_agreement": round(agree / len(ids), 4), "mean_kl": round(float(np.mean(kls)), 5),
            "max_kl": round(float(np.max(kls)), 4), "tokens": len(ids), "reference": str(reference)}


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
    from converters.gguf_writer import fallbacks, tensor_types
    from ondevice.backends.llama import check_gguf_file

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
    wider = {n: t for n, t in fallbacks(types_by_name, quant, asked).items() if t in TYPE_BITS}
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
    from ondevice.catalog import sha256_file

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


def report(summary: dict) -> None:
    """Print the warning (if any) and the quality cost of a requantization on stderr."""
    from rich.console import Console
    from rich.markup import escape

    # soft_wrap: one line per message whatever the width (a pipe is 80 columns); escape: a "[" in a path is text
    con = Console(stderr=True, highlight=False, soft_wrap=True)
    if summary.get("warning"):
        con.print(f"[yellow]warning:[/yellow] {escape(summary['warning'])}")
    q = summary.get("quality")
    if q:
        con.print(escape(f"quality vs {Path(q['reference']).name} on {q['tokens']} held-back tokens: top-1 agreement "
                         f"{q['top1_agreement']:.1%}, mean KL {q['mean_kl']:.4f} nats (max {q['max_kl']:.2f}); "
                         f"{summary['source_bits_per_weight']:.2f} → {summary['bits_per_weight']:.2f} bits per weight"))


def _copy_source(published: Path, plain: Path, output_type: str | None, embedding_type: str | None) -> Path | None:
    """``plain`` (the recorded ``FMT`` variant of ``published``) when quantizing from it gives the very bytes
    quantizing ``published`` would: the tensors whose type is asked are verbatim copies of the published ones
    there (llama.cpp copies a tensor already of its new type, so the rest come out as in ``plain``); else None.
    """
    from converters.gguf_writer import tensor_types

    pub, var = tensor_types(published), tensor_types(plain)
    names = {"token_embd.weight"} if embedding_type else set()
    if output_type:
        names.add("output.weight" if "output.weight" in pub else "token_embd.weight")  # tied: the embedding
    return plain if all(n in pub and pub[n] == var.get(n) for n in names) else None


def pull_variant(name: str, quant: str, *, output_type: str | None = None, embedding_type: str | None = None,
                 force: bool = False, quiet: bool = False) -> Path:
    """``ondevice pull NAME --quant FMT [--output-type T] [--embedding-type T]``: requantize a pulled catalog
    model locally, once, and cache it.

    The variant lives beside the published file (``catalog.variant_path``) with a JSON record naming the
    published file and its sha256, the quantizer, the tensor types asked and the measured quality; it is
    never presented as the published file (``resolve(NAME)`` still returns that; ``resolve("NAME:FMT")``, or
    ``"NAME:FMT+out-T"`` with an output type (``catalog.variant_tag``), returns the variant). With a type
    asked and the plain ``NAME:FMT`` variant cached, the quantizer reads that one (same bytes, in seconds).
    """
    from ondevice import catalog

    quant = quant.lower()  # as resolve("NAME:IQ4_NL") reads it

    pair = catalog.resolve_pair(name)
    if pair:
        raise OndeviceError(f"{name} is a pair: requantize each model, `ondevice pull {pair[0]} --quant {quant}` and "
                            f"`ondevice pull {pair[1]} --quant {quant}`")
    entry = catalog.get(name)
    if quant not in FTYPES or quant == "f16":
        raise OndeviceError(f"--quant {quant}: choose one of {', '.join(q for q in FTYPES if q != 'f16')}")
    output_type, embedding_type = check_tensor_types(quant, output_type, embedding_type)
    tag = catalog.variant_tag(quant, output_type, embedding_type)
    src = catalog.pull(name, quiet=quiet)
    dest = catalog.variant_path(entry, tag)
    if not force and catalog.variant_record(entry, tag) is not None:
        return dest
    import llama_cpp

    from converters.output import check_interrupted, sigint_remembered

    via = _copy_source(src, catalog.variant_path(entry, quant), output_type, embedding_type) if (
        tag != quant and catalog.variant_record(entry, quant) is not None) else None
    dest.parent.mkdir(parents=True, exist_ok=True)
    # written and measured under a temp name, renamed and recorded last: a failure or Ctrl-C leaves nothing
    tmp = dest.with_name(f".{dest.stem}.{os.getpid()}.measuring.gguf")
    try:
        with sigint_remembered():
            summary = requantize_file(src, tmp, quant, allow_requantize=True, reference=src, output_type=output_type,
                                      embedding_type=embedding_type, quantize_from=via)
            check_interrupted()
            os.replace(tmp, dest)
            catalog.record_variant(entry, tag, {
                "published": False, "source_model": entry.name, "source_file": entry.filename,
                "source_sha256": entry.sha256, "source_quant": entry.quant, "quant": quant,
                "output_type": output_type, "embedding_type": embedding_type, "variant": f"{entry.name}:{tag}",
                "quantizer": f"llama_model_quantize (llama-cpp-python {llama_cpp.__version__}, allow_requantize)",
                "quantized_from": via.name if via else entry.filename,
                "bits_per_weight": summary["bits_per_weight"], "tensor_types": summary["tensor_types"],
                "quality": summary["quality"], "warning": summary["warning"]})
    finally:
        tmp.unlink(missing_ok=True)
    if not quiet:
        report(summary)
        from rich.console import Console
        from rich.markup import escape

        Console(stderr=True, soft_wrap=True).print(f"[green]✓[/green] {escape(f'{entry.name}:{tag}')} (local "
                                                   f"requantization, not the published file) → {escape(str(dest))}")
    return dest
