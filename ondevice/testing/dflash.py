"""A tiny random-weight DFlash block drafter (GGUF arch ``dflash``) for a target of ``ondevice.testing.mtp``.

What llama.cpp's ``dflash`` graph needs (src/models/dflash.cpp; conversion/qwen.py writes real ones):
Qwen3-style decoder layers (q/k norms, NEOX rope, SwiGLU), ``fc`` [n_target_layers × target hidden → hidden]
and ``enc.output_norm`` fusing the target's layer inputs, ``output_norm``, and either its own
``token_embd`` / ``output`` (written here) or the target's through ``ctx_other``; metadata
``dflash.target_layers`` (the target layer ids whose *inputs* it reads: HF ``target_layer_ids`` + 1),
``dflash.block_size`` and the tokenizer's ``mask_token_id``. DFlash2 adds per-layer block convolutions and a
candidate selector, DSpark a Markov head and a confidence head (``variant``; the graph's use of them is described in
``ondevice.backends.llama_dflash_heads``). ``make_tiny_dflash_hf`` writes the same families as HF checkpoints.
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
                          variant: str = "dflash", conv_kernel: int = 3, conv_group: int = 32, selector_rank: int = 16,
                          selector_top_k: int = 4, selector_gain: float = 1.0, markov_rank: int = 32,
                          markov_gain: float = 2.0, repeat: float = 0.0, sample_from_anchor: bool = True,
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
        variant: dflash | dflash2 (per-layer block convolutions of ``conv_kernel`` taps over groups of
            ``conv_group`` dimensions and a candidate selector keeping ``selector_top_k`` (llama.cpp needs
            n_embd % conv_group == 0 and n_embd ≥ top_k · (top_k + 1)), its transition scores of size about
            ``selector_gain``) | dspark (a Markov head of ``markov_rank`` whose bias on a row has a standard
            deviation of about ``markov_gain``, and a confidence head; ``sample_from_anchor``: the anchor's row
            is the first draft's).
        repeat: DSpark / DFlash2: on top of the random weights, the Markov bias (DFlash2: with ``preference``, the
            selector's transition score) favours repeating the previous token by about ``repeat`` logits, so a
            position's row depends strongly on the token drafted before it (tests of that conditioning).
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
        if variant == "dflash2":  # base kernels near a pass-through (tap 0 ≈ 1), dynamic coefficients small
            for c in ("attn_conv", "ffn_conv"):
                base = (0.3 * rng.standard_normal((2, conv_kernel, h))).astype(np.float32)
                base[:, 0] += 1.0
                t[f"{p}{c}_base"] = base
                t[f"{p}{c}_proj.weight"] = lin(2 * conv_kernel * (h // conv_group), h, 0.3)
    n_draft = t["output.weight"].shape[0] if "output.weight" in t else v
    if variant == "dflash2":  # gate ~ hidden_projection · h: the h of a preference draft has a large dimension 0
        t.update({"selector_predecessor.weight": rng.standard_normal((v, selector_rank)).astype(np.float32),
                  "selector_successor.weight": rng.standard_normal((v, selector_rank)).astype(np.float32),
                  "selector_hidden.weight": lin(selector_rank, h, selector_gain / np.sqrt(selector_rank))})
        if preference:  # dimension 0 of the final normed h is ~11 (see preference): it scales a repeat bias
            t["selector_hidden.weight"][:, 0] = repeat / (11.0 * selector_rank)
            if repeat:  # score(t | p) ≈ gate · C[t]·C[p]: largest at t = p
                t["selector_successor.weight"] = t["selector_predecessor.weight"].copy()
    elif variant == "dspark":
        t["markov_w1.weight"] = rng.standard_normal((v, markov_rank)).astype(np.float32)
        t["markov_w2.weight"] = lin(n_draft, markov_rank, markov_gain)
        rows = t["d2t"] if "d2t" in t else np.arange(v)
        t["markov_w2.weight"] += (repeat / markov_rank) * t["markov_w1.weight"][rows]  # bias(p)[t] ≈ repeat at t = p
        t["conf_proj.weight"], t["conf_proj.bias"] = lin(1, h + markov_rank), np.zeros(1, np.float32)
    elif variant != "dflash":
        raise ValueError(f"variant {variant!r}: dflash | dflash2 | dspark")
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
        if variant == "dflash2":
            for key, val in (("conv_kernel_size", conv_kernel), ("conv_group_size", conv_group),
                             ("selector_rank", selector_rank), ("selector_top_k", selector_top_k)):
                w.add_uint32(f"dflash.{key}", val)
        if variant == "dspark":
            w.add_bool("dflash.sample_from_anchor", sample_from_anchor)
            w.add_bool("dflash.has_confidence_head", True)
        add_test_vocab(w, v)
        w.add_uint32("tokenizer.ggml.mask_token_id", v - 1 if mask_token_id is None else mask_token_id)
    return out


def make_tiny_dflash_hf(out: str | Path, *, hidden: int = 256, vocab_size: int = 512, layer_ids: Sequence[int] = (0, 2),
                        n_layer: int = 1, n_ff: int = 512, n_head: int = 4, n_kv_head: int = 2, head_dim: int = 64,
                        block_size: int = 5, mask_token_id: int | None = None, own_head: bool = False,
                        dtype: str = "float32", variant: str = "dflash", conv_kernel: int = 3, conv_group: int = 32,
                        selector_rank: int = 16, selector_top_k: int = 4, markov_rank: int = 32,
                        confidence: bool = True, sample_from_anchor: bool | None = None, seed: int = 0) -> Path:
    """Write a random DFlash-family draft checkpoint in the HF layout (z-lab's ``*-DFlash``: config.json with
    ``dflash_config``, Qwen3 layers under ``layers.N.``, ``fc``, ``hidden_norm``, ``norm``; ``embed_tokens`` /
    ``lm_head`` only with ``own_head``) for ``ondevice convert DFLASH_DIR --to gguf --target TARGET``.

    Args:
        layer_ids: the HF ``target_layer_ids`` (the draft reads the *outputs* of these target layers).
        dtype: float32 | float16 of the stored tensors.
        variant: dflash | dflash2 (DFlash2DraftModel: per-layer ``attention_conv`` / ``mlp_conv`` of
            ``conv_kernel`` taps over groups of ``conv_group`` dimensions, a candidate selector of
            ``selector_rank`` keeping ``selector_top_k``; llama.cpp needs hidden % conv_group == 0 and
            hidden ≥ top_k · (top_k + 1)) | dspark (Qwen3DSparkModel: a Markov head of ``markov_rank``, a
            confidence head with ``confidence``; ``target_layer_ids`` / ``mask_token_id`` at the config's top
            level, as DSpark exports keep them; ``sample_from_anchor`` written when not None).
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
        if variant == "dflash2":  # base kernels near a pass-through (tap 0 ≈ 1), dynamic coefficients small
            for c in ("attention_conv.", "mlp_conv."):
                base = 0.3 * rng.standard_normal((2, conv_kernel, h))
                base[:, 0] += 1.0
                t[p + c + "base_kernel"] = base
                t[p + c + "kernel_projection.weight"] = lin(2 * conv_kernel * (h // conv_group), h, 0.3)
    if variant == "dflash2":
        t.update({"candidate_selector.predecessor_codebook": rng.standard_normal((vocab_size, selector_rank)),
                  "candidate_selector.successor_codebook": rng.standard_normal((vocab_size, selector_rank)),
                  "candidate_selector.hidden_projection.weight": lin(selector_rank, h, 2.0)})
    if variant == "dspark":
        t["markov_head.markov_w1.weight"] = rng.standard_normal((vocab_size, markov_rank))
        t["markov_head.markov_w2.weight"] = lin(vocab_size, markov_rank, 3.0)
        if confidence:
            t["confidence_head.proj.weight"], t["confidence_head.proj.bias"] = lin(1, h + markov_rank), np.full(1, 0.5)
    save_file({k: np.asarray(v, dtype) for k, v in t.items()}, str(out / "model.safetensors"))
    cfg = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": h, "num_hidden_layers": n_layer,
           "num_attention_heads": n_head, "num_key_value_heads": n_kv_head, "head_dim": head_dim,
           "intermediate_size": n_ff, "rms_norm_eps": 1e-6, "rope_theta": 1e6, "vocab_size": vocab_size,
           "hidden_act": "silu", "max_position_embeddings": 4096, "block_size": block_size,
           "dflash_config": {"target_layer_ids": [int(i) for i in layer_ids],
                             "mask_token_id": vocab_size - 1 if mask_token_id is None else int(mask_token_id)}}
    if variant == "dflash2":
        cfg["architectures"] = ["DFlash2DraftModel"]
        cfg["dflash_config"].update(conv_kernel_size=conv_kernel, conv_group_size=conv_group,
                                    selector_rank=selector_rank, selector_top_k=selector_top_k)
    elif variant == "dspark":
        cfg["architectures"], cfg["markov_head_type"] = ["Qwen3DSparkModel"], "vanilla"
        cfg.update(cfg.pop("dflash_config"))
        if sample_from_anchor is not None:
            cfg["sample_from_anchor"] = bool(sample_from_anchor)
    elif variant != "dflash":
        raise ValueError(f"variant {variant!r}: dflash | dflash2 | dspark")
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return out

