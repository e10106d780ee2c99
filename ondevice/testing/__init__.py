"""Tiny deterministic models for tests: random-weight HF checkpoints with a trained tokenizer.

Architectures: llama, mistral, qwen2, qwen3 (q/k norms), gemma3_text (norm offset, sliding window,
q/k norms, GELU); tokenizers: every family of ``ondevice.testing.tokenizers``. Every dimension is a
multiple of 256 (and of the MLX group size), so llama.cpp's K-quants and mlx-lm's quantizer really
quantize every linear layer instead of silently falling back.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ondevice.testing.corpus import corpus  # noqa: F401  (re-exported: tests and benches use it)

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
ARCHS = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")
# The tokenizer each architecture gets by default (its real models' family).
DEFAULT_TOKENIZER = {"llama": "smollm", "mistral": "llama-spm", "qwen2": "qwen2", "qwen3": "qwen2", "gemma3_text": "gemma"}
HF_CLASS = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}

def train_tokenizer(arch: str, vocab_size: int = 512, family: str | None = None):
    """Train the tokenizer of ``family`` (default: the architecture's own) with exactly ``vocab_size`` tokens."""
    from ondevice.testing.tokenizers import train

    return train(family or DEFAULT_TOKENIZER[arch], vocab_size)


def _config(arch: str, n_layers: int, vocab_size: int, tie: bool, **overrides) -> dict:
    cfg = {
        "architectures": [HF_CLASS[arch]],
        "model_type": arch,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": n_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": vocab_size,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5 if arch in ("llama", "mistral") else 1e-6,
        "rope_theta": 10000.0 if arch in ("llama", "mistral") else 1000000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": tie,
        "bos_token_id": 0,
        "eos_token_id": 2,
        "torch_dtype": "float16",
    }
    if arch in ("qwen2", "qwen3", "mistral"):
        cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=n_layers)
    if arch == "qwen3":
        cfg.update(head_dim=128, attention_bias=False)  # explicit head_dim: 4 × 128 ≠ hidden 256
    if arch == "gemma3_text":
        del cfg["hidden_act"]
        # every other layer slides over 16 positions, so a 64-token probe crosses the window
        cfg.update(head_dim=256, num_key_value_heads=1, query_pre_attn_scalar=256, hidden_activation="gelu_pytorch_tanh",
                   sliding_window=16, sliding_window_pattern=2, rope_local_base_freq=10000.0,
                   layer_types=["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n_layers)],
                   final_logit_softcapping=None, attn_logit_softcapping=None, attention_bias=False)
    cfg.update(overrides)
    return cfg


def _weights(cfg: dict, seed: int, scale: float = 1.0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    h, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    if h * v + cfg["num_hidden_layers"] * 4 * h * f > 50_000_000:  # synthetic big shapes: float32 draws in place
        return _big_weights(cfg, rng, scale)
    arch = cfg["model_type"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    qd, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    gemma = arch == "gemma3_text"
    norm_base = 0.0 if gemma else 1.0  # Gemma's RMSNorm computes x·(1 + w)

    def lin(out_dim: int, in_dim: int, gain: float = 1.0) -> np.ndarray:
        return rng.normal(0.0, gain * scale / np.sqrt(in_dim), (out_dim, in_dim))

    # Depth-scaled residual branches (as GPT-2 scales its output projections by 1/sqrt(2L)), normalised
    # so 2-layer models keep their weights: the residual stream of a deeper random model then keeps the
    # scale of a 2-layer one (12 layers: f16 relative logit error 0.020 → 0.018 against the source).
    depth = min(1.0, float(np.sqrt(2.0 / cfg["num_hidden_layers"])))

    def norm(n: int) -> np.ndarray:
        return norm_base + 0.1 * rng.normal(size=n)

    # Tied models read logits off the embedding: keep it small, or every token predicts itself
    # (Gemma multiplies the embedding by sqrt(hidden) = 16 on the way in).
    emb_std = (0.25 / 16 if gemma else 0.25) if cfg["tie_word_embeddings"] else 1.0
    w = {"model.embed_tokens.weight": rng.normal(0.0, emb_std * scale, (v, h))}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(h)
        w[p + "post_attention_layernorm.weight"] = norm(h)
        w[p + "self_attn.q_proj.weight"] = lin(qd, h, 2.0)
        w[p + "self_attn.k_proj.weight"] = lin(kv, h, 2.0)
        w[p + "self_attn.v_proj.weight"] = lin(kv, h)
        w[p + "self_attn.o_proj.weight"] = lin(h, qd, 2.0 * depth)
        w[p + "mlp.gate_proj.weight"] = lin(f, h)
        w[p + "mlp.up_proj.weight"] = lin(f, h)
        w[p + "mlp.down_proj.weight"] = lin(h, f, 2.0 * depth)
        if arch == "qwen2":
            w[p + "self_attn.q_proj.bias"] = 0.1 * scale * rng.normal(size=qd)
            w[p + "self_attn.k_proj.bias"] = 0.1 * scale * rng.normal(size=kv)
            w[p + "self_attn.v_proj.bias"] = 0.1 * scale * rng.normal(size=kv)
        if arch in ("qwen3", "gemma3_text"):
            w[p + "self_attn.q_norm.weight"] = norm(hd)
            w[p + "self_attn.k_norm.weight"] = norm(hd)
        if gemma:
            w[p + "pre_feedforward_layernorm.weight"] = norm(h)
            w[p + "post_feedforward_layernorm.weight"] = norm(h)
    w["model.norm.weight"] = norm(h)
    if not cfg["tie_word_embeddings"]:
        w["lm_head.weight"] = lin(v, h, 4.0)
    return w


def _big_weights(cfg: dict, rng, scale: float) -> dict[str, np.ndarray]:
    """Same layout as ``_weights`` for shape-true synthetic models, drawn as float16 to bound memory."""
    h, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    qd, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd

    def lin(o, i):
        return (rng.standard_normal((o, i), dtype=np.float32) * (scale / np.sqrt(i))).astype(np.float16)

    w = {"model.embed_tokens.weight": (rng.standard_normal((v, h), dtype=np.float32) * 0.02).astype(np.float16)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = np.ones(h, np.float16)
        w[p + "post_attention_layernorm.weight"] = np.ones(h, np.float16)
        for name, (o, n) in {"self_attn.q_proj": (qd, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
                             "self_attn.o_proj": (h, qd), "mlp.gate_proj": (f, h), "mlp.up_proj": (f, h),
                             "mlp.down_proj": (h, f)}.items():
            w[p + name + ".weight"] = lin(o, n)
        if cfg["model_type"] == "qwen2":
            for name, n in (("q_proj", qd), ("k_proj", kv), ("v_proj", kv)):
                w[p + f"self_attn.{name}.bias"] = np.zeros(n, np.float16)
    w["model.norm.weight"] = np.ones(h, np.float16)
    if not cfg["tie_word_embeddings"]:
        w["lm_head.weight"] = lin(v, h)
    return w


def make_tiny_hf(
    out: str | Path,
    arch: str = "llama",
    *,
    n_layers: int = 2,
    vocab_size: int = 512,
    seed: int = 0,
    tie_word_embeddings: bool | None = None,
    perturb_seed: int | None = None,
    perturb_scale: float = 0.0,
    tokenizer_vocab: int | None = None,
    tokenizer: str | None = None,
    **config_overrides,
) -> Path:
    """Write a deterministic random-weight HF checkpoint to ``out`` and return it.

    Args:
        out: directory to create (config.json, model.safetensors, tokenizer.json, tokenizer_config.json).
        arch: one of ``ARCHS``: "llama" (SmolLM2-like, tied), "mistral" (untied), "qwen2" (q/k/v biases,
            untied), "qwen3" (q/k norms, head_dim 128, tied), "gemma3_text" (norm offset, sliding window, tied).
        n_layers: decoder layers (2–4 is plenty).
        vocab_size: tokenizer and embedding size (a multiple of 256).
        seed: weight seed; the tokenizer is the same for every seed, so models pair as target/draft.
        perturb_seed, perturb_scale: add ``perturb_scale`` × an independent draw, to make a draft that
            is close to, but not equal to, the model with ``seed``.
        tokenizer_vocab: train the tokenizer to this size (default ``vocab_size``); the embedding
            keeps ``vocab_size`` rows, the converter pads the vocabulary (shape-true synthetic models).
        tokenizer: a family of ``ondevice.testing.tokenizers.FAMILIES`` (default: the architecture's own);
            "spm-model" writes a SentencePiece tokenizer.model and no tokenizer.json.
    Returns:
        The checkpoint directory.
    """
    from safetensors.numpy import save_file

    from ondevice.testing.tokenizers import special_ids, specials

    if arch not in ARCHS:
        raise ValueError(f"unsupported tiny arch {arch!r}; one of {', '.join(ARCHS)}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    family = tokenizer or DEFAULT_TOKENIZER[arch]
    sp, ids = specials(family), special_ids(family)
    tie = (arch in ("llama", "qwen3", "gemma3_text")) if tie_word_embeddings is None else tie_word_embeddings
    cfg = _config(arch, n_layers, vocab_size, tie, bos_token_id=ids["bos"], eos_token_id=ids["eos"], **config_overrides)
    weights = _weights(cfg, seed)
    if perturb_seed is not None and perturb_scale:
        noise = _weights(cfg, perturb_seed)
        weights = {k: w + perturb_scale * noise[k] for k, w in weights.items()}
    save_file({k: np.ascontiguousarray(v, dtype=np.float16) for k, v in weights.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    if family == "spm-model":
        from ondevice.testing.tokenizers import train_sentencepiece_model

        (out / "tokenizer.model").write_bytes(train_sentencepiece_model(tokenizer_vocab or vocab_size))
    else:
        train_tokenizer(arch, tokenizer_vocab or vocab_size, family).save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": sp[ids["bos"]],
        "eos_token": sp[ids["eos"]],
        "pad_token": sp[ids["pad"]] if "pad" in ids else None,
        "unk_token": sp[ids["unk"]] if "unk" in ids else None,
        "add_bos_token": family in ("llama-spm", "gemma", "spm-model"),  # SentencePiece models start with BOS
        "model_max_length": cfg["max_position_embeddings"],
        "chat_template": CHATML_TEMPLATE,
        "added_tokens_decoder": {
            str(i): {"content": t, "special": True, "lstrip": False, "rstrip": False, "normalized": False,
                     "single_word": False}
            for i, t in enumerate(sp)
        },
    }, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": ids["bos"], "eos_token_id": ids["eos"]}))
    return out
