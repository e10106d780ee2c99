"""EAGLE-3 draft checkpoint (safetensors) → GGUF arch ``eagle3``, as llama.cpp's own conversion writes it.

Two layouts are read (``ondevice.testing.eagle3`` writes both): SafeAILab / SpecForge (``midlayer.*``, a llama
config with ``num_hidden_layers: 1`` and ``draft_vocab_size``) and RedHat speculators (``layers.0.*``, the layer
config nested in ``transformer_layer_config``). The GGUF holds the draft's one decoder layer, ``fc`` (3 target
layer features → draft hidden), ``d2t`` as *absolute* target ids (int64), the target's vocabulary (the draft
speaks the target's tokens), and the keys ``eagle3.target_layers`` / ``target_hidden_size`` /
``norm_before_residual`` / ``norm_before_fc``. A draft without ``embed_tokens`` is written without
``token_embd``: llama.cpp embeds its tokens with the target's table through ``ctx_other`` at run time.

Reading the checkpoint: ``converters.eagle3_source``. Everything is checked against the target (hidden size,
vocabulary, layer ids) before a byte is written; a pickle checkpoint is refused unread.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from converters.eagle3_source import (
    GGUF_NAMES,
    Eagle3Source,
    Target,
    check_vocab,
    is_eagle3,
    open_eagle3,
    rope_factors,
    target_info,
)
from ondevice.errors import OndeviceError, shown

__all__ = ["DTYPES", "Eagle3Source", "Target", "check_against", "convert_eagle3", "is_eagle3", "open_eagle3",
           "target_info", "write_eagle3_gguf"]

# the matrices' type: f32 / f16 written as such; q8_0 / q4_0 written f16, then quantized by llama.cpp's own
# quantizer (``llama_model_quantize``): the draft is read once per drafted token, so its bytes are its cost
DTYPES = ("f32", "f16", "q8_0", "q4_0")


def layer_ids(src: Eagle3Source, target: Target) -> list[int]:
    """The 3 target layers whose *inputs* the draft reads: the config's ``eagle_aux_hidden_state_layer_ids``, else
    llama.cpp's default [2, L // 2, L − 3]; refused unless each is a layer of the target."""
    ids = src.config.get("eagle_aux_hidden_state_layer_ids")
    n = target.n_layers
    ids = [int(i) for i in ids] if ids else [2, n // 2, n - 3]
    if len(ids) != 3 or any(not 0 <= i < n for i in ids):
        raise OndeviceError(f"{src.path}: reads target layers {ids} but {target.path.name} has {n} layers (0..{n - 1}); "
                            "this draft was made for another target")
    return ids


def check_against(src: Eagle3Source, target: Target) -> list[int]:
    """Refuse, in one line, a draft made for another target; returns its layer ids."""
    n_vocab = len(target.vocab.tokens)
    if src.target_hidden != target.hidden:
        raise OndeviceError(f"{src.path}: made for a target of hidden size {src.target_hidden}, {target.path.name} has "
                            f"{target.hidden}; this draft was made for another target")
    check_vocab(src, target)
    if src.d2t.size and (src.d2t.min() < 0 or src.d2t.max() >= n_vocab):
        raise OndeviceError(f"{src.path}: d2t names target token {int(src.d2t.max())} but {target.path.name} has "
                            f"{n_vocab}; this draft was made for another target")
    if src.has("t2d") and src.tensors.shape(src.names["t2d"]) != (n_vocab,):
        raise OndeviceError(f"{src.path}: t2d covers {src.tensors.shape(src.names['t2d'])} tokens, {target.path.name} "
                            f"has {n_vocab}; this draft was made for another target")
    if src.has("embed_tokens.weight") and src.tensors.shape(src.names["embed_tokens.weight"]) != (n_vocab, src.hidden):
        raise OndeviceError(f"{src.path}: embed_tokens has shape {list(src.tensors.shape(src.names['embed_tokens.weight']))}"
                            f", expected [{n_vocab}, {src.hidden}] for {target.path.name}")
    if not src.has("embed_tokens.weight") and src.hidden != target.hidden:
        raise OndeviceError(f"{src.path}: has no embed_tokens and a hidden size ({src.hidden}) unlike the target's "
                            f"({target.hidden}), so it cannot embed with the target's table")
    return layer_ids(src, target)


def _permute(t: np.ndarray, n_head: int) -> np.ndarray:
    """HF rotate-half rows → llama.cpp's interleaved rope rows (the eagle3 graph uses rope type NORM)."""
    return t.reshape(n_head, 2, t.shape[0] // n_head // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)


def gguf_tensors(src: Eagle3Source):
    """(GGUF name, array in llama.cpp's layout) for every tensor the GGUF holds, d2t last (int64)."""
    for name, gname in GGUF_NAMES.items():
        if not src.has(name):
            continue
        t = src.float32(name)
        if name == "layer.self_attn.q_proj.weight":
            t = _permute(t, src.n_heads)
        elif name == "layer.self_attn.k_proj.weight":
            t = _permute(t, src.n_kv_heads)
        yield gname, t
    factors = rope_factors(src.config)
    if factors is not None:
        yield "rope_freqs.weight", factors
    if src.has("d2t"):
        yield "d2t", src.d2t


def tensor_shapes(src: Eagle3Source) -> list[tuple[str, tuple[int, ...]]]:
    """(GGUF name, numpy shape) of what ``gguf_tensors`` yields, in its order, read from the headers only."""
    out = [(g, src.tensors.shape(src.names[n])) for n, g in GGUF_NAMES.items() if src.has(n)]
    if rope_factors(src.config) is not None:
        out.append(("rope_freqs.weight", (src.head_dim // 2,)))
    if src.has("d2t"):
        out.append(("d2t", src.d2t.shape))
    return out


def write_eagle3_gguf(src: Eagle3Source, target: Target, ids: list[int], out: Path, *, dtype: str = "f16",
                      meta: dict[str, str] | None = None) -> dict:
    """Write the GGUF at ``out`` (matrices ``dtype`` f16 | f32, vectors f32, d2t int64), with ``meta`` as extra
    string keys; returns counts per tensor."""
    import gguf

    from converters.gguf_writer import write_streamed, write_vocab

    if dtype not in ("f16", "f32"):
        raise OndeviceError(f"--dtype {dtype}: choose f16 or f32")
    arch, cfg = "eagle3", src.config
    w = gguf.GGUFWriter(str(out), arch)
    try:
        w.add_name(cfg.get("_name_or_path") or src.path.name)
        w.add_context_length(int(cfg.get("max_position_embeddings", 2048)))
        w.add_embedding_length(src.hidden)
        w.add_block_count(1)
        w.add_feed_forward_length(int(cfg["intermediate_size"]))
        w.add_head_count(src.n_heads)
        w.add_head_count_kv(src.n_kv_heads)
        w.add_rope_dimension_count(src.head_dim)
        w.add_rope_freq_base(float(cfg.get("rope_theta", 10000.0)))
        w.add_layer_norm_rms_eps(src.eps)
        if src.head_dim != src.hidden // src.n_heads:
            w.add_key_length(src.head_dim)
            w.add_value_length(src.head_dim)
        w.add_vocab_size(len(target.vocab.tokens))
        w.add_array(f"{arch}.target_layers", ids)
        w.add_uint32(f"{arch}.target_hidden_size", src.target_hidden)
        w.add_bool(f"{arch}.norm_before_residual", src.norm_before_residual)
        w.add_bool(f"{arch}.norm_before_fc", src.norm_before_fc)
        w.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if dtype == "f16" else gguf.LlamaFileType.ALL_F32)
        for key, value in (meta or {}).items():
            w.add_string(key, value)
        write_vocab(w, target.vocab)
        # header first (shapes from the safetensors headers), then one tensor at a time (``write_streamed``)
        planned = [(name, shape, np.dtype(np.int64 if name == "d2t" else
                                          np.float16 if dtype == "f16" and len(shape) >= 2 else np.float32))
                   for name, shape in tensor_shapes(src)]
        return write_streamed(w, planned, gguf_tensors(src), str(src.path))
    finally:
        w.close()


def convert_eagle3(src: str | Path, *, target: str | Path, out: str | Path, dtype: str = "f16",
                   verify: bool = True, meta: dict[str, str] | None = None, mlx_target=None) -> dict:
    """``ondevice convert EAGLE_DIR --to gguf --target TARGET --out DIR``: write ``DIR/model.gguf`` (arch eagle3)
    and ``DIR/manifest.json``, atomically (nothing is left behind on any error or refusal).

    Args:
        src: the EAGLE-3 checkpoint directory (either layout).
        target: the target it drafts for: an HF checkpoint directory or a GGUF (file or ``convert`` output dir).
        out: a new directory.
        dtype: the matrices' type, one of ``DTYPES`` (q8_0 / q4_0: llama.cpp's quantizer on the f16 file).
        verify: compare the written draft's logits (llama.cpp's eagle3 graph) with a numpy forward of the
            source weights, given the same random target features and tokens (``converters.eagle3_check``).
        meta: extra string keys for the GGUF (``train-heads`` records what it trained on).
        mlx_target: verify in MLX on this ``MLXBackend`` (layer inputs on) instead of llama.cpp: ``train-heads``
            for an MLX target, whose GGUF ``mlx_eagle3`` runs.
            The draft's own token embeddings are used when it has them; otherwise the target's, which needs the
            target as a GGUF.
    Returns:
        Summary: arch, layout, layer ids, sizes, tensor count, ``verify`` (max abs / relative logit error); a
        quantized draft also ``fallbacks``: matrices llama.cpp left f16 (rows not a multiple of its block).
    Raises:
        OndeviceError: one line, for any refusal (``open_eagle3``, ``check_against``).
    """
    from converters.output import convert_draft

    if dtype not in DTYPES:
        raise OndeviceError(f"dtype={dtype!r}: choose one of {', '.join(DTYPES)} (ondevice convert: --quant)")
    if mlx_target is not None and dtype not in ("f16", "f32"):
        raise OndeviceError(f"dtype={dtype!r}: an MLX target runs its drafter from an f16 or f32 GGUF")

    checked: dict = {}  # a quantized draft's f16 file, verified before quantizing

    def write(draft: Eagle3Source, tgt: Target, ids: list[int], path: Path) -> dict:
        extra = {}
        if dtype in ("f16", "f32"):
            counts = write_eagle3_gguf(draft, tgt, ids, path, dtype=dtype, meta=meta)
        else:
            from converters.quantize import llama_quantize

            f16 = path.with_name("model.f16.gguf")  # inside convert_draft's temporary directory
            counts = write_eagle3_gguf(draft, tgt, ids, f16, dtype="f16", meta=meta)
            if verify:  # the conversion itself, to f16's tolerance; the quantized file is checked after, to its own
                from converters.eagle3_check import verify_eagle3

                checked["f16"] = verify_eagle3(draft, f16, tgt, "f16")
            llama_quantize(f16, path, dtype, name=f"{shown(src)} (the draft, written f16)")
            f16.unlink()
            from converters.quant_types import tensor_types, weight_fallbacks

            # llama.cpp keeps a matrix whose rows are not a multiple of the 32-wide block f16, silently: say which
            extra = {"fallbacks": weight_fallbacks(tensor_types(path), dtype)}
        return {"format": "gguf", "arch": "eagle3", "layout": draft.layout, "dtype": dtype, "path": "model.gguf",
                "target": str(tgt.path), "target_layers": ids, "draft_vocab": int(draft.d2t.size),
                "own_embeddings": draft.has("embed_tokens.weight"), "n_params": sum(counts.values()),
                "size_bytes": path.stat().st_size, **extra}

    def verified(draft: Eagle3Source, path: Path, tgt: Target) -> dict:
        from converters.eagle3_check import verify_eagle3

        return {**verify_eagle3(draft, path, tgt, dtype, mlx_target=mlx_target), **checked}

    return convert_draft(src, target, out, arch="eagle3", dtype=dtype, open_draft=open_eagle3, check=check_against,
                         write=write, verify=verified if verify else None)
