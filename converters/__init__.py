"""Converters: weights in, quantized weights out (``ondevice convert``).

``convert`` is the one entry point; it dispatches on ``to`` and writes atomically into ``out``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from ondevice.errors import OndeviceError

FORMATS = ("gguf", "mlx", "coreml")


def convert(
    src: str | Path,
    *,
    to: str = "gguf",
    out: str | Path,
    quant: str = "q4_k_m",
    bits: int = 4,
    group_size: int = 64,
    draft: str | Path | None = None,
    context: int = 512,
    compress: str = "int4",
    compute_units: str = "CPU_AND_NE",
    progress: bool = True,
) -> dict:
    """Convert ``src`` (and optionally a ``draft``) into a new directory ``out``.

    Args:
        src: HF checkpoint directory, or a GGUF file for ``to="mlx"`` / ``to="coreml"``.
        to: "gguf" | "mlx" | "coreml".
        out: a new directory; a pair writes ``out/target`` and ``out/draft``.
        quant: GGUF quantization: f16 | q8_0 | q4_0 | q4_k_m.
        bits, group_size: MLX quantization.
        context, compress, compute_units: Core ML: cache slots (fixed at conversion), int4 | palettize4 | none,
            the compute units recorded in the package (CPU_AND_NE: Neural Engine).
        draft: a draft checkpoint to convert with the same settings, after checking its vocabulary.
        progress: show rich progress bars.
    Returns:
        A JSON-able summary (sizes, seconds, bits per weight, tensor types, fallbacks).
    """
    from converters.output import atomic_dir, check_out
    from ondevice import catalog

    src, out = catalog.resolve(src), Path(out)  # a catalog name is accepted wherever a path is
    draft = catalog.resolve(draft) if draft is not None else None
    if to not in FORMATS:
        raise OndeviceError(f"--to {to}: unknown format; choose one of {', '.join(FORMATS)}")
    if to == "gguf":
        from converters.gguf_writer import QUANTS

        if quant not in QUANTS:
            raise OndeviceError(f"--quant {quant}: unknown; choose one of {', '.join(QUANTS)}")
    opts = {"quant": quant, "bits": bits, "group_size": group_size, "context": context, "compress": compress,
            "compute_units": compute_units, "progress": progress}
    check_out(out)
    t0 = time.perf_counter()
    if draft is not None:
        from ondevice.formats.pairs import check_vocabs

        vt, vd = _vocab_of(src), _vocab_of(Path(draft))
        check_vocabs(vt, vd, src, draft)  # before anything is written
        with atomic_dir(out) as tmp:
            summary = {
                "target": _convert_one(src, to, tmp / "target", **opts),
                "draft": _convert_one(Path(draft), to, tmp / "draft", **opts),
            }
            summary["target"]["verify"] = verify_conversion(src, to, tmp / "target", summary["target"], out / "target")
            summary["draft"]["verify"] = verify_conversion(Path(draft), to, tmp / "draft", summary["draft"], out / "draft")
        summary["out"] = str(out)
    else:
        with atomic_dir(out) as tmp:
            summary = _convert_one(src, to, tmp, **opts)
            summary["verify"] = verify_conversion(src, to, tmp, summary, out)
        summary["out"] = str(out)
    summary["seconds"] = round(time.perf_counter() - t0, 3)
    return summary


def verify_conversion(src: Path, to: str, written: Path, summary: dict, out: Path) -> dict | None:
    """Verify ``written`` (a GGUF or MLX output of ``src``) in its runtime, record it in its manifest.json.

    Core ML outputs are verified by ``converters.coreml`` itself (its program, interpreted); here: None.
    Raises:
        OndeviceError: one line naming ``out`` when the output does not load, tokenizes differently from
            the source, has a tensor that is not the source's, or computes differently (``converters.verify``).
    """
    if to == "coreml":
        return None
    from converters import verify as v
    from ondevice.backends import is_gguf_file

    fmt = "gguf" if to == "gguf" else "mlx"
    path = written / "model.gguf" if fmt == "gguf" else written
    level = v.precision(fmt, summary["quant"], summary.get("bits"))
    weights_record, written_logits = None, None
    if is_gguf_file(src):  # GGUF → MLX: the source's own runtime is llama.cpp
        b = v.llama_backend(src, v.MAX_TOKENS)
        try:
            ids, bos = b.tokenize(v.PROBE, add_bos=True), bool(b.add_bos)
        finally:
            b.close()
        reference, reference_name = (lambda ids: v.gguf_reference_logits(src, ids)), "llama.cpp (source GGUF)"
        what = "MLX model"
        from converters import written as w
        from ondevice.formats.gguf_reader import GGUFFile, float_tensors

        weights, bits = w.mlx_written(path)
        weights_record = w.weight_errors(weights, bits, float_tensors(GGUFFile(src)), out)
        if summary.get("requantized_tensors"):  # not lossless: judge the MLX kernels on their own weights
            level, config = "quantized", json.loads((path / "config.json").read_text())

            def written_logits(ids):
                return v.mlx_float_logits(config, weights, ids)
    else:
        from converters import written as w
        from converters.hf import open_checkpoint
        from converters.tokenizer import read_hf_vocab

        ckpt = open_checkpoint(src)
        vocab = read_hf_vocab(ckpt.path, ckpt.vocab_size, ckpt.config)
        ids, bos = v.hf_probe_ids(ckpt.path, vocab.add_bos, vocab.bos_id), vocab.add_bos
        reference, reference_name = (lambda ids: v.hf_reference_logits(ckpt.path, ids)), "mlx-lm float32 (source weights)"
        tok = f"{vocab.model}/{vocab.pre}" if vocab.model == "gpt2" else f"{vocab.model} (SentencePiece)"
        what = f"{fmt.upper()} model (arch {ckpt.arch}, tokenizer {tok})"
        weights, bits = w.gguf_written(path, ckpt) if fmt == "gguf" else w.mlx_written(path)
        weights_record = w.weight_errors(weights, bits, ckpt.tensors(), out)
        if level == "quantized":
            def written_logits(ids):
                return v.hf_reference_logits(ckpt.path, ids, weights)
        else:
            del weights
    result = v.verify_output(fmt, path, where=out, source_ids=ids, source_bos=bos, level=level, reference=reference,
                             reference_name=reference_name, written=written_logits, what=what)
    if weights_record:
        result["weights"] = weights_record
    v.record(written, result)
    return result


def _vocab_of(path: Path) -> list[str]:
    if path.suffix == ".gguf":
        from ondevice.formats.pairs import gguf_tokens

        return gguf_tokens(path)
    from converters.hf import open_checkpoint
    from converters.tokenizer import read_hf_vocab

    ckpt = open_checkpoint(path)
    return read_hf_vocab(ckpt.path, ckpt.vocab_size, ckpt.config).tokens


def _convert_one(src: Path, to: str, out: Path, *, quant: str, bits: int, group_size: int, context: int,
                 compress: str, compute_units: str, progress: bool) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    if to == "gguf":
        from converters.to_gguf import hf_to_gguf

        return hf_to_gguf(src, out, quant=quant, progress=progress)
    if to == "mlx":
        from converters.mlx import to_mlx

        return to_mlx(src, out, bits=bits, group_size=group_size, progress=progress)
    from converters.coreml import to_coreml

    return to_coreml(src, out, context=context, compress=compress, compute_units=compute_units, progress=progress)
