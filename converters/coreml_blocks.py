"""GGUF blocks → Core ML iOS 18 blockwise weights (``constexpr_blockwise_shift_scale``), kept, not re-rounded.

Core ML's iOS 18 op decompresses ``w = scale · (data − offset)`` with one scale (and offset) per block of
``data``. llama.cpp's simple block formats are exactly that, over blocks of 32 along a row:

    Q4_0: w = d · (n − 8)  → data = n (uint4), scale = d, offset = 8 (uint4): bit for bit
    Q8_0: w = d · k        → data = k (int8),  scale = d, no offset:           bit for bit
    Q4_1: w = d · n + m    → data = n (uint4), scale = d, offset = −m/d (fp16): the same 4-bit codes and
          scales; −m/d and n − offset are fp16 numbers, so a weight moves by at most ~1 % of its
          quantization step (measured per tensor and reported); a block with d = 0 (all weights m) gets
          scale = m, offset = −1.

Every other type (K-quants, Q5_*, IQ4_NL, ...) is dequantized with ``gguf`` and re-quantized over the same
blocks of 32: sources of 5 bits or more to symmetric int8, the rest to affine uint4 (min/max per block,
Q4_1's scheme); each such tensor is named in the report with its relative error against the GGUF's own
dequantized weights. Float tensors (norms, biases) stay fp16.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from converters.gguf_blocks import BYTES

BLOCK = 32
KEPT = ("Q4_0", "Q4_1", "Q8_0")
FLOAT = ("F32", "F16", "BF16")


@dataclass
class Blockwise:
    """One weight as Core ML's blockwise op holds it: ``scale · (data − offset)`` per block of 32 columns."""

    data: np.ndarray  # [rows, cols]: uint8 holding 4-bit codes (bits=4) or int8 (bits=8)
    scale: np.ndarray  # fp16 [rows, cols / 32]
    offset: np.ndarray | None  # [rows, cols / 32]: uint8 codes (Q4_0) or fp16; None for symmetric int8
    bits: int
    source_type: str
    kept: bool  # the GGUF's own codes and scales (no re-rounding)

    def dense(self) -> np.ndarray:
        """The weight, decompressed as Core ML (and ``ondevice.formats.mil``) computes it, in fp16."""
        rows, cols = self.data.shape
        x = self.data.astype(np.float16).reshape(rows, cols // BLOCK, BLOCK)
        if self.offset is not None:
            x = x - self.offset.astype(np.float16)[..., None]
        return (x * self.scale[..., None]).reshape(rows, cols)

    def mil_value(self):
        """(data, scale, offset) as coremltools consts take them (4-bit codes in its uint4 dtype)."""
        from coremltools.converters.mil.mil import types

        if self.bits == 4:
            data = self.data.astype(types.np_uint4_dtype)
            off = self.offset
            if off is not None and off.dtype == np.uint8:
                off = off.astype(types.np_uint4_dtype)
            return data, self.scale, off
        return self.data, self.scale, self.offset


def from_gguf_block(raw: np.ndarray, ttype: str, rows: int, cols: int) -> Blockwise:
    """A Q4_0 / Q4_1 / Q8_0 tensor's raw blocks → ``Blockwise`` with the same codes and scales."""
    nb = cols // BLOCK
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows, nb, BYTES[ttype])
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0]
    if ttype == "Q8_0":
        return Blockwise(blocks[..., 2:].view(np.int8).reshape(rows, cols).copy(), d, None, 8, ttype, True)
    if ttype == "Q4_0":
        qs, offset = blocks[..., 2:], np.full((rows, nb), 8, np.uint8)
        scale = d
    else:  # Q4_1
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        qs = blocks[..., 4:]
        dz = d == 0
        with np.errstate(divide="ignore", invalid="ignore"):
            offset = np.where(dz, -1.0, -m / d.astype(np.float32)).astype(np.float16)
        scale = np.where(dz, m.astype(np.float16), d)
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # [rows, nb, 32] in element order
    return Blockwise(q.reshape(rows, cols).astype(np.uint8), scale.astype(np.float16), offset, 4, ttype, True)


def requantize(w: np.ndarray, bits: int, source_type: str) -> Blockwise:
    """A float weight [rows, cols] → blocks of 32: symmetric int8 (bits 8) or affine uint4 (bits 4)."""
    rows, cols = w.shape
    x = np.asarray(w, np.float32).reshape(rows, cols // BLOCK, BLOCK)
    if bits == 8:
        scale = (np.abs(x).max(-1) / 127.0).astype(np.float16)
        s = np.where(scale == 0, 1.0, scale.astype(np.float32))[..., None]
        q = np.clip(np.rint(x / s), -127, 127).astype(np.int8)
        return Blockwise(q.reshape(rows, cols), scale, None, 8, source_type, False)
    lo, hi = x.min(-1), x.max(-1)
    scale = ((hi - lo) / 15.0).astype(np.float16)
    s = scale.astype(np.float32)
    dz = s == 0
    offset = np.where(dz, -1.0, -lo / np.where(dz, 1.0, s)).astype(np.float16)
    scale = np.where(dz, lo.astype(np.float16), scale)
    q = np.rint(x / np.where(dz, 1.0, s)[..., None] + offset.astype(np.float32)[..., None])
    q = np.where(dz[..., None], 0, np.clip(q, 0, 15)).astype(np.uint8)
    return Blockwise(q.reshape(rows, cols), scale.astype(np.float16), offset, 4, source_type, False)


def rel_error(a: np.ndarray, ref: np.ndarray) -> float:
    a, ref = np.asarray(a, np.float32), np.asarray(ref, np.float32)
    return float(np.linalg.norm(a - ref) / max(float(np.linalg.norm(ref)), 1e-12))


def gguf_blockwise(g) -> tuple[dict[str, Blockwise], dict]:
    """Every 2-D weight of GGUF ``g`` (``ondevice.formats.gguf.GGUFFile``) as ``Blockwise`` under its
    HF name and in HF layout (llama Q/K rows un-permuted, codes, scales and offsets alike).

    Returns:
        (HF name → Blockwise, report {"kept": {type: n}, "requantized": [{tensor, from, to, rel_error}],
        "kept_max_rel_error": largest error of a kept tensor against the GGUF's dequantized one}).
    """
    from converters.dequant import dequantize
    from ondevice.formats.gguf import hf_name, llama_permuted_heads, unpermute_rows

    cfg = g.config()
    out: dict[str, Blockwise] = {}
    kept: dict[str, int] = {}
    requantized, kept_err = [], 0.0
    for t in g.reader.tensors:
        ttype = t.tensor_type.name
        if len(t.shape) < 2:
            continue
        cols, rows = int(t.shape[0]), int(t.shape[1])
        name = hf_name(t.name, g.arch)
        ref = dequantize(t.data, t.tensor_type).reshape(rows, cols)
        if cols % BLOCK:
            continue  # stays fp16 (the graph's const)
        if ttype in KEPT:
            b = from_gguf_block(t.data, ttype, rows, cols)
        else:
            bits = 8 if ttype.startswith(("Q5", "Q6", "Q8")) or ttype in FLOAT else 4
            b = requantize(ref, bits, ttype)
        heads = llama_permuted_heads(g, t.name, cfg)
        if heads:
            b.data, b.scale = unpermute_rows(b.data, heads), unpermute_rows(b.scale, heads)
            b.offset = unpermute_rows(b.offset, heads) if b.offset is not None else None
            ref = unpermute_rows(ref, heads)
        err = rel_error(b.dense(), ref)
        if b.kept:
            kept[ttype] = kept.get(ttype, 0) + 1
            kept_err = max(kept_err, err)
        else:
            requantized.append({"tensor": name, "from": ttype, "to": "int8" if b.bits == 8 else "uint4+offset",
                                "rel_error": round(err, 5)})
        out[name] = b
    return out, {"kept": kept, "requantized": requantized, "kept_max_rel_error": round(kept_err, 6)}
