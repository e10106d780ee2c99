"""``TableRows``: a GGUF matrix read a few rows at a time (``gguf.quants`` dequantizes only the rows asked for)."""

from __future__ import annotations

import numpy as np


class TableRows:
    """A GGUF matrix's rows, dequantized only when indexed (``table[ids]`` → float32 [*ids.shape, cols]): a few
    rows of a 150k-token table without the whole (~0.9 GB as float32 at a 1.5B model's width)."""

    def __init__(self, tensor) -> None:
        self._t = tensor
        self.shape = tuple(int(d) for d in reversed(tensor.shape))

    def __getitem__(self, ids) -> np.ndarray:
        import gguf

        ids = np.asarray(ids)
        if ids.size == 0:  # gguf-py's block dequantizers fail on zero rows
            return np.zeros((*ids.shape, self.shape[-1]), np.float32)
        rows = gguf.quants.dequantize(np.asarray(self._t.data)[ids.reshape(-1)], self._t.tensor_type)
        return np.asarray(rows, np.float32).reshape(*ids.shape, self.shape[-1])
