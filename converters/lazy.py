"""Weights read one tensor at a time from memory-mapped files, so a check never holds a whole model.

``SafetensorsMap`` maps every tensor of a set of safetensors files without reading them (the pages
are the page cache's, shared and reclaimable, not the process's private memory); ``LazyWeights`` is a
read-only mapping name → float32 array that builds each array when it is asked for and keeps none,
so the decoder's forward pass (``ondevice.formats.decoder.forward``) walks the model layer by layer
with one layer's weights alive at a time.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import numpy as np

from ondevice.errors import OndeviceError, shown

# safetensors dtype → numpy dtype of its stored bytes (BF16: the raw 16 bits, widened by ``as_float32``)
DTYPES = {"F16": np.float16, "F32": np.float32, "BF16": np.uint16, "U32": np.uint32, "I32": np.int32,
          "U8": np.uint8, "I8": np.int8, "F64": np.float64, "I64": np.int64, "U16": np.uint16}


class SafetensorsMap:
    """Every tensor of ``files`` as a read-only ``np.memmap`` view (nothing is read until used).

    Args:
        files: safetensors files (a sharded checkpoint's shards).
    Raises:
        OndeviceError: a file whose header cannot be read, or a dtype numpy cannot map (one line, naming it).
    """

    def __init__(self, files: list[Path]) -> None:
        self.index: dict[str, tuple[Path, str, tuple[int, ...], int]] = {}
        for f in files:
            with open(f, "rb") as fh:
                n = struct.unpack("<Q", fh.read(8))[0]
                try:
                    header = json.loads(fh.read(n))
                except ValueError as e:
                    raise OndeviceError(f"{shown(f)}: unreadable safetensors header ({e}); re-download or re-export it") from e
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                if info["dtype"] not in DTYPES:
                    raise OndeviceError(f"{shown(f)}: tensor {name} has dtype {info['dtype']}, which the check cannot read")
                self.index[name] = (Path(f), info["dtype"], tuple(info["shape"]), 8 + n + info["data_offsets"][0])

    def __contains__(self, name: str) -> bool:
        return name in self.index

    def names(self) -> list[str]:
        return list(self.index)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.index[name][2]

    def dtype(self, name: str) -> str:
        return self.index[name][1]

    def raw(self, name: str) -> np.ndarray:
        """The stored array as a memory-mapped view (no copy; BF16 as its uint16 bits)."""
        path, dtype, shape, offset = self.index[name]
        if int(np.prod(shape)) == 0:
            return np.zeros(shape, DTYPES[dtype])
        return np.memmap(path, dtype=DTYPES[dtype], mode="r", offset=offset, shape=shape)

    def float32(self, name: str) -> np.ndarray:
        """One tensor as a new float32 array (BF16 widened bit-exactly)."""
        return as_float32(self.raw(name), self.dtype(name))


def as_float32(a: np.ndarray, dtype: str) -> np.ndarray:
    """A stored array → float32 (``dtype``: its safetensors dtype; BF16 bits are shifted into float32)."""
    if dtype == "BF16":
        return (np.asarray(a, np.uint32) << 16).view(np.float32)
    return np.asarray(a, dtype=np.float32)


class LazyWeights(Mapping):
    """A read-only mapping name → float32 array, each built by ``load(name)`` when asked for and not kept.

    Args:
        names: the tensor names it holds.
        load: name → array.
        tied: when ``lm_head.weight`` is not among ``names``, it reads ``model.embed_tokens.weight``.
        on_load: called with (name, array) after each load (the written-tensor comparison hooks in here).
    """

    def __init__(self, names, load: Callable[[str], np.ndarray], *, tied: bool = True,
                 on_load: Callable[[str, np.ndarray], None] | None = None) -> None:
        self._names = [n for n in names if not n.endswith("rotary_emb.inv_freq")]
        self._set = set(self._names)
        self._load, self.on_load = load, on_load
        self._tied = tied and "lm_head.weight" not in self._set

    def __getitem__(self, name: str) -> np.ndarray:
        if name == "lm_head.weight" and self._tied:
            name = "model.embed_tokens.weight"
        if name not in self._set:
            raise KeyError(name)
        a = self._load(name)
        if self.on_load is not None:
            self.on_load(name, a)
        return a

    def __contains__(self, name: object) -> bool:
        return name in self._set or (name == "lm_head.weight" and self._tied)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def hf_weights(path: Path) -> tuple[SafetensorsMap, LazyWeights]:
    """An HF checkpoint directory's weights, memory-mapped: (the map, a LazyWeights of float32 tensors)."""
    files = sorted(Path(path).glob("model*.safetensors"))
    if not files:
        raise OndeviceError(f"{shown(path)}: no model*.safetensors files; pass an HF checkpoint directory")
    st = SafetensorsMap(files)
    return st, LazyWeights(st.names(), st.float32)
