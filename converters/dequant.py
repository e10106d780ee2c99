"""Dequantize GGUF tensors with ggml's own ``to_float`` (the library llama.cpp runs), numpy's speed otherwise.

``gguf.dequantize`` is a numpy re-implementation: exact, but K-quants go through Python-level row
splitting (~10 s per billion weights here). ggml exports each type's ``to_float`` through
``ggml_get_type_traits``; llama-cpp-python ships ``libggml-base``, so the check calls it with ctypes when
the library is there and its traits name the type asked for (a layout mismatch is refused, not guessed),
and ``gguf.dequantize`` otherwise. Both give the same floats (tested).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import numpy as np

_TO_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)


class _Traits(ctypes.Structure):
    _fields_ = [("type_name", ctypes.c_char_p), ("blck_size", ctypes.c_int64), ("blck_size_interleave", ctypes.c_int64),
                ("type_size", ctypes.c_size_t), ("is_quantized", ctypes.c_bool), ("to_float", ctypes.c_void_p),
                ("from_float_ref", ctypes.c_void_p)]


@functools.cache
def _lib():
    try:
        import llama_cpp
    except ImportError:
        return None
    for name in ("libggml-base.so", "libggml-base.dylib", "ggml-base.dll"):
        path = Path(llama_cpp.__file__).parent / "lib" / name
        if path.is_file():
            try:
                lib = ctypes.CDLL(str(path))
            except OSError:
                return None
            lib.ggml_get_type_traits.restype = ctypes.POINTER(_Traits)
            lib.ggml_get_type_traits.argtypes = [ctypes.c_int]
            return lib
    return None


@functools.cache
def _to_float(type_id: int, type_name: str, block: int, size: int):
    """ggml's to_float for one type, if its traits are what ``gguf`` says they are; else None."""
    lib = _lib()
    if lib is None:
        return None
    t = lib.ggml_get_type_traits(type_id).contents
    if (t.type_name or b"").decode().upper() != type_name or t.blck_size != block or t.type_size != size or not t.to_float:
        return None
    return _TO_FLOAT(t.to_float)


def dequantize(data: np.ndarray, qtype) -> np.ndarray:
    """A GGUF tensor's raw data (``ReaderTensor.data``) → float32, flat or [rows, cols] as ``gguf`` returns it.

    Args:
        data: the tensor's data as ``gguf.GGUFReader`` maps it.
        qtype: its ``gguf.GGMLQuantizationType``.
    """
    import gguf

    if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        return np.asarray(data, np.float32)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    fn = _to_float(int(qtype), qtype.name, block, size)
    if fn is None:
        return np.asarray(gguf.dequantize(data, qtype), np.float32)
    raw = np.ascontiguousarray(data).view(np.uint8)
    rows = raw.shape[:-1]
    n = raw.size // size * block
    out = np.empty(n, np.float32)
    fn(raw.ctypes.data, out.ctypes.data, n)
    return out.reshape(*rows, -1)
