"""One description of a llama / qwen2 decoder, run by interchangeable op sets.

``forward`` is written once against a small ``ops`` interface. ``NumpyOps`` runs it in float32 (the
reference forward pass); ``converters.coreml.MILOps`` emits the same sequence as a Core ML MIL graph.
Both use a *static*, position-indexed KV cache of ``context`` slots per layer: a call writes its S
new keys/values at [position, position + S) and attends over all slots with a causal mask
(slot j is visible to the query at position p iff j <= p), so stale slots past the write position are
never read and rollback is just moving the write position back.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ondevice.errors import OndeviceError, shown

MASK_VALUE = -1e4  # masked scores: exp(-1e4) underflows to 0 in fp16 and fp32, and stays finite in fp16


@dataclass(frozen=True)
class DecoderConfig:
    """The shape of a llama / qwen2 decoder, read from an HF config.json."""

    arch: str
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate: int
    vocab_size: int
    rope_theta: float
    rms_eps: float
    tie_embeddings: bool
    qkv_bias: bool
    rope_scaling: tuple[tuple[str, Any], ...] = ()
    qk_norm: bool = False  # qwen3: RMSNorm over each head's q and k before rope

    @classmethod
    def from_hf(cls, config: dict, path: Path | str = "config.json", archs: tuple[str, ...] = ("llama", "qwen2"),
                what: str = "Core ML conversion") -> DecoderConfig:
        """Read an HF config.json (``archs``: the model types the caller runs; ``what`` names it in errors;
        ``mistral`` is llama's graph, ``qwen3`` adds q/k norms)."""
        arch = config.get("model_type")
        if arch not in archs:
            raise OndeviceError(f"{shown(path)}: {what} supports {', '.join(archs)} decoders, not {arch!r}")
        if arch == "mistral" and config.get("sliding_window") and int(config["sliding_window"]) < int(
                config.get("max_position_embeddings", 0)):
            raise OndeviceError(f"{shown(path)}: mistral with a sliding window is not supported by {what}")
        if config.get("hidden_act", "silu") != "silu":
            raise OndeviceError(f"{shown(path)}: hidden_act {config['hidden_act']!r} is not supported (silu only)")
        if arch in ("qwen2", "qwen3") and config.get("use_sliding_window"):
            raise OndeviceError(f"{shown(path)}: sliding-window attention is not supported by the Core ML converter")
        scaling = config.get("rope_scaling") or {}
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind not in ("default", "linear", "llama3"):
            raise OndeviceError(f"{shown(path)}: rope_scaling type {kind!r} is not supported (default, linear, llama3)")
        hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        return cls(
            arch=arch,
            n_layers=int(config["num_hidden_layers"]),
            hidden=hidden,
            n_heads=heads,
            n_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            intermediate=int(config["intermediate_size"]),
            vocab_size=int(config["vocab_size"]),
            rope_theta=float(config.get("rope_theta", 10000.0)),
            rms_eps=float(config.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=arch == "qwen2",
            rope_scaling=tuple(sorted(scaling.items())) if kind != "default" else (),
            qk_norm=arch == "qwen3",
        )

    def inv_freq(self) -> np.ndarray:
        """RoPE inverse frequencies θ^(-2i/d), with linear or llama3 scaling as HF / mlx-lm apply them."""
        d = self.head_dim
        inv = 1.0 / (self.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
        s = dict(self.rope_scaling)
        kind = s.get("rope_type", s.get("type"))
        if kind == "linear":
            inv = inv / float(s["factor"])
        elif kind == "llama3":
            # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
            factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
            old = float(s["original_max_position_embeddings"])
            wavelen = 2 * np.pi / inv
            smooth = (old / wavelen - low) / (high - low)
            scaled = np.where(wavelen > old / low, inv / factor, inv)
            mid = (wavelen <= old / low) & (wavelen >= old / high)
            inv = np.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
        return inv

    def rope_tables(self, context: int) -> tuple[np.ndarray, np.ndarray]:
        """cos, sin: [context, head_dim] float32, the half-split (rotate_half) layout HF checkpoints use."""
        ang = np.outer(np.arange(context, dtype=np.float64), self.inv_freq())
        ang = np.concatenate([ang, ang], axis=1)
        return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def load_weights(tensors) -> dict[str, np.ndarray]:
    """(HF tensor name, array) pairs → name → float32 array, with ``lm_head.weight`` filled in for tied
    embeddings (the same array as the embedding)."""
    w = {name: np.asarray(t, dtype=np.float32) for name, t in tensors}
    if "lm_head.weight" not in w:
        w["lm_head.weight"] = w["model.embed_tokens.weight"]
    return w


def forward(ops, cfg: DecoderConfig, w: dict[str, np.ndarray], input_ids, position):
    """The decoder, once: token ids [S] at positions position … position+S-1 → logits [S, vocab].

    ``ops`` supplies the primitives (and the KV cache: ``ops.cache_write``); ``w`` holds HF-named
    float32 weights. Pre-norm blocks: x += Attn(RMSNorm(x)); x += MLP(RMSNorm(x)), MLP = down(silu(gate) * up).
    """
    x = ops.embed(w["model.embed_tokens.weight"], input_ids)  # [S, hidden]
    cos, sin, mask = ops.positions(position)  # [S, head_dim] ×2, [S, context]
    n_rep = cfg.n_heads // cfg.n_kv_heads
    scale = 1.0 / float(np.sqrt(cfg.head_dim))
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        h = rms_norm(ops, x, w[p + "input_layernorm.weight"], cfg.rms_eps)
        q, k, v = (
            ops.linear(h, w[f"{p}self_attn.{n}_proj.weight"], w.get(f"{p}self_attn.{n}_proj.bias"))
            for n in ("q", "k", "v")
        )
        q, k = ops.split_heads(q, cfg.n_heads, cfg.head_dim), ops.split_heads(k, cfg.n_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q = rms_norm(ops, q, w[p + "self_attn.q_norm.weight"], cfg.rms_eps)
            k = rms_norm(ops, k, w[p + "self_attn.k_norm.weight"], cfg.rms_eps)
        q = ops.rope(q, cos, sin)  # [H, S, D]
        k = ops.rope(k, cos, sin)  # [Hkv, S, D]
        v = ops.split_heads(v, cfg.n_kv_heads, cfg.head_dim)
        k_all, v_all = ops.cache_write(i, k, v, position)  # [Hkv, context, D]
        a = ops.attention(q, k_all, v_all, mask, n_rep, scale)  # [S, H * D]
        x = ops.add(x, ops.linear(a, w[p + "self_attn.o_proj.weight"]))
        h = rms_norm(ops, x, w[p + "post_attention_layernorm.weight"], cfg.rms_eps)
        g = ops.linear(h, w[p + "mlp.gate_proj.weight"])
        u = ops.linear(h, w[p + "mlp.up_proj.weight"])
        x = ops.add(x, ops.linear(ops.mul(ops.silu(g), u), w[p + "mlp.down_proj.weight"]))
    x = rms_norm(ops, x, w["model.norm.weight"], cfg.rms_eps)
    return ops.logits(x, w["lm_head.weight"])


def reference_logits(cfg: DecoderConfig, weights, ids) -> np.ndarray:
    """One float32 forward pass over ``ids`` (positions 0…n-1) → logits [n, vocab].

    ``weights`` is any mapping name → array (``converters.lazy.LazyWeights`` builds each tensor when the
    pass reaches it and keeps none, so memory is one layer's weights plus the activations of ``ids``).
    """
    return forward(NumpyOps(cfg, max(1, len(ids))), cfg, weights, ids, 0)


def rms_norm(ops, x, weight, eps: float):
    """x / sqrt(mean(x²) + eps) · weight, written so that fp16 cannot overflow: activation outliers of
    10⁴ are real (SmolLM2: 24 759) and their squares are not fp16 numbers. With m = max|x| (≥ 1e-3):
    y = (x/m) / sqrt(mean((x/m)²) + eps/m²) · weight, which is exact for any m > 0."""
    m = ops.maximum(ops.abs_max(x), 1e-3)
    xs = ops.div(x, m)
    ms = ops.add(ops.mean(ops.mul(xs, xs)), ops.div(eps, ops.mul(m, m)))
    return ops.mul(ops.mul(xs, ops.rsqrt(ms)), weight)


class NumpyOps:
    """float32 numpy primitives for ``forward``, with the static cache as arrays [Hkv, context, D].

    With ``fp16=True`` every op's result (and every weight) is rounded to float16, as the Core ML graph
    stores them: a simulation of its range and rounding (not of the Neural Engine's accumulation order).
    """

    def __init__(self, cfg: DecoderConfig, context: int, fp16: bool = False) -> None:
        self.cfg, self.context, self.fp16 = cfg, context, fp16
        self.cos, self.sin = cfg.rope_tables(context)
        shape = (cfg.n_layers, cfg.n_kv_heads, context, cfg.head_dim)
        self.k_cache = np.zeros(shape, np.float32)
        self.v_cache = np.zeros(shape, np.float32)
        self._s = 0

    def _r(self, a):
        """Round to float16 in fp16 mode (overflow → inf, as on the device)."""
        if not self.fp16:
            return a
        with np.errstate(over="ignore"):
            return np.asarray(a, dtype=np.float32).astype(np.float16).astype(np.float32)

    def embed(self, table, ids):
        ids = np.asarray(ids, dtype=np.int64)
        self._s = len(ids)
        return self._r(table[ids])

    def positions(self, position):
        pos = int(position) + np.arange(self._s)
        mask = np.where(np.arange(self.context)[None, :] <= pos[:, None], 0.0, MASK_VALUE).astype(np.float32)
        return self._r(self.cos[pos]), self._r(self.sin[pos]), mask

    def abs_max(self, x):
        return np.abs(x).max(axis=-1, keepdims=True)

    def maximum(self, x, c):
        return np.maximum(x, c)

    def div(self, a, b):
        with np.errstate(over="ignore", divide="ignore"):
            return self._r(np.divide(a, b))

    def mean(self, x):
        return self._r(np.mean(x, axis=-1, keepdims=True))

    def rsqrt(self, x):
        return self._r(1.0 / np.sqrt(x))

    def linear(self, x, weight, bias=None):
        y = x @ self._r(weight).T
        return self._r(y if bias is None else y + self._r(bias))

    def split_heads(self, x, n, d):
        return x.reshape(x.shape[0], n, d).transpose(1, 0, 2)

    def rope(self, x, cos, sin):
        half = x.shape[-1] // 2
        rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
        return self._r(self._r(x * cos) + self._r(rotated * sin))

    def cache_write(self, layer, k, v, position):
        s = k.shape[1]
        self.k_cache[layer, :, position : position + s] = k
        self.v_cache[layer, :, position : position + s] = v
        return self.k_cache[layer], self.v_cache[layer]

    def attention(self, q, k, v, mask, n_rep, scale):
        h, s, d = q.shape
        qg = q.reshape(h // n_rep, n_rep * s, d)  # query heads grouped by the KV head they share
        scores = self._r(self._r(qg @ k.transpose(0, 2, 1)) * scale).reshape(h // n_rep, n_rep, s, -1) + mask
        scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
        probs = self._r(scores / scores.sum(axis=-1, keepdims=True)).reshape(h // n_rep, n_rep * s, -1)
        out = self._r(probs @ v).reshape(h, s, d)
        return out.transpose(1, 0, 2).reshape(s, h * d)

    def add(self, a, b):
        return self._r(a + b)

    def mul(self, a, b):
        with np.errstate(over="ignore", invalid="ignore"):
            return self._r(a * (self._r(b) if isinstance(b, np.ndarray) and b.ndim == 1 else b))

    def silu(self, x):
        with np.errstate(over="ignore"):
            return self._r(x / (1.0 + np.exp(-x)))

    def logits(self, x, head):
        return x @ self._r(head).T


class ReferenceDecoder:
    """The numpy reference forward pass with its static cache: ``run(ids, position)`` → logits [S, V]."""

    def __init__(self, cfg: DecoderConfig, weights: dict[str, np.ndarray], context: int, fp16: bool = False) -> None:
        self.cfg, self.w, self.context = cfg, weights, context
        self.ops = NumpyOps(cfg, context, fp16=fp16)

    @classmethod
    def from_checkpoint(cls, path: str | Path, context: int = 512, fp16: bool = False) -> ReferenceDecoder:
        """An HF checkpoint directory (config.json + model*.safetensors) → its reference decoder."""
        from safetensors.numpy import load_file

        path = Path(path)
        try:
            config = json.loads((path / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise OndeviceError(f"{shown(path / 'config.json')}: missing or unreadable; pass an HF checkpoint directory") from e
        files = sorted(path.glob("model*.safetensors"))
        if not files:
            raise OndeviceError(f"{shown(path)}: no model*.safetensors files; pass an HF checkpoint directory")
        tensors = [item for f in files for item in load_file(str(f)).items()]
        return cls(DecoderConfig.from_hf(config, path / "config.json"), load_weights(tensors), context, fp16)

    def run(self, ids, position: int) -> np.ndarray:
        if position < 0 or position + len(ids) > self.context:
            raise ValueError(f"positions {position}…{position + len(ids) - 1} outside the {self.context}-slot cache")
        return forward(self.ops, self.cfg, self.w, ids, position)
