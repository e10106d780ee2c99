"""Writing a random-weight test GGUF whole or not at all (the tiny DFlash, MTP and projector models)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from ondevice.atomic import replacing


@contextmanager
def gguf_writer(out: str | Path, arch: str, tensors: Mapping[str, np.ndarray]) -> Iterator:
    """A ``gguf.GGUFWriter`` for ``arch`` to add the header's keys to in the block; when the block ends, ``tensors``
    (name → array, in order) are added and the file is written to a temp file beside ``out`` and renamed onto it
    (``ondevice.atomic.replacing``: never half a GGUF at ``out``; parent folders are created)."""
    import gguf

    with replacing(out) as tmp:
        w = gguf.GGUFWriter(tmp, arch)
        yield w
        for name, a in tensors.items():
            w.add_tensor(name, np.ascontiguousarray(a))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
