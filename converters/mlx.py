"""→ MLX (mlx-lm style directories): HF via ``mlx_lm.convert``; GGUF losslessly for Q4_0/Q4_1/Q8_0
(their blocks are MLX affine group-32 arrays, as ``mx.load`` reads them) or by ``gguf`` dequantize +
``mx.quantize`` for other types."""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np

from converters.output import write_manifest
from ondevice.backends import is_gguf_file
from ondevice.errors import OndeviceError

LOSSLESS = {"Q4_0", "Q4_1", "Q8_0"}
KEEP_FLOAT = {"F32", "F16", "BF16"}


def to_mlx(src: Path, out: Path, *, bits: int = 4, group_size: int = 64, progress: bool = True) -> dict:
    """Convert an HF checkpoint dir or a .gguf file into an mlx-lm directory at ``out``."""
    if bits not in (2, 3, 4, 5, 6, 8, 16):
        raise OndeviceError(f"--bits {bits}: MLX supports 2, 3, 4, 5, 6 or 8 (16: float16, unquantized)")
    if bits == 16 and is_gguf_file(src):
        raise OndeviceError("--bits 16: a GGUF source converts to MLX keeping its own quantization; drop --bits")
    if group_size not in (32, 64, 128):
        raise OndeviceError(f"--group-size {group_size}: MLX supports 32, 64 or 128")
    if is_gguf_file(src):
        return gguf_to_mlx(src, out, bits=bits, group_size=group_size, progress=progress)
    return hf_to_mlx(src, out, bits=bits, group_size=group_size)


def _summary(out: Path, fmt: str, quant: str, arch: str, t0: float, n_params: int, extra: dict) -> dict:
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    return {"format": fmt, "quant": quant, "arch": arch, "size_bytes": size, "n_params": n_params,
            "bits_per_weight": round(size * 8 / max(n_params, 1), 3), "seconds": round(time.perf_counter() - t0, 3), **extra}


def hf_to_mlx(src: Path, out: Path, *, bits: int, group_size: int) -> dict:
    """mlx-lm's own converter, after our checks; every linear layer must end up quantized (``bits=16``:
    float16, nothing quantized)."""
    from converters.hf import open_checkpoint
    from converters.tokenizer import read_hf_vocab

    t0 = time.perf_counter()
    ckpt = open_checkpoint(src)
    vocab = read_hf_vocab(ckpt.path, ckpt.vocab_size, ckpt.config)
    from mlx_lm import convert as mlx_convert

    work = out / "mlx"
    with contextlib.redirect_stdout(sys.stderr):  # mlx-lm prints progress on stdout; keep it for --json
        if bits == 16:
            mlx_convert(str(src), str(work), quantize=False, dtype="float16")
        else:
            mlx_convert(str(src), str(work), quantize=True, q_group_size=group_size, q_bits=bits)
    for f in work.iterdir():
        shutil.move(str(f), out / f.name)
    work.rmdir()
    report = quantized_layers(out)
    n_params = sum(int(np.prod(ckpt_shape)) for ckpt_shape in _shapes(ckpt))
    write_manifest(out, {
        "source": str(Path(src).resolve()), "source_sha256": ckpt.source_sha256(), "format": "mlx",
        "quant": "float16" if bits == 16 else f"affine{bits}g{group_size}", "arch": ckpt.arch,
        "vocab_size": len(vocab.tokens),
        "vocab_sha256": vocab.sha256(), "tensor_types": report["layers"],
    })
    return _summary(out, "mlx", "float16" if bits == 16 else f"{bits}bit-g{group_size}", ckpt.arch, t0, n_params,
                    {"bits": bits, "quantized_layers": report["quantized"], "unquantized_linear_layers": report["unquantized"]})


def _shapes(ckpt):
    from safetensors import safe_open

    for f in ckpt.files:
        with safe_open(str(f), framework="numpy") as st:
            for k in st.keys():
                yield st.get_slice(k).get_shape()


def quantized_layers(directory: Path) -> dict:
    """Which weight matrices of an mlx-lm directory are quantized (have .scales), and with what bits."""
    from safetensors import safe_open

    cfg = json.loads((directory / "config.json").read_text())
    q = cfg.get("quantization") or {}
    layers, unquantized = {}, []
    for f in sorted(directory.glob("*.safetensors")):
        with safe_open(str(f), framework="numpy") as st:
            keys = set(st.keys())
            for k in sorted(keys):
                if not k.endswith(".weight") or len(st.get_slice(k).get_shape()) != 2:
                    continue
                base = k[: -len(".weight")]
                if f"{base}.scales" in keys:
                    w, s = st.get_slice(k).get_shape(), st.get_slice(f"{base}.scales").get_shape()
                    per = q.get(base) if isinstance(q.get(base), dict) else {}
                    gs = per.get("group_size", q.get("group_size"))
                    b = per.get("bits") or round(w[1] * 32 / (s[1] * gs))
                    layers[base] = f"affine{b}g{gs}"
                else:
                    layers[base] = "float"
                    unquantized.append(base)
    return {"layers": layers, "quantized": len(layers) - len(unquantized), "unquantized": unquantized}


def gguf_to_mlx(src: Path, out: Path, *, bits: int = 4, group_size: int = 64, progress: bool = True) -> dict:
    """GGUF (llama/qwen2, BPE tokenizer) → mlx-lm directory.

    Q4_0/Q4_1/Q8_0 tensors stay exactly as they were (converted block for block into the affine
    group-32 arrays ``mx.load`` would give). Other quantized types are dequantized with ``gguf`` and requantized with
    ``mx.quantize`` at ``group_size`` and ``bits`` (8 bits for sources of 5 bits or more, such as
    the Q6_K output layer); float tensors stay float.
    """
    import gguf
    import mlx.core as mx

    from converters.gguf_blocks import to_mlx_affine
    from converters.tokenizer import write_hf_tokenizer
    from ondevice.formats.gguf import GGUFFile, hf_name, llama_permuted_heads, unpermute_rows

    t0 = time.perf_counter()
    g = GGUFFile(src)
    g.require_supported()
    cfg = g.config()
    tok_info = write_hf_tokenizer(g, out)  # fails early on an unknown pre-tokenizer
    types = {t.name: t.tensor_type.name for t in g.reader.tensors}
    n_params = sum(int(np.prod(t.shape)) for t in g.reader.tensors)
    weights: dict[str, mx.array] = {}
    per_layer: dict[str, dict] = {}
    requantized, kept = [], []
    tensors = {t.name: t for t in g.reader.tensors}
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), console=Console(stderr=True),
                   disable=not progress, transient=True)
    task = bar.add_task(f"mlx {src.name}", total=len(tensors))
    bar.start()
    try:
        for name, tinfo in tensors.items():
            bar.update(task, advance=1, description=f"mlx {name}")
            ttype = types[name]
            target = hf_name(name, g.arch)
            base = target[: -len(".weight")] if target.endswith(".weight") else None
            perm = llama_permuted_heads(g, name, cfg)
            if ttype in LOSSLESS and base is not None:
                # the same arrays mx.load gives for these types (tested), also in files that mix in
                # types mx.load cannot read (Q5_0)
                w, s, b = to_mlx_affine(tinfo.data, ttype, int(tinfo.shape[1]), int(tinfo.shape[0]))
                if perm:
                    w, s, b = (unpermute_rows(x, perm) for x in (w, s, b))
                weights[target], weights[f"{base}.scales"], weights[f"{base}.biases"] = (mx.array(x) for x in (w, s, b))
                per_layer[base] = {"group_size": 32, "bits": 8 if ttype == "Q8_0" else 4}
                kept.append(name)
                continue
            arr = gguf.dequantize(tinfo.data, tinfo.tensor_type) if ttype not in KEEP_FLOAT else np.array(tinfo.data)
            arr = np.asarray(arr, dtype=np.float32).reshape([int(d) for d in reversed(tinfo.shape)])
            if perm:
                arr = unpermute_rows(arr, perm)
            if ttype in KEEP_FLOAT or arr.ndim < 2:
                weights[target] = mx.array(arr.astype(np.float16) if arr.ndim >= 2 else arr)
                continue
            # A source with more bits than asked (Q5_*, Q6_K: llama.cpp's choice for output/embedding) keeps 8.
            qbits = 8 if ttype.startswith(("Q5", "Q6", "Q8")) else bits
            w, s, b = mx.quantize(mx.array(arr, dtype=mx.float16), group_size=group_size, bits=qbits)
            weights[target], weights[f"{base}.scales"], weights[f"{base}.biases"] = w, s, b
            per_layer[base] = {"group_size": group_size, "bits": qbits}
            requantized.append(name)
    finally:
        bar.stop()
    # mlx-lm infers each layer's bits from its shapes; the top-level entry is the default.
    cfg["quantization"] = {"group_size": group_size, "bits": bits, **per_layer}
    cfg["quantization_config"] = cfg["quantization"]
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    write_manifest(out, {
        "source": str(Path(src).resolve()), "source_sha256": _sha256(src), "format": "mlx",
        "quant": "from-gguf", "arch": g.arch, "vocab_size": len(g.tokens), "vocab_sha256": tok_info["vocab_sha256"],
        "tensor_types": {k: f"affine{v['bits']}g{v['group_size']}" for k, v in per_layer.items()},
    })
    return _summary(out, "mlx", "from-gguf", g.arch, t0, n_params, {
        "lossless_tensors": len(kept), "requantized_tensors": len(requantized),
        "source_types": dict(Counter(types.values())), "tokenizer_pre": tok_info["pre"],
    })


def _sha256(path: Path) -> str:
    from ondevice.store.fetch import sha256_file

    return sha256_file(path)
