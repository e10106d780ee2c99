"""A tiny random-weight DFlash block drafter (GGUF arch ``dflash``) for a target of ``ondevice.testing.mtp``.

What llama.cpp's ``dflash`` graph needs (src/models/dflash.cpp; conversion/qwen.py writes real ones):
Qwen3-style decoder layers (q/k norms, NEOX rope, SwiGLU), ``fc`` [n_target_layers × target hidden → hidden]
and ``enc.output_norm`` fusing the target's layer inputs, ``output_norm``, and either its own
``token_embd`` / ``output`` (written here) or the target's through ``ctx_other``; metadata
``dflash.target_layers`` (the target layer ids whose *inputs* it reads: HF ``target_layer_ids`` + 1),
``dflash.block_size`` and the tokenizer's ``mask_token_id``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ondevice.testing.gguf_file import gguf_writer
from ondevice.testing.mtp import MtpShape, add_test_vocab


def make_tiny_dflash_gguf(out: str | Path, *, target: MtpShape | None = None, target_layers: tuple[int, ...] = (0, 1),
                          n_layer: int = 1, n_embd: int = 256, n_ff: int = 512, n_head: int = 4, n_head_kv: int = 2,
                          head_dim: int = 64, block_size: int = 4, mask_token_id: int | None = None,
                          own_head: bool = True, favourites: Sequence[int] | None = None, preference: float = 0.0,
                          seed: int = 0) -> Path:
    """Write a random DFlash draft for targets of shape ``target`` (their hidden size and vocabulary).

    Args:
        out: the .gguf file (written whole or not at all).
        target: the target's shape (default ``MtpShape()``).
        target_layers: target layer ids whose inputs the draft fuses (each < the target's trunk layers).
        block_size: the trained block (drafts at most block_size - 1 tokens per pass).
        mask_token_id: the noise token (default: the last vocabulary id).
        own_head: write ``token_embd`` / ``output``; False leaves them out, as published drafts do (they read
            the target's through ``ctx_other``; ``n_embd`` must then be the target's).
        favourites: a reduced draft vocabulary (target ids): its own LM head over them and ``d2t`` (absolute
            target ids, int64, as llama.cpp's conversion writes it), so the draft proposes only those tokens
            (logits −inf elsewhere); tests make its q overlap a random target's p this way.
        preference: with ``favourites`` (in order of preference) and its own embeddings: a logit bias falling
            from ``preference`` for the first favourite to 0 for the last, on top of the random logits. Hidden
            dimension 0 carries it: every embedding holds a constant there, no layer writes to it, and the head's
            column 0 scales it into the bias.
    Returns:
        ``out`` as a Path.
    """
    import gguf

    t_shape = target or MtpShape()
    if not target_layers or max(target_layers) >= t_shape.n_layer:
        raise ValueError(f"target_layers {target_layers} must be ids below the target's {t_shape.n_layer} layers")
    v, h = t_shape.vocab_size, n_embd
    rng = np.random.default_rng(seed)

    def lin(o: int, i: int, gain: float = 1.0) -> np.ndarray:
        return (rng.standard_normal((o, i)) * (gain / np.sqrt(i))).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    t = {"token_embd.weight": (0.5 * rng.standard_normal((v, h))).astype(np.float32),
         "output.weight": lin(v, h, 4.0), "output_norm.weight": norm(h),
         "fc.weight": lin(h, len(target_layers) * t_shape.n_embd), "enc.output_norm.weight": norm(h)}
    if not own_head:
        if n_embd != t_shape.n_embd:
            raise ValueError(f"a draft sharing the target's embeddings needs n_embd {t_shape.n_embd}, not {n_embd}")
        del t["token_embd.weight"], t["output.weight"]
    if favourites is not None:
        fav = np.array(sorted({int(x) for x in favourites}), np.int64)
        if not fav.size or fav.min() < 0 or fav.max() >= v:
            raise ValueError(f"favourites must be target token ids in 0..{v - 1}")
        t["output.weight"], t["d2t"] = lin(fav.size, h, 1.0 if preference else 4.0), fav  # milder noise under a bias
        if preference:
            if not own_head:
                raise ValueError("preference needs the draft's own embeddings (own_head=True)")
            t["token_embd.weight"][:, 0] = 16.0  # ~11 after the final RMSNorm (the other dims are ~0.5)
            rank = {int(x): i for i, x in enumerate(dict.fromkeys(int(x) for x in favourites))}
            bias = preference * (1.0 - np.array([rank[int(x)] for x in fav]) / max(1, len(rank) - 1))
            t["output.weight"][:, 0] = bias / 11.0
    for i in range(n_layer):
        p = f"blk.{i}."
        t.update({p + "attn_norm.weight": norm(h), p + "attn_q.weight": lin(n_head * head_dim, h, 2.0),
                  p + "attn_k.weight": lin(n_head_kv * head_dim, h, 2.0), p + "attn_v.weight": lin(n_head_kv * head_dim, h),
                  p + "attn_output.weight": lin(h, n_head * head_dim), p + "attn_q_norm.weight": norm(head_dim),
                  p + "attn_k_norm.weight": norm(head_dim), p + "ffn_norm.weight": norm(h),
                  p + "ffn_gate.weight": lin(n_ff, h), p + "ffn_up.weight": lin(n_ff, h), p + "ffn_down.weight": lin(h, n_ff)})
        if preference:  # no layer writes hidden dimension 0 (it carries the favourites' bias)
            t[p + "attn_output.weight"][0] = 0.0
            t[p + "ffn_down.weight"][0] = 0.0
    out = Path(out)
    with gguf_writer(out, "dflash", t) as w:
        w.add_name("tiny-dflash")
        w.add_file_type(gguf.LlamaFileType.ALL_F32)
        w.add_context_length(4096)
        w.add_embedding_length(h)
        w.add_block_count(n_layer)
        w.add_feed_forward_length(n_ff)
        w.add_head_count(n_head)
        w.add_head_count_kv(n_head_kv)
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_rope_freq_base(1e6)
        w.add_layer_norm_rms_eps(1e-6)
        w.add_array("dflash.target_layers", [int(x) for x in target_layers])
        w.add_uint32("dflash.block_size", block_size)
        add_test_vocab(w, v)
        w.add_uint32("tokenizer.ggml.mask_token_id", v - 1 if mask_token_id is None else mask_token_id)
    return out


def make_tiny_dflash_hf(out: str | Path, *, hidden: int = 256, vocab_size: int = 512, layer_ids: Sequence[int] = (0, 2),
                        n_layer: int = 1, n_ff: int = 512, n_head: int = 4, n_kv_head: int = 2, head_dim: int = 64,
                        block_size: int = 5, mask_token_id: int | None = None, own_head: bool = False,
                        dtype: str = "float32", seed: int = 0) -> Path:
    """Write a random DFlash draft checkpoint in the HF layout (z-lab's ``*-DFlash``: config.json with
    ``dflash_config``, Qwen3 layers under ``layers.N.``, ``fc``, ``hidden_norm``, ``norm``; ``embed_tokens`` /
    ``lm_head`` only with ``own_head``) for ``ondevice convert DFLASH_DIR --to gguf --target TARGET``.

    Args:
        layer_ids: the HF ``target_layer_ids`` (the draft reads the *outputs* of these target layers).
        dtype: float32 | float16 of the stored tensors.
    Returns:
        The directory.
    """
    import json

    from safetensors.numpy import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    h = hidden

    def lin(o: int, i: int, gain: float = 1.0) -> np.ndarray:
        return rng.standard_normal((o, i)) * (gain / np.sqrt(i))

    def norm(n: int) -> np.ndarray:
        return 1.0 + 0.1 * rng.standard_normal(n)

    t = {"fc.weight": lin(h, len(layer_ids) * h), "hidden_norm.weight": norm(h), "norm.weight": norm(h)}
    if own_head:
        t["embed_tokens.weight"], t["lm_head.weight"] = 0.5 * rng.standard_normal((vocab_size, h)), lin(vocab_size, h, 4.0)
    for i in range(n_layer):
        p = f"layers.{i}."
        t.update({p + "input_layernorm.weight": norm(h), p + "post_attention_layernorm.weight": norm(h),
                  p + "self_attn.q_proj.weight": lin(n_head * head_dim, h, 2.0),
                  p + "self_attn.k_proj.weight": lin(n_kv_head * head_dim, h, 2.0),
                  p + "self_attn.v_proj.weight": lin(n_kv_head * head_dim, h),
                  p + "self_attn.o_proj.weight": lin(h, n_head * head_dim), p + "self_attn.q_norm.weight": norm(head_dim),
                  p + "self_attn.k_norm.weight": norm(head_dim), p + "mlp.gate_proj.weight": lin(n_ff, h),
                  p + "mlp.up_proj.weight": lin(n_ff, h), p + "mlp.down_proj.weight": lin(h, n_ff)})
    save_file({k: np.asarray(v, dtype) for k, v in t.items()}, str(out / "model.safetensors"))
    cfg = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": h, "num_hidden_layers": n_layer,
           "num_attention_heads": n_head, "num_key_value_heads": n_kv_head, "head_dim": head_dim,
           "intermediate_size": n_ff, "rms_norm_eps": 1e-6, "rope_theta": 1e6, "vocab_size": vocab_size,
           "hidden_act": "silu", "max_position_embeddings": 4096, "block_size": block_size,
           "dflash_config": {"target_layer_ids": [int(i) for i in layer_ids],
                             "mask_token_id": vocab_size - 1 if mask_token_id is None else int(mask_token_id)}}
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return out

