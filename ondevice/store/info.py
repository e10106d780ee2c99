"""``ondevice info``: what a model is (format, arch, quant, vocab, device) without loading weights."""

from __future__ import annotations

import json
from pathlib import Path

from ondevice.backends import detect_format
from ondevice.store import lookup


def describe(model: str | Path, device: str | None = None) -> dict:
    """Facts about a model path or catalog name (pulls a catalog model if needed)."""
    path = lookup.resolve(model)
    if path.is_dir() and (path / "target").is_dir() and (path / "draft").is_dir():
        from ondevice.errors import OndeviceError, shown

        raise OndeviceError(f"{shown(path)}: a converted pair (target/ and draft/); describe each: "
                            f"`ondevice info {shown(path / 'target')}` and `ondevice info {shown(path / 'draft')}`")
    fmt = detect_format(path)
    info: dict = {"path": str(path), "format": fmt, "size_bytes": _size(path)}
    if fmt == "gguf":
        from ondevice.formats.gguf import check_gguf_file, read_header, tensor_types

        # the capped iterative walk, not gguf.GGUFReader (an object per array element: slow on a huge header)
        file = path / "model.gguf" if path.is_dir() else path
        check_gguf_file(file)
        meta, tokens = read_header(file)
        arch = str(meta.get("general.architecture"))
        info.update(arch=arch, quant=_file_type(meta), tensor_types=tensor_types(file), vocab_size=len(tokens or ()),
                    tokenizer=meta.get("tokenizer.ggml.model"), pre_tokenizer=meta.get("tokenizer.ggml.pre"),
                    context_length=meta.get(f"{arch}.context_length"),
                    sliding_window=meta.get(f"{arch}.attention.sliding_window"),
                    chat_template=meta.get("tokenizer.chat_template") is not None, device="cpu (llama.cpp)")
    elif fmt == "mlx":
        cfg = json.loads((path / "config.json").read_text())
        q = cfg.get("quantization") or {}
        info.update(arch=cfg.get("model_type"), quant=f"affine{q['bits']}g{q['group_size']}" if q else "float",
                    vocab_size=cfg.get("vocab_size"), context_length=cfg.get("max_position_embeddings"),
                    sliding_window=cfg.get("sliding_window"), device=_mlx_device(device))
    else:
        from ondevice.backends.coreml import package_dir, read_manifest
        from ondevice.formats.coreml_package import describe_package

        directory, package = package_dir(path)
        m = read_manifest(directory)
        desc = describe_package(package)
        info.update(arch=m.get("arch"), quant=m.get("quant"), vocab_size=m.get("vocab_size"), context_length=m["context"],
                    prefill_chunk=m.get("prefill_chunk"), functions=sorted(desc["functions"]),
                    weights=desc["functions"][desc["default_function"]]["weights"],
                    device=f"Core ML {m.get('compute_units', '')} (prediction on macOS 15+ only)")
    info["verified"] = _verified(path)
    return info


def _verified(path: Path) -> str:
    """What the converter's verification found, in one line: ``manifest.json`` beside a converted model, or the
    record of a local requantization (``ondevice pull NAME --quant FMT``) beside the variant."""
    manifest = (path if path.is_dir() else path.parent) / "manifest.json"
    try:
        m = json.loads(manifest.read_text())
        v = m.get("verify") or m.get("verified")  # "verified": Core ML packages written before "verify" held it
    except (OSError, ValueError, AttributeError):
        v = None
    if not v and path.is_file():
        return _variant(path)
    if not v:
        return "no (not converted by ondevice, or before verification existed)"
    if "check" in v:  # Core ML: the saved program run by the MIL interpreter, against its own weights
        program = (f"{v['check']}: top-1 {v.get('top1')} (max rel. error {v.get('max_rel_err')}) over "
                   f"{v.get('tokens')} tokens")
        src = v.get("source") or {}
        if "top1_agreement" in src:  # a GGUF source: the package against llama.cpp on held-out text
            how = "gated" if src.get("gated") else "recorded, not gated"
            over = (f"{src['decisive_positions']} decisive of {src['positions']} positions (all: "
                    f"{src.get('top1_agreement_all')}), max rel. error {src.get('max_rel_error')}"
                    if "positions" in src else f"{src.get('tokens')} tokens")  # probe.compare's record
            return (f"yes, against the source: {src.get('reference')}: top-1 {src['top1_agreement']} on "
                    f"{over} ({how}); program: {program}")
        return f"program only, not against the source model: {program}; agreement with the source was not measured"
    if v.get("precision") == "requantized":
        q = v.get("source") or {}
        return (f"yes, in {v.get('runtime')}: loads, tokenizer identical; quality against {q.get('reference')} "
                f"(recorded, not gated): {_quality(q)}")
    written = v.get("written") or {}
    gate = written if "top1_agreement" in written else v.get("source") or {}  # MLX on a CPU: no runtime forward
    tok = v.get("tokenizer") or {}
    words = "tokenizer identical" if tok.get("readings_agree", True) else f"tokenizer follows {tok.get('follows')} (readings differ)"
    return (f"yes, in {v.get('runtime')}: {words}, top-1 {gate.get('top1_agreement')} "
            f"(max rel. error {gate.get('max_rel_error')}) against {gate.get('reference')}")


def _variant(path: Path) -> str:
    """A local requantization's record (``converters.variants.pull_variant``), in one line."""
    try:
        rec = json.loads(path.with_suffix(".json").read_text())
    except (OSError, ValueError):
        rec = None
    if not isinstance(rec, dict) or rec.get("published") is not False or rec.get("size") != path.stat().st_size:
        return "no (not converted by ondevice, or before verification existed)"
    return (f"local requantization of {rec.get('source_file')} (not the published file), quality against it "
            f"(recorded, not gated): {_quality(rec.get('quality') or {})}")


def _quality(q: dict) -> str:
    if q.get("top1_agreement") is None:
        return "not measured"
    return f"top-1 {q['top1_agreement']:.1%}, mean KL {q.get('mean_kl')} nats over {q.get('tokens')} tokens"


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _file_type(meta: dict) -> str:
    import gguf

    ft = meta.get("general.file_type")
    try:
        return gguf.LlamaFileType(int(ft)).name.removeprefix("MOSTLY_") if ft is not None else "unknown"
    except ValueError:
        return str(ft)


def _mlx_device(device: str | None) -> str:
    try:
        import mlx.core as mx
    except ImportError:
        return "unavailable (pip install 'ondevice[mlx]')"
    gpu = mx.metal.is_available() if hasattr(mx, "metal") else False
    if device == "cpu" or not gpu:
        return "cpu (MLX)"
    return "gpu (MLX, Metal)"
