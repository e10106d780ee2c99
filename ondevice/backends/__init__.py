"""``open_backend``: one runtime per model format (the contract: ``ondevice.backends.base.Backend``).

A backend owns one model and its KV cache. It returns logits and never samples. Heavy libraries
(llama_cpp, mlx, coremltools) are imported only inside the backend modules, on first use.
"""

from __future__ import annotations

from pathlib import Path

from ondevice.backends.base import Backend
from ondevice.errors import OndeviceError

__all__ = ["Backend", "DEVICES", "detect_format", "is_gguf_file", "open_backend"]


def is_gguf_file(path: Path) -> bool:
    """A path named *.gguf, or a file that starts with the GGUF magic (only 4 bytes are read)."""
    path = Path(path)
    if path.suffix == ".gguf":
        return True
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def detect_format(path: Path) -> str:
    """'gguf', 'mlx' or 'coreml', from the path alone; a clear error otherwise."""
    if path.is_file() and path.suffix == ".gguf":
        return "gguf"
    if path.suffix == ".mlpackage" or (path.is_dir() and any(path.glob("*.mlpackage"))):
        return "coreml"
    if path.is_dir():
        if (path / "model.gguf").is_file():
            return "gguf"
        if (path / "config.json").is_file() and any(path.glob("*.safetensors")):
            return "mlx"
    if path.is_file() and is_gguf_file(path):
        return "gguf"
    raise OndeviceError(
        f"{path}: unrecognised model format; expected a .gguf file, an MLX model directory or a .mlpackage"
    )


DEVICES = ("gpu", "cpu", "mil")


def open_backend(
    path: str | Path, *, n_ctx: int, threads: int | None = None, device: str | None = None, mmap: bool = True,
    keep_ne: bool = False, cache_type_k: str = "f16", cache_type_v: str = "f16",
) -> Backend:
    """Open ``path`` with the backend its format needs.

    Args:
        path: a .gguf file (or a directory holding model.gguf), an MLX directory, or a .mlpackage.
        n_ctx: context length of the cache.
        threads: CPU threads (llama.cpp).
        device: 'gpu' | 'cpu' | None (default: the GPU when the backend has one), or 'mil': a Core ML
            package's program run by the MIL interpreter (any OS).
        mmap: memory-map GGUF weights (llama.cpp); False reads them into memory.
        keep_ne: a Core ML model runs on CPU_AND_NE whatever ``device`` says ('mil' aside): a draft whose
            device is inherited from the target stays on the Neural Engine.
        cache_type_k, cache_type_v: KV-cache element types (``ondevice.backends.llama.KV_CACHE_TYPES``: f16,
            q8_0, q4_0), llama.cpp only: an MLX or Core ML model given another than f16 is refused.
    """
    if device not in (None, *DEVICES):
        raise OndeviceError(f"device={device!r}: choose one of {', '.join(DEVICES)}")
    from ondevice.backends.llama import check_cache_type

    cache_type_k, cache_type_v = check_cache_type("cache_type_k", cache_type_k), check_cache_type("cache_type_v", cache_type_v)
    path = Path(path)
    fmt = detect_format(path)
    if fmt != "gguf" and (cache_type_k, cache_type_v) != ("f16", "f16"):
        raise OndeviceError(f"{path.name}: cache_type_k={cache_type_k} cache_type_v={cache_type_v}: KV-cache types are "
                            f"llama.cpp's; a {fmt} model keeps its own cache, so leave them at f16")
    if device == "mil":
        if fmt != "coreml":
            raise OndeviceError(f"{path}: device='mil' runs Core ML packages only; use 'cpu' or 'gpu' for a {fmt} model")
        from ondevice.backends.mil import MILBackend

        return MILBackend(path, n_ctx=n_ctx)
    if fmt == "gguf":
        from ondevice.backends.llama import LlamaBackend

        if path.is_dir():
            path = path / "model.gguf"
        return LlamaBackend(path, n_ctx=n_ctx, threads=threads, device=device, mmap=mmap, cache_type_k=cache_type_k,
                            cache_type_v=cache_type_v)
    if fmt == "mlx":
        from ondevice.backends.mlx import MLXBackend

        return MLXBackend(path, n_ctx=n_ctx, device=device)
    from ondevice.backends.coreml import CoreMLBackend

    return CoreMLBackend(path, n_ctx=n_ctx, device="ne" if keep_ne else device)
