"""Tiny random-weight vision projectors (mmproj GGUF) that libmtmd loads, and tiny test images.

Two projector types, both on a CLIP/SigLIP ViT (patch embedding, learned positions, pre-norm blocks with
biased q/k/v/out and a GELU MLP):
- "mlp" (LLaVA): the two-layer MLP projector ``mm.0`` → GELU → ``mm.2``; (image_size / patch_size)² image
  tokens (16 by default), causal like text.
- "gemma3" (Gemma 3): average pooling by ``merge`` per side, RMS norm, ``mm.input_projection``;
  (image_size / patch_size / merge)² tokens (4 by default), which libmtmd decodes with non-causal attention
  between ``<start_of_image>`` and ``<end_of_image>`` text. Pair it with a Gemma 3 text model.
The output width is the text model's embedding width. Keys and tensor names are the ones
``tools/mtmd/clip.cpp`` reads (``clip.projector_type``, ``v.*``, ``mm.*``).
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ondevice.testing.gguf_file import gguf_writer


@dataclass(frozen=True)
class ProjectorShape:
    """Dimensions of the tiny projector; ``n_embd_text`` must equal the text model's embedding width."""

    n_embd_text: int = 256
    n_embd: int = 64  # vision width (≠ n_ff: clip.cpp guesses swapped FFN weights when down's input is n_embd)
    n_head: int = 4
    n_ff: int = 128
    n_layer: int = 2  # llava runs n_layer − 1 blocks (features from the second-to-last layer)
    image_size: int = 32
    patch_size: int = 8
    proj_hidden: int = 256  # mlp only
    merge: int = 2  # gemma3 only: pooling kernel per side


def _tensors(s: ProjectorShape, rng: np.random.Generator, kind: str) -> dict[str, np.ndarray]:
    """Weights in GGUF layout (numpy shape = ggml ne reversed)."""

    def lin(o: int, i: int) -> np.ndarray:
        return rng.normal(0.0, 1.0 / np.sqrt(i), (o, i))

    def vec(n: int, base: float = 0.0, std: float = 0.1) -> np.ndarray:
        return base + std * rng.normal(size=n)

    e, f = s.n_embd, s.n_ff
    n_patches = (s.image_size // s.patch_size) ** 2
    t = {
        "v.patch_embd.weight": rng.normal(0.0, 1.0 / np.sqrt(3 * s.patch_size**2), (e, 3, s.patch_size, s.patch_size)),
        "v.patch_embd.bias": vec(e),
        "v.position_embd.weight": rng.normal(0.0, 0.5, (n_patches, e)),
        "v.pre_ln.weight": vec(e, 1.0),
        "v.pre_ln.bias": vec(e),
    }
    for i in range(s.n_layer):
        p = f"v.blk.{i}."
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            t[p + name + ".weight"] = lin(e, e)
            t[p + name + ".bias"] = vec(e)
        t[p + "ln1.weight"], t[p + "ln1.bias"] = vec(e, 1.0), vec(e)
        t[p + "ln2.weight"], t[p + "ln2.bias"] = vec(e, 1.0), vec(e)
        t[p + "ffn_up.weight"], t[p + "ffn_up.bias"] = lin(f, e), vec(f)
        t[p + "ffn_down.weight"], t[p + "ffn_down.bias"] = lin(e, f), vec(e)
    if kind == "mlp":
        t["mm.0.weight"], t["mm.0.bias"] = lin(s.proj_hidden, e), vec(s.proj_hidden)
        t["mm.2.weight"], t["mm.2.bias"] = lin(s.n_embd_text, s.proj_hidden), vec(s.n_embd_text)
    else:  # gemma3: ggml multiplies by the transpose, so the GGUF holds [n_embd, n_embd_text]
        t["v.post_ln.weight"], t["v.post_ln.bias"] = vec(e, 1.0), vec(e)
        t["mm.soft_emb_norm.weight"] = vec(e, 1.0)
        t["mm.input_projection.weight"] = rng.normal(0.0, 1.0 / np.sqrt(e), (e, s.n_embd_text))
    return {k: v.astype(np.float32) for k, v in t.items()}


def make_tiny_mmproj(out: str | Path, *, kind: str = "mlp", shape: ProjectorShape | None = None,
                     seed: int = 0) -> Path:
    """Write a random-weight projector GGUF (all F32) and return its path.

    Args:
        out: the .gguf file (parent folders are created); written whole or not at all.
        kind: "mlp" (LLaVA) or "gemma3".
        shape: dimensions (default ``ProjectorShape()``: output width 256, the tiny text models' width).
        seed: weight seed.
    Returns:
        ``out`` as a Path.
    """
    import gguf

    s = shape or ProjectorShape()
    if kind not in ("mlp", "gemma3"):
        raise ValueError(f"unsupported projector kind {kind!r}; 'mlp' or 'gemma3'")
    if s.image_size % s.patch_size or s.n_embd % s.n_head or s.n_embd == s.n_ff or (s.image_size // s.patch_size) % s.merge:
        raise ValueError(f"inconsistent projector shape {s}")
    tensors = _tensors(s, np.random.default_rng(seed), kind)
    out = Path(out)
    k, kv = gguf.Keys.Clip, gguf.Keys.ClipVision
    with gguf_writer(out, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.MMPROJ], tensors) as w:  # "clip"
        w.add_name(f"tiny-{kind}-mmproj")
        w.add_file_type(gguf.LlamaFileType.ALL_F32)
        w.add_string(k.PROJECTOR_TYPE, kind)
        if kind == "gemma3":
            w.add_uint32("clip.vision.projector.scale_factor", s.merge)
        w.add_bool(k.HAS_VISION_ENCODER, True)
        w.add_bool(kv.USE_GELU, True)
        w.add_uint32(kv.IMAGE_SIZE, s.image_size)
        w.add_uint32(kv.PATCH_SIZE, s.patch_size)
        w.add_uint32(kv.EMBEDDING_LENGTH, s.n_embd)
        w.add_uint32(kv.FEED_FORWARD_LENGTH, s.n_ff)
        w.add_uint32(kv.PROJECTION_DIM, s.n_embd_text)
        w.add_uint32(kv.BLOCK_COUNT, s.n_layer)
        w.add_uint32(kv.Attention.HEAD_COUNT, s.n_head)
        w.add_float32(kv.Attention.LAYERNORM_EPS, 1e-6)
        w.add_array(kv.IMAGE_MEAN, [0.5, 0.5, 0.5])
        w.add_array(kv.IMAGE_STD, [0.5, 0.5, 0.5])
    return out


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def png_bytes(rgb: np.ndarray) -> bytes:
    """Encode an (H, W, 3) uint8 array as an 8-bit RGB PNG (no dependency on an imaging library)."""
    rgb = np.asarray(rgb, dtype=np.uint8)
    if rgb.ndim != 3 or rgb.shape[2] != 3:
        raise ValueError(f"expected an (H, W, 3) array, got shape {rgb.shape}")
    h, w, _ = rgb.shape
    raw = b"".join(b"\x00" + rgb[y].tobytes() for y in range(h))  # filter type 0 on every row
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", zlib.compress(raw)) + _chunk(b"IEND", b"")


def png_header_only(width: int, height: int, idat: bytes = b"") -> bytes:
    """A PNG whose header claims ``width`` × ``height`` with the given (possibly bogus) compressed data:
    for testing size limits and decompression bombs without building the image."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", idat) + _chunk(b"IEND", b"")


def random_image(seed: int, size: int = 48) -> np.ndarray:
    """A deterministic random RGB image (size × size × 3, uint8)."""
    return np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
