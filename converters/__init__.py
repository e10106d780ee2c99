"""Converters: weights in, quantized weights out (``ondevice convert``).

``convert`` is the one entry point; it dispatches on ``to`` and writes atomically into ``out``.
"""

from __future__ import annotations

import time
from pathlib import Path

from ondevice.errors import OndeviceError, shown

FORMATS = ("gguf", "mlx", "coreml")


def convert(
    src: str | Path,
    *,
    to: str = "gguf",
    out: str | Path,
    quant: str | None = None,
    bits: int = 4,
    group_size: int = 64,
    draft: str | Path | None = None,
    context: int = 512,
    compress: str = "int4",
    compute_units: str = "CPU_AND_NE",
    allow_requantize: bool = False,
    output_type: str | None = None,
    embedding_type: str | None = None,
    progress: bool = True,
    verify: bool = True,
    tokenizer_check: str = "warn",
    target: str | Path | None = None,
) -> dict:
    """Convert ``src`` (and optionally a ``draft``) into a new directory ``out``.

    Args:
        src: HF checkpoint directory, or a GGUF file (``to="gguf"`` requantizes it: converters.quantize).
        to: "gguf" | "mlx" | "coreml".
        out: a new directory; a pair writes ``out/target`` and ``out/draft``.
        quant: GGUF quantization: f16 | q8_0 | q4_0 | iq4_nl | q4_k_m (None: q4_k_m; a draft checkpoint, f16).
        allow_requantize: GGUF → GGUF from an already quantized file (stacks two quantizations; the quality
            cost against the source is measured and reported).
        output_type, embedding_type: GGUF: a ggml tensor type (q4_0, iq4_nl, q8_0, q6_k, ...) for the output
            projection / token embedding instead of llama.cpp's choice (``converters.quant_types.TENSOR_TYPES``).
        bits, group_size: MLX quantization.
        context, compress, compute_units: Core ML: cache slots (fixed at conversion), int4 | palettize4 | none,
            the compute units recorded in the package (CPU_AND_NE: Neural Engine).
        draft: a draft checkpoint to convert with the same settings, after checking its vocabulary.
        progress: show rich progress bars.
        verify: load each output in its runtime and compare it with the source before keeping it (the
            default, and what the CLI always does). Only random-weight timing models (``bench --synthetic``)
            skip it: their outputs mean nothing.
        tokenizer_check: "warn" | "strict": when transformers and the tokenizers library read an HF source's
            tokenizer differently (``converters.readings``), strict refuses before anything is written;
            warn converts and reports the strings that differ and which reading the output follows.
        target: with an EAGLE-3 draft checkpoint as ``src`` (``--to gguf``): the target it drafts for (HF
            directory or GGUF); the draft is written as GGUF arch eagle3 (``converters.eagle3``), its matrices
            f16 (``quant="f32"``: f32; an EAGLE-3 draft also ``q8_0`` / ``q4_0``, by llama.cpp's quantizer; any
            other ``quant`` is refused for a draft).
    Returns:
        A JSON-able summary (sizes, seconds, bits per weight, tensor types, fallbacks) with, per output,
        ``verify``: what loading it in its runtime and comparing with the source found (``converters.verify``),
        its ``cost``: {seconds, cpu_seconds, peak_rss_bytes}; ``tokenizer_check``: the readings' disagreement, if any.
    """
    from converters.output import atomic_dir, check_interrupted, check_out
    from converters.verify import verify_conversion
    from ondevice.store import lookup

    src, out = _source(lookup.resolve(src)), Path(out)  # a catalog name is accepted wherever a path is
    from converters.dflash import convert_dflash, is_dflash
    from converters.eagle3 import DTYPES as EAGLE3_DTYPES
    from converters.eagle3 import convert_eagle3, is_eagle3

    for is_draft, convert_draft, kind in ((is_dflash, convert_dflash, "a DFlash draft"),
                                          (is_eagle3, convert_eagle3, "an EAGLE-3 draft")):
        if is_draft(src):
            if to != "gguf" or target is None:
                raise OndeviceError(f"{shown(src)}: {kind}; convert it with --to gguf --target TARGET (the model it "
                                    "drafts for: HF directory or GGUF)")
            dtypes = EAGLE3_DTYPES if convert_draft is convert_eagle3 else ("f32", "f16")
            dtype = "f16" if quant is None else quant.lower()
            if dtype not in dtypes:
                raise OndeviceError(f"--quant {quant}: {kind} is written as {' | '.join(dtypes)} ({shown(src)}); "
                                    "pick one, or leave --quant out for f16")
            return convert_draft(src, target=_source(lookup.resolve(target)), out=out, dtype=dtype, verify=verify)
    if target is not None:
        raise OndeviceError(f"--target is for EAGLE-3 / DFlash drafts (a config.json with draft_vocab_size / "
                            f"dflash_config); {shown(src)} is not one")
    draft = _source(lookup.resolve(draft)) if draft is not None else None
    if to not in FORMATS:
        raise OndeviceError(f"--to {to}: unknown format; choose one of {', '.join(FORMATS)}")
    quant = "q4_k_m" if quant is None else quant
    if to == "gguf":
        from converters.quant_types import FTYPES

        quant = quant.lower()  # Q4_K_M as llama.cpp and file names spell it is the same format
        if quant not in FTYPES:
            raise OndeviceError(f"--quant {quant}: unknown; choose one of {', '.join(FTYPES)}")
        from converters.quant_types import check_tensor_types

        output_type, embedding_type = check_tensor_types(quant, output_type, embedding_type)
    elif output_type or embedding_type:
        raise OndeviceError(f"--output-type / --embedding-type are GGUF quantizer options; --to {to} does not take them")
    opts = {"quant": quant, "bits": bits, "group_size": group_size, "context": context, "compress": compress,
            "compute_units": compute_units, "allow_requantize": allow_requantize, "progress": progress,
            "output_type": output_type, "embedding_type": embedding_type}
    check_out(out)
    t0 = time.perf_counter()
    readings = {p: _readings(p, tokenizer_check, progress) for p in (src, draft) if p is not None}  # strict: refuse
    if draft is not None:
        from ondevice.formats.pairs import check_vocabs

        vt, vd = _vocab_of(src), _vocab_of(Path(draft))
        check_vocabs(vt, vd, src, draft)  # before anything is written
        with atomic_dir(out) as tmp:
            summary = {
                "target": _convert_one(src, to, tmp / "target", **opts),
                "draft": _convert_one(Path(draft), to, tmp / "draft", **opts),
            }
            check_interrupted()  # a Ctrl-C swallowed by a llama.cpp callback stops here, not after verifying
            if verify:
                for key, path in (("target", src), ("draft", Path(draft))):
                    r = readings[path]
                    summary[key]["verify"] = verify_conversion(path, to, tmp / key, summary[key], out / key,
                                                               r and r["readings"])
                    summary[key]["tokenizer_check"] = r and r["report"]
        summary["out"] = str(out)
    else:
        with atomic_dir(out) as tmp:
            summary = _convert_one(src, to, tmp, **opts)
            check_interrupted()  # a Ctrl-C swallowed by a llama.cpp callback stops here, not after verifying
            if verify:
                r = readings[src]
                summary["verify"] = verify_conversion(src, to, tmp, summary, out, r and r["readings"])
                summary["tokenizer_check"] = r and r["report"]
        summary["out"] = str(out)
    summary["seconds"] = round(time.perf_counter() - t0, 3)
    return summary


def _readings(src: Path, mode: str, loud: bool = True) -> dict | None:
    """An HF source's two tokenizer readings and what ``--tokenizer-check`` makes of them (strict: refuses
    here, before anything is written); None for a GGUF source (llama.cpp is its only reading)."""
    from converters.readings import check_readings
    from converters.verify import source_readings

    if mode not in ("warn", "strict"):
        raise OndeviceError(f"--tokenizer-check {mode}: choose warn or strict")
    if src.suffix == ".gguf" or not src.is_dir():
        return None
    readings = source_readings(src)
    report = check_readings(src, readings, mode)
    if report and loud:
        import sys

        print(f"warning: {src}: transformers and the tokenizers library disagree on {report['summary']}; "
              "converting (--tokenizer-check warn), the summary says which reading the output follows", file=sys.stderr)
    return {"readings": readings, "report": report}


def _source(path: Path) -> Path:
    """A GGUF output directory of ``ondevice convert`` (model.gguf + manifest.json, no config.json) stands for
    its model.gguf, as it does for ``ondevice run`` and ``info``."""
    if path.is_dir() and (path / "model.gguf").is_file() and not (path / "config.json").is_file():
        return path / "model.gguf"
    return path


def _vocab_of(path: Path) -> list[str]:
    if path.suffix == ".gguf":
        from ondevice.formats.pairs import gguf_tokens

        return gguf_tokens(path)
    from converters.hf import open_checkpoint
    from converters.tokenizer import read_hf_vocab

    ckpt = open_checkpoint(path)
    return read_hf_vocab(ckpt.path, ckpt.vocab_size, ckpt.config).tokens


def _convert_one(src: Path, to: str, out: Path, *, quant: str, bits: int, group_size: int, context: int,
                 compress: str, compute_units: str, allow_requantize: bool, progress: bool, output_type: str | None,
                 embedding_type: str | None) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    types = {"output_type": output_type, "embedding_type": embedding_type}
    if to == "gguf" and src.is_file():
        from converters.quantize import requantize

        return requantize(src, out, quant=quant, allow_requantize=allow_requantize, progress=progress, **types)
    if to == "gguf":
        from converters.to_gguf import hf_to_gguf

        return hf_to_gguf(src, out, quant=quant, progress=progress, **types)
    if to == "mlx":
        from converters.mlx import to_mlx

        return to_mlx(src, out, bits=bits, group_size=group_size, progress=progress)
    from converters.coreml import to_coreml

    return to_coreml(src, out, context=context, compress=compress, compute_units=compute_units, progress=progress)
