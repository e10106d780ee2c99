"""DFlash draft checkpoint (HF layout, safetensors) → GGUF arch ``dflash``, as llama.cpp's conversion
(conversion/qwen.py ``DFlashModel``) writes it.

The checkpoint (e.g. z-lab's ``*-DFlash``): ``config.json`` with ``dflash_config`` (``target_layer_ids``,
``mask_token_id``, optional ``block_size``) and Qwen3 decoder layers (``layers.N.self_attn.{q,k,v,o}_proj``,
``q_norm``, ``k_norm``, ``input_layernorm``, ``post_attention_layernorm``, ``mlp.{gate,up,down}_proj``), ``fc``
and ``hidden_norm`` fusing the target's features, ``norm``, optionally ``embed_tokens`` / ``lm_head`` (without
them llama.cpp reads the target's through ``ctx_other``); names with or without a ``model.`` prefix. The GGUF
keeps the rotate-half (NeoX) rope layout, writes ``dflash.target_layers`` = ids + 1 (the *inputs* of the layers
after them), ``dflash.block_size``, the target's vocabulary and ``tokenizer.ggml.mask_token_id``. Everything is
checked against the target (hidden size, vocabulary, layer ids) before a byte is written; a pickle checkpoint is
refused unread. DFlash2 (per-layer block convolutions + candidate selector) and DSpark (Markov head, optional
confidence head) drafts of the Qwen family add their tensors and keys as llama.cpp's conversion names them
(``dflash.conv_kernel_size`` / ``conv_group_size`` / ``selector_rank`` / ``selector_top_k``;
``dflash.sample_from_anchor`` / ``has_confidence_head``); the layouts are in ``converters.dflash_source``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from converters.dflash_source import CONV, DFLASH2_KEYS, LAYER, TOP, DFlashSource, is_dflash, open_dflash
from converters.eagle3_source import Target, check_vocab
from ondevice.errors import OndeviceError

__all__ = ["DFlashSource", "check_against", "convert_dflash", "is_dflash", "open_dflash", "write_dflash_gguf"]


def check_against(src: DFlashSource, target: Target) -> list[int]:
    """Refuse, in one line, a draft made for another target; returns the GGUF layer ids (HF ids + 1)."""
    n_vocab, name = len(target.vocab.tokens), target.path.name
    if src.hidden != target.hidden:
        raise OndeviceError(f"{src.path}: hidden size {src.hidden}, {name} has {target.hidden}; this draft was made "
                            "for another target")
    check_vocab(src, target)
    for t in ("embed_tokens.weight", "lm_head.weight"):
        if src.has(t) and src.tensors.shape(src.names[t]) != (n_vocab, src.hidden):
            raise OndeviceError(f"{src.path}: {t} has shape {list(src.tensors.shape(src.names[t]))}, expected "
                                f"[{n_vocab}, {src.hidden}] for {name}")
    ids = [i + 1 for i in src.layer_ids]
    if any(not 1 <= i < target.n_layers for i in ids):
        raise OndeviceError(f"{src.path}: reads target layers {src.layer_ids} but {name} has {target.n_layers} "
                            f"layers (the inputs of layers {ids} are needed); this draft was made for another target")
    if not 0 <= int(src.dflash["mask_token_id"]) < n_vocab:
        raise OndeviceError(f"{src.path}: mask_token_id {src.dflash['mask_token_id']} is outside {name}'s vocabulary")
    return ids


def gguf_tensors(src: DFlashSource):
    """(GGUF name, HF name) in the order they are written."""
    for hf, g in TOP.items():
        if src.has(hf):
            yield g, hf
    for i in range(src.n_layers):
        for hf, g in (LAYER | CONV if src.variant == "dflash2" else LAYER).items():
            yield f"blk.{i}.{g}", f"layers.{i}.{hf}"


def _stored(g: str, shape: tuple[int, ...], dtype: str) -> np.dtype:
    """Matrices in ``dtype``; vectors and the convolutions' base kernels (added to f32 coefficients) f32."""
    f16 = dtype == "f16" and len(shape) >= 2 and not g.endswith("_conv_base")
    return np.dtype(np.float16 if f16 else np.float32)


def write_dflash_gguf(src: DFlashSource, target: Target, ids: list[int], out: Path, *, dtype: str = "f16") -> int:
    """Write the GGUF at ``out`` (matrices ``dtype`` f16 | f32, vectors f32); returns the parameter count."""
    import gguf

    from converters.gguf_writer import write_streamed, write_vocab

    if dtype not in ("f16", "f32"):
        raise OndeviceError(f"--dtype {dtype}: choose f16 or f32")
    cfg, w = src.config, gguf.GGUFWriter(str(out), "dflash")
    try:
        w.add_name(cfg.get("_name_or_path") or src.path.name)
        w.add_context_length(int(cfg.get("max_position_embeddings", 4096)))
        w.add_embedding_length(src.hidden)
        w.add_block_count(src.n_layers)
        w.add_feed_forward_length(int(cfg["intermediate_size"]))
        w.add_head_count(src.n_heads)
        w.add_head_count_kv(src.n_kv_heads)
        w.add_key_length(src.head_dim)
        w.add_value_length(src.head_dim)
        w.add_rope_freq_base(src.theta)
        w.add_layer_norm_rms_eps(src.eps)
        w.add_vocab_size(len(target.vocab.tokens))
        w.add_array("dflash.target_layers", ids)
        w.add_uint32("dflash.block_size", src.block_size)
        if src.variant == "dflash2":
            for key in DFLASH2_KEYS:
                w.add_uint32(f"dflash.{key}", src.conv(key))
        if src.variant == "dspark":
            w.add_bool("dflash.sample_from_anchor", src.sample_from_anchor)
            w.add_bool("dflash.has_confidence_head", src.has("confidence_head.proj.weight"))
        causal = cfg.get("is_causal", src.dflash.get("causal"))
        if causal is not None:
            w.add_bool("dflash.attention.causal", bool(causal))
        w.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if dtype == "f16" else gguf.LlamaFileType.ALL_F32)
        write_vocab(w, target.vocab)
        w.add_uint32("tokenizer.ggml.mask_token_id", int(src.dflash["mask_token_id"]))
        # header first (shapes from the safetensors headers), then one tensor at a time (``write_streamed``)
        planned = []
        for g, hf in gguf_tensors(src):
            shape = src.tensors.shape(src.names[hf])
            planned.append((g, shape, _stored(g, shape, dtype)))
        counts = write_streamed(w, planned, ((g, src.float32(hf)) for g, hf in gguf_tensors(src)), str(src.path))
        return sum(counts.values())
    finally:
        w.close()


def convert_dflash(src: str | Path, *, target: str | Path, out: str | Path, dtype: str = "f16",
                   verify: bool = True) -> dict:
    """``ondevice convert DFLASH_DIR --to gguf --target TARGET --out DIR``: write ``DIR/model.gguf`` (arch dflash)
    and ``DIR/manifest.json``, atomically (nothing is left behind on any error or refusal).

    Args:
        src: the DFlash checkpoint directory.
        target: the target it drafts for: an HF checkpoint directory or a GGUF (file or ``convert`` output dir).
        out: a new directory.
        dtype: f16 | f32 for the matrices.
        verify: compare the written draft's block logits (llama.cpp's dflash graph) with a numpy forward of the
            source weights given the same random target features (``converters.dflash_check``); needs the target
            as a GGUF (llama.cpp checks the draft against it, and may read its embeddings / LM head).
    Returns:
        Summary: arch, layer ids, block size, sizes, ``verify`` (max relative logit error).
    Raises:
        OndeviceError: one line, for any refusal.
    """
    from converters.output import convert_draft

    def write(draft: DFlashSource, tgt: Target, ids: list[int], path: Path) -> dict:
        n = write_dflash_gguf(draft, tgt, ids, path, dtype=dtype)
        variant = {"variant": draft.variant} if draft.variant in ("dflash2", "dspark") else {}  # plain DFlash's as before
        return {"format": "gguf", "arch": "dflash", **variant, "dtype": dtype, "path": "model.gguf", "target": str(tgt.path),
                "target_layers": ids, "block_size": draft.block_size, "own_head": draft.has("lm_head.weight"),
                "n_params": n, "size_bytes": path.stat().st_size}

    def verified(draft: DFlashSource, path: Path, tgt: Target) -> dict:
        from converters.dflash_check import verify_dflash

        return verify_dflash(draft, path, tgt, dtype)

    return convert_draft(src, target, out, arch="dflash", dtype=dtype, open_draft=open_dflash, check=check_against,
                         write=write, verify=verified if verify else None)
