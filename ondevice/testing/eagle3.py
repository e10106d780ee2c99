"""Tiny random-weight EAGLE-3 draft checkpoints, in the two layouts users download.

- ``"specforge"`` (SafeAILab EAGLE / SpecForge): ``config.json`` is a llama config with ``num_hidden_layers: 1``
  and ``draft_vocab_size``; tensors ``midlayer.*``, ``fc``, ``norm``, ``lm_head``, ``d2t``, ``t2d`` and optionally
  ``embed_tokens`` (``input_norm`` when ``norm_before_fc``).
- ``"speculators"`` (RedHat speculators ``Eagle3Speculator``): the same tensors with ``layers.0.*`` instead of
  ``midlayer.*``, the layer config nested in ``transformer_layer_config``, ``norm_before_residual`` on top.

``d2t`` holds offsets (target id = i + d2t[i]) and ``t2d`` a bool mask over the target vocabulary, as trained
checkpoints store them.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

LAYOUTS = ("specforge", "speculators")


def make_tiny_eagle3(
    out: str | Path,
    *,
    target_hidden: int = 256,
    vocab_size: int = 512,
    layout: str = "specforge",
    hidden: int | None = None,
    draft_vocab: int = 128,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    intermediate: int = 512,
    layer_ids: list[int] | None = None,
    own_embeddings: bool = True,
    norm_before_residual: bool | None = None,
    norm_before_fc: bool = False,
    rope_scaling: dict | None = None,
    rope_theta: float = 10000.0,
    dtype: str = "float16",
    with_d2t: bool = True,
    seed: int = 0,
) -> Path:
    """Write a random-weight EAGLE-3 checkpoint for a target of hidden size ``target_hidden`` and vocabulary
    ``vocab_size`` to ``out`` (config.json + model.safetensors) and return ``out``.

    Args:
        layout: "specforge" or "speculators" (``LAYOUTS``).
        hidden: the draft's hidden size (default: the target's; it must be the target's when
            ``own_embeddings`` is False, as the draft then embeds tokens with the target's table).
        draft_vocab: rows of ``lm_head`` (the draft vocabulary), a random subset of the target's ids via ``d2t``.
        layer_ids: ``eagle_aux_hidden_state_layer_ids`` written to the config (None: not written, the
            converter then takes llama.cpp's default [2, L // 2, L − 3]).
        own_embeddings: write ``embed_tokens.weight`` (else the converted draft uses the target's).
        norm_before_residual: written to the config (None: not written; speculators' default is True).
        norm_before_fc: write ``input_norm.weight`` and set the flag (EAGLE-3.1 drafts).
        rope_scaling: e.g. llama-3.1's ``{"rope_type": "llama3", "factor": 8.0, ...}``.
        dtype: "float16", "bfloat16" (what trained checkpoints ship) or "float32" storage of the float tensors.
        with_d2t: False: no vocabulary reduction (``draft_vocab`` is the target's, no d2t / t2d tensors).
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r}: one of {', '.join(LAYOUTS)}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    h = hidden or target_hidden
    draft_vocab = draft_vocab if with_d2t else vocab_size
    hd = h // n_heads

    def lin(o: int, i: int, gain: float = 1.0) -> np.ndarray:
        return rng.normal(0.0, gain / np.sqrt(i), (o, i))

    def norm(n: int) -> np.ndarray:
        return 1.0 + 0.1 * rng.normal(size=n)

    layer = {
        "input_layernorm.weight": norm(h),
        "hidden_norm.weight": norm(h),
        "post_attention_layernorm.weight": norm(h),
        "self_attn.q_proj.weight": lin(n_heads * hd, 2 * h, 2.0),
        "self_attn.k_proj.weight": lin(n_kv_heads * hd, 2 * h, 2.0),
        "self_attn.v_proj.weight": lin(n_kv_heads * hd, 2 * h),
        "self_attn.o_proj.weight": lin(h, n_heads * hd),
        "mlp.gate_proj.weight": lin(intermediate, h),
        "mlp.up_proj.weight": lin(intermediate, h),
        "mlp.down_proj.weight": lin(h, intermediate),
    }
    prefix = "midlayer." if layout == "specforge" else "layers.0."
    w = {prefix + k: v for k, v in layer.items()}
    w["fc.weight"] = lin(h, 3 * target_hidden)
    w["norm.weight"] = norm(h)
    w["lm_head.weight"] = lin(draft_vocab, h, 4.0)
    if own_embeddings:
        w["embed_tokens.weight"] = rng.normal(0.0, 1.0, (vocab_size, h))
    if norm_before_fc:
        w["input_norm.weight"] = norm(3 * target_hidden)
    tensors = {k: _stored(v, dtype) for k, v in w.items()}
    if with_d2t:
        ids = np.sort(rng.choice(vocab_size, size=draft_vocab, replace=False))
        d2t = (ids - np.arange(draft_vocab)).astype(np.int64)
        tensors["d2t"] = ("I64", d2t.tobytes(), d2t.shape)
        mask = np.zeros(vocab_size, dtype=bool)
        mask[ids] = True
        tensors["t2d"] = ("BOOL", mask.tobytes(), mask.shape)
    _save(tensors, out / "model.safetensors")

    llama = {
        "model_type": "llama",
        "hidden_size": h,
        "intermediate_size": intermediate,
        "num_hidden_layers": 1,
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads,
        "vocab_size": vocab_size,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_theta": rope_theta,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
    }
    if rope_scaling:
        llama["rope_scaling"] = rope_scaling
    if layout == "specforge":
        cfg = {"architectures": ["LlamaForCausalLMEagle3"], **llama, "draft_vocab_size": draft_vocab}
        if target_hidden != h:
            cfg["target_hidden_size"] = target_hidden
    else:
        cfg = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
               "transformer_layer_config": {**llama, "architectures": ["LlamaForCausalLM"]},
               "draft_vocab_size": draft_vocab, "target_hidden_size": target_hidden if target_hidden != h else None,
               "norm_before_residual": True if norm_before_residual is None else norm_before_residual}
    if layout == "specforge" and norm_before_residual is not None:
        cfg["norm_before_residual"] = norm_before_residual
    if norm_before_fc:
        cfg["norm_before_fc"] = True
    if layer_ids is not None:
        cfg["eagle_aux_hidden_state_layer_ids"] = list(layer_ids)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def _stored(a: np.ndarray, dtype: str) -> tuple[str, bytes, tuple[int, ...]]:
    """(safetensors dtype, bytes, shape) of ``a`` stored as ``dtype`` (bfloat16 rounded to nearest even)."""
    if dtype == "bfloat16":
        u = np.ascontiguousarray(a, np.float32).view(np.uint32)
        bits = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
        return "BF16", bits.tobytes(), a.shape
    store, name = {"float16": (np.float16, "F16"), "float32": (np.float32, "F32")}[dtype]
    return name, np.ascontiguousarray(a, store).tobytes(), a.shape


def _save(tensors: dict[str, tuple[str, bytes, tuple[int, ...]]], path: Path) -> None:
    """Write a safetensors file by hand (the numpy binding cannot store bfloat16)."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (dt, data, shape) in tensors.items():
        header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for _, data, _ in tensors.values():
            f.write(data)
