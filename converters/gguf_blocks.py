"""GGUF Q4_0 / Q4_1 / Q8_0 blocks → MLX affine quantized arrays, bit for bit (no re-rounding).

A GGUF block covers 32 consecutive weights of a row. MLX's affine format stores, per group of 32,
w = scale · q + bias with unsigned q packed little-endian into uint32 words. Each block maps to one
group exactly:

    Q4_0: w = d · (n − 8), n ∈ [0, 16)     → scale = d, bias = −8d,   q = n
    Q4_1: w = d · n + m,   n ∈ [0, 16)     → scale = d, bias = m,     q = n
    Q8_0: w = d · k,       k ∈ [−128, 128) → scale = d, bias = −128d, q = k + 128

Q4 blocks hold element i in the low nibble of byte i and element i + 16 in its high nibble.
"""

from __future__ import annotations

import numpy as np

BLOCK = 32
BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
BITS = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8}


def to_mlx_affine(raw: np.ndarray, ttype: str, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Convert one tensor's raw GGUF blocks.

    Args:
        raw: uint8 bytes of the tensor, rows × (cols / 32) blocks.
        ttype: "Q4_0" | "Q4_1" | "Q8_0".
        rows, cols: the weight's shape (out_features, in_features).
    Returns:
        (weight uint32 [rows, cols·bits/32], scales float16 [rows, cols/32], biases float16 [rows, cols/32]).
    """
    nb = cols // BLOCK
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows, nb, BYTES[ttype])
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0]
    if ttype == "Q8_0":
        q = (blocks[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)  # [rows, nb, 32]
        bias = (d.astype(np.float32) * -128.0).astype(np.float16)
        packed = q.reshape(rows, cols).view("<u4")
        return packed, d, bias
    if ttype == "Q4_0":
        qs = blocks[..., 2:]
        bias = (d.astype(np.float32) * -8.0).astype(np.float16)
    else:  # Q4_1
        bias = blocks[..., 2:4].copy().view(np.float16)[..., 0]
        qs = blocks[..., 4:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # [rows, nb, 32] in element order
    q = q.reshape(rows, cols // 2, 2)
    packed = (q[..., 0] | (q[..., 1] << 4)).astype(np.uint8).reshape(rows, cols // 2).view("<u4")
    return packed, d, bias
