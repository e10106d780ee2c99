"""Checking a converted DFlash draft: llama.cpp's dflash graph against a numpy forward of the source weights.

``reference`` is the draft's block forward written from the checkpoint (HF layout, rotate-half RoPE),
independent of llama.cpp: the target features of the context positions fused by ``fc`` + ``hidden_norm`` give
each layer's context K / V (``k_proj`` + ``k_norm`` + RoPE at their positions, ``v_proj``); the block
``[token, mask × k]`` at the next positions runs the Qwen3 layers with attention over context + block (both
ways), then ``norm`` and the LM head (the draft's own, else its embeddings when tied, else the target's).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from converters.dflash_source import DFlashSource
from converters.eagle3_check import _rms, _rope
from converters.eagle3_source import Target
from ondevice.errors import OndeviceError

# largest relative logit error accepted per matrix dtype, the draft run ``exact`` (f32 KV cache)
TOLERANCE = {"f32": 1e-4, "f16": 1e-2}


def _heads(x: np.ndarray, n: int, hd: int, w: np.ndarray | None, eps: float) -> np.ndarray:
    x = x.reshape(x.shape[0], n, hd)
    return x if w is None else _rms(x, w, eps)


def reference(src: DFlashSource, feats: np.ndarray, tokens, embed: np.ndarray, head: np.ndarray) -> np.ndarray:
    """Block logits [len(tokens) − 1, vocab] (rows 1..: q of the drafted tokens), float64.

    Args:
        feats: [n, L × hidden] target features of context positions 0..n−1.
        tokens: the block: the last token, then masks, at positions n...
        embed, head: [vocab, hidden] token table and LM head.
    """
    def w(name: str) -> np.ndarray:
        return src.float32(name).astype(np.float64)

    eps, nh, nkv, hd = src.eps, src.n_heads, src.n_kv_heads, src.head_dim
    n, m = len(feats), len(tokens)
    g = _rms(np.asarray(feats, np.float64) @ w("fc.weight").T, w("hidden_norm.weight"), eps)
    pos_c, pos_b = np.arange(n), np.arange(n, n + m)
    x = np.asarray(embed[np.asarray(tokens)], np.float64)
    for i in range(src.n_layers):
        p = f"layers.{i}."
        a = _rms(x, w(p + "input_layernorm.weight"), eps)
        q = _rope(_heads(a @ w(p + "self_attn.q_proj.weight").T, nh, hd, w(p + "self_attn.q_norm.weight"), eps),
                  pos_b, src.theta, None)
        ks = [_rope(_heads(h @ w(p + "self_attn.k_proj.weight").T, nkv, hd, w(p + "self_attn.k_norm.weight"), eps),
                    pos, src.theta, None) for h, pos in ((g, pos_c), (a, pos_b))]
        vs = [_heads(h @ w(p + "self_attn.v_proj.weight").T, nkv, hd, None, eps) for h in (g, a)]
        k = np.repeat(np.concatenate(ks), nh // nkv, axis=1)
        v = np.repeat(np.concatenate(vs), nh // nkv, axis=1)
        s = np.einsum("ihd,jhd->hij", q, k) / np.sqrt(hd)
        pr = np.exp(s - s.max(-1, keepdims=True))
        pr /= pr.sum(-1, keepdims=True)
        x = x + np.einsum("hij,jhd->ihd", pr, v).reshape(m, nh * hd) @ w(p + "self_attn.o_proj.weight").T
        h2 = _rms(x, w(p + "post_attention_layernorm.weight"), eps)
        gate = h2 @ w(p + "mlp.gate_proj.weight").T
        x = x + ((gate / (1.0 + np.exp(-gate))) * (h2 @ w(p + "mlp.up_proj.weight").T)) @ w(p + "mlp.down_proj.weight").T
    return (_rms(x, w("norm.weight"), eps) @ np.asarray(head, np.float64).T)[1:]


def _gguf_matrix(path: Path, names: tuple[str, ...]) -> np.ndarray:
    """The first of ``names`` in a GGUF, dequantized to float32 [rows, cols]."""
    import gguf

    from ondevice.formats.gguf import GGUFFile

    tensors = {t.name: t for t in GGUFFile(path).reader.tensors}
    for name in names:
        if name in tensors:
            t = tensors[name]
            arr = np.asarray(gguf.dequantize(t.data, t.tensor_type), dtype=np.float32)
            return arr.reshape([int(d) for d in reversed(t.shape)])
    raise OndeviceError(f"{path}: none of {', '.join(names)}")


def verify_dflash(src: DFlashSource, draft_gguf: Path, target: Target, dtype: str = "f16", *, n: int = 6,
                  seed: int = 0) -> dict:
    """Load the written draft in llama.cpp beside the target (a GGUF), inject the same random features, draft one
    block and compare with ``reference``; refuse (one line) beyond ``TOLERANCE``."""
    from ondevice.backends.llama import LlamaBackend
    from ondevice.backends.llama_dflash import DFlashGraph

    if target.path.suffix != ".gguf":
        return {"skipped": "llama.cpp runs a DFlash draft beside its target: pass the target as a GGUF to verify"}
    embed = src.float32("embed_tokens.weight") if src.has("embed_tokens.weight") else \
        _gguf_matrix(target.path, ("token_embd.weight",))
    head = src.float32("lm_head.weight") if src.has("lm_head.weight") else embed if src.has("embed_tokens.weight") \
        else _gguf_matrix(target.path, ("output.weight", "token_embd.weight"))
    rng = np.random.default_rng(seed)
    tgt, graph = LlamaBackend(target.path, n_ctx=256, n_batch=64), None
    try:  # nothing is decoded on the target: its layer-input recording stays off
        graph = DFlashGraph(draft_gguf, tgt._model, lambda ids: tgt._ctx, n_ctx=256, threads=None, n_batch=64,
                            exact=True)
        k = min(4, graph.block_size - 1)
        feats = rng.normal(size=(n, len(graph.layers) * src.hidden)).astype(np.float32)
        token = int(rng.integers(graph.vocab_size))
        graph.observe(feats, 0)
        got = graph.draft(token, k)
        mask = graph.mask_id
    finally:
        if graph is not None:
            graph.close()
        tgt.close()
    ref = reference(src, feats, [token] + [mask] * k, embed, head)
    err = float(np.abs(got - ref).max() / np.abs(ref).max())
    # the target's (quantized or f16) embeddings / LM head: llama.cpp rounds activations to f16 against them
    tol = TOLERANCE[dtype] if src.has("embed_tokens.weight") and src.has("lm_head.weight") else TOLERANCE["f16"]
    report = {"rows": k, "context": n, "logit_rel": err, "tolerance": tol,
              "argmax_agree": float(np.mean(got.argmax(-1) == ref.argmax(-1))), "ok": err <= tol}
    if not report["ok"]:
        raise OndeviceError(f"{draft_gguf.name}: llama.cpp's block logits differ from the source's by {err:.2e} "
                            f"(relative; {tol:.0e} allowed); conversion refused")
    return report
