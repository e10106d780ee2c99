"""Checking a converted EAGLE-3 draft: llama.cpp's eagle3 graph against a numpy forward of the source weights.

``reference`` is the draft's forward written from the checkpoint (HF layout, rotate-half RoPE), independent of
llama.cpp: fc on the concatenated target features (after ``input_norm`` when ``norm_before_fc``), the one
decoder layer over [norm(embed(token)) ; norm(g)] with causal attention over its own positions, the residual
from g (or from norm(g) when ``norm_before_residual``), the MLP, then ``norm`` and ``lm_head`` placed onto the
target vocabulary by d2t (−inf elsewhere).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from converters.eagle3_source import Eagle3Source, Target, rope_factors
from ondevice.errors import OndeviceError
from ondevice.formats.gguf import GGUFFile
from ondevice.formats.gguf_rows import TableRows


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope(x: np.ndarray, pos: np.ndarray, theta: float, factors: np.ndarray | None) -> np.ndarray:
    """HF rotate-half RoPE on [n, heads, hd] at positions ``pos``."""
    hd = x.shape[-1]
    inv = 1.0 / (theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
    if factors is not None:
        inv = inv / factors
    ang = pos[:, None].astype(np.float64) * inv[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def encode(src: Eagle3Source, features: np.ndarray) -> np.ndarray:
    """[n, 3 × target hidden] → g [n, hidden] (float64)."""
    f = np.asarray(features, np.float64)
    if src.norm_before_fc:
        f = _rms(f, src.float32("input_norm.weight"), src.eps)
    return f @ src.float32("fc.weight").T.astype(np.float64)


def reference(src: Eagle3Source, g: np.ndarray, tokens, embed: np.ndarray | TableRows, n_vocab: int,
              pos0: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The decoder on rows (tokens[i], g[i]) at positions pos0.. with causal attention over these rows only.

    Args:
        g: [n, hidden] rows (``encode`` output or pre-norm rows of a previous step).
        embed: the token table the draft embeds with ([n_vocab, hidden]: its own, or the target's, read by rows).
    Returns:
        (logits [n, n_vocab] with −inf outside d2t, pre-norm rows [n, hidden]), float64.
    """
    w = {n: src.float32(n).astype(np.float64) for n in src.names if n.startswith("layer.")}
    eps, nh, nkv, hd = src.eps, src.n_heads, src.n_kv_heads, src.head_dim
    n = len(tokens)
    g = np.asarray(g, np.float64)
    e = _rms(np.asarray(embed[np.asarray(tokens)], np.float64), w["layer.input_layernorm.weight"], eps)
    gn = _rms(g, w["layer.hidden_norm.weight"], eps)
    x = np.concatenate([e, gn], axis=-1)
    q = (x @ w["layer.self_attn.q_proj.weight"].T).reshape(n, nh, hd)
    k = (x @ w["layer.self_attn.k_proj.weight"].T).reshape(n, nkv, hd)
    v = (x @ w["layer.self_attn.v_proj.weight"].T).reshape(n, nkv, hd)
    pos = np.arange(pos0, pos0 + n)
    theta, factors = float(src.config.get("rope_theta", 10000.0)), rope_factors(src.config)
    q, k = _rope(q, pos, theta, factors), _rope(k, pos, theta, factors)
    rep = nh // nkv
    k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
    scores = np.einsum("ihd,jhd->hij", q, k) / np.sqrt(hd)
    scores = np.where(np.tril(np.ones((n, n), bool))[None], scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    attn = np.einsum("hij,jhd->ihd", p, v).reshape(n, nh * hd) @ w["layer.self_attn.o_proj.weight"].T
    h1 = attn + (gn if src.norm_before_residual else g)
    h2 = _rms(h1, w["layer.post_attention_layernorm.weight"], eps)
    gate = h2 @ w["layer.mlp.gate_proj.weight"].T
    mlp = ((gate / (1.0 + np.exp(-gate))) * (h2 @ w["layer.mlp.up_proj.weight"].T)) @ w["layer.mlp.down_proj.weight"].T
    pre = mlp + h1
    draft_logits = _rms(pre, src.float32("norm.weight"), eps) @ src.float32("lm_head.weight").T.astype(np.float64)
    logits = np.full((n, n_vocab), -np.inf)
    logits[:, src.d2t] = draft_logits
    return logits, pre


def target_embedding(target_gguf: Path) -> TableRows:
    """The token table of a target GGUF, read by rows (``TableRows``): the check embeds a dozen tokens."""
    g = GGUFFile(target_gguf)
    for t in g.reader.tensors:
        if t.name == "token_embd.weight":
            return TableRows(t)
    raise OndeviceError(f"{target_gguf}: no token_embd.weight")


def compare(src: Eagle3Source, graph, embed: np.ndarray | TableRows, *, n: int = 12, seed: int = 0) -> dict:
    """Feed the same random features and tokens to ``graph`` (``ondevice.backends.eagle3.Eagle3Graph``) and to
    ``reference``; return the largest errors: ``g_rel`` (encoder), ``logit_rel`` (max |Δ| / max |ref| over the
    draft vocabulary), ``pre_rel``, ``argmax_agree`` (fraction of rows) and ``inf_pattern_ok``."""
    rng = np.random.default_rng(seed)
    feats = rng.normal(size=(n, 3 * src.target_hidden)).astype(np.float32)
    tokens = rng.choice(src.d2t, size=n)  # any target token works; draft-vocabulary ones are the common case
    g_ref = encode(src, feats)
    graph.rollback(0)
    g = graph.encode(feats)
    logits, pre = graph.decode(tokens, g, 0)
    ref, pre_ref = reference(src, g_ref, tokens, embed, graph.vocab_size)
    finite = np.isfinite(ref)
    err = np.abs(logits[finite] - ref[finite]).max() / np.abs(ref[finite]).max()
    return {
        "rows": n,
        "g_rel": float(np.abs(g - g_ref).max() / np.abs(g_ref).max()),
        "logit_rel": float(err),
        "pre_rel": float(np.abs(pre - pre_ref).max() / np.abs(pre_ref).max()),
        "argmax_agree": float(np.mean(logits.argmax(-1) == ref.argmax(-1))),
        "inf_pattern_ok": bool(np.array_equal(np.isfinite(logits), finite)),
    }


# largest relative logit error accepted per matrix dtype, the draft run ``exact`` (measured on tiny drafts:
# f32 ~1e-6; f16 ~6e-4, llama.cpp rounding activations to f16 for f16 matrices; q8_0 .021-.026 and q4_0 .18-.19,
# quantization's own error, after the f16 file passed: these bounds catch a broken quantizer, not a layout bug)
TOLERANCE = {"f32": 1e-4, "f16": 1e-2, "q8_0": 0.08, "q4_0": 0.4}


def verify_eagle3(src: Eagle3Source, draft_gguf: Path, target: Target, dtype: str = "f16", mlx_target=None) -> dict:
    """Load the written draft in llama.cpp and ``compare`` it with the source; refuse (one line) beyond
    ``TOLERANCE``. A draft without its own token table needs the target as a GGUF (its table lives there).
    ``mlx_target``: an ``MLXBackend`` to run the draft on instead (``mlx_eagle3.Eagle3MLX``, as ``draft=`` does
    on that target; its own token table), with its layer inputs on."""
    from ondevice.backends.eagle3 import Eagle3Graph

    if mlx_target is not None:
        from ondevice.backends.mlx_eagle3 import Eagle3MLX

        embed = src.float32("embed_tokens.weight") if src.has("embed_tokens.weight") else mlx_target.token_table()
        return _judged(src, Eagle3MLX(draft_gguf, mlx_target, n_ctx=256), embed, draft_gguf, dtype, "MLX")
    if src.has("embed_tokens.weight"):
        embed, tgt = src.float32("embed_tokens.weight"), None
    elif target.path.suffix == ".gguf":
        from ondevice.backends.llama import LlamaBackend

        embed, tgt = target_embedding(target.path), LlamaBackend(target.path, n_ctx=256, n_batch=64)
    else:
        return {"skipped": "the draft embeds tokens with the target's table: pass the target as a GGUF to verify"}
    try:
        graph = Eagle3Graph(draft_gguf, tgt and tgt._ctx, tgt and tgt._model, n_ctx=256, n_batch=64, exact=True)
        return _judged(src, graph, embed, draft_gguf, dtype, "llama.cpp")
    finally:
        if tgt is not None:
            tgt.close()


def _judged(src: Eagle3Source, graph, embed: np.ndarray | TableRows, draft_gguf: Path, dtype: str, runtime: str) -> dict:
    """``compare`` on ``graph`` (closed after), refused (one line) beyond ``TOLERANCE``."""
    try:
        report = compare(src, graph, embed)
    finally:
        graph.close()
    report.update(ok=report["logit_rel"] <= TOLERANCE[dtype] and report["inf_pattern_ok"], runtime=runtime)
    if not report["ok"]:
        # quantization's own error past its bound: a wider type is the fix (the f16 file passed before quantizing)
        wider = {"q4_0": "q8_0 or f16", "q8_0": "f16"}.get(dtype)
        fix = f"; convert it {wider} (train-heads --draft-dtype, convert --quant)" if wider else ""
        raise OndeviceError(f"{draft_gguf.name}: {runtime}'s logits differ from the source's by {report['logit_rel']:.2e} "
                            f"(relative; {dtype} allows {TOLERANCE[dtype]:.0e}); conversion refused{fix}")
    return report
