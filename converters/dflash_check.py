"""Checking a converted DFlash draft: llama.cpp's dflash graph against a numpy forward of the source weights.

``reference`` is the draft's block forward written from the checkpoint (HF layout, rotate-half RoPE),
independent of llama.cpp: the target features of the context positions fused by ``fc`` + ``hidden_norm`` give
each layer's context K / V (``k_proj`` + ``k_norm`` + RoPE at their positions, ``v_proj``); the block
``[token, mask × k]`` at the next positions runs the Qwen3 layers with attention over context + block (both
ways), then ``norm`` and the LM head (the draft's own, else its embeddings when tied, else the target's).

DFlash2 adds, per layer, a block convolution (``_conv``: per block position t, taps over positions t, t − 1, …
of the block, weights = ``base_kernel`` + coefficients projected from the normed input per group of dimensions)
on the attention's input and output and on the MLP's input and output; its selector lattice (top-k candidates
of each row, scores ``successor[c] · (predecessor[prev] ⊙ hidden_projection · h) + logit[c]``) is checked too.
DSpark adds ``markov_w2 · markov_w1[prev]`` to each draft row, prev being the anchor for the first draft and the
argmax of the row before after that (as the graph chains it); its confidence head (when present) is checked too.
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


def _conv(x: np.ndarray, dyn: np.ndarray, base: np.ndarray, side: int, group: int) -> np.ndarray:
    """DFlash2's block convolution of ``x`` [T, H] (side 0: a sublayer's input, 1: its output): out[t] =
    Σ_tap (coef[t, tap] + base[side, tap]) · x[t − tap] over taps < min(kernel, T), x before the block = 0;
    ``dyn`` [T, 2 · kernel · H / group] holds coef[t, side, tap, group]."""
    t_len, h = x.shape
    kern = base.shape[1]
    coef = dyn.reshape(t_len, 2, kern, h // group)[:, side]
    weight = np.repeat(coef, group, axis=-1) + base[side][None]
    out = np.zeros_like(x)
    for tap in range(min(kern, t_len)):
        out[tap:] += weight[tap:, tap] * x[: t_len - tap]
    return out


def forward(src: DFlashSource, feats: np.ndarray, tokens, embed: np.ndarray,
            head: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The block's logits [len(tokens), vocab] (every row, before any Markov bias) and final normed hidden states
    [len(tokens), hidden], float64.

    Args:
        feats: [n, L × hidden] target features of context positions 0..n−1.
        tokens: the block: the last token, then masks, at positions n...
        embed, head: [vocab, hidden] token table and LM head.
    """
    def w(name: str) -> np.ndarray:
        return src.float32(name).astype(np.float64)

    dflash2 = src.variant == "dflash2"
    group = src.conv("conv_group_size") if dflash2 else 0

    eps, nh, nkv, hd = src.eps, src.n_heads, src.n_kv_heads, src.head_dim
    n, m = len(feats), len(tokens)
    g = _rms(np.asarray(feats, np.float64) @ w("fc.weight").T, w("hidden_norm.weight"), eps)
    pos_c, pos_b = np.arange(n), np.arange(n, n + m)
    x = np.asarray(embed[np.asarray(tokens)], np.float64)
    for i in range(src.n_layers):
        p = f"layers.{i}."
        a = _rms(x, w(p + "input_layernorm.weight"), eps)
        if dflash2:
            dyn_a, base_a = a @ w(p + "attention_conv.kernel_projection.weight").T, w(p + "attention_conv.base_kernel")
            a = _conv(a, dyn_a, base_a, 0, group)
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
        o = np.einsum("hij,jhd->ihd", pr, v).reshape(m, nh * hd) @ w(p + "self_attn.o_proj.weight").T
        x = x + (_conv(o, dyn_a, base_a, 1, group) if dflash2 else o)
        h2 = _rms(x, w(p + "post_attention_layernorm.weight"), eps)
        if dflash2:
            dyn_f, base_f = h2 @ w(p + "mlp_conv.kernel_projection.weight").T, w(p + "mlp_conv.base_kernel")
            h2 = _conv(h2, dyn_f, base_f, 0, group)
        gate = h2 @ w(p + "mlp.gate_proj.weight").T
        f = ((gate / (1.0 + np.exp(-gate))) * (h2 @ w(p + "mlp.up_proj.weight").T)) @ w(p + "mlp.down_proj.weight").T
        x = x + (_conv(f, dyn_f, base_f, 1, group) if dflash2 else f)
    hn = _rms(x, w("norm.weight"), eps)
    return hn @ np.asarray(head, np.float64).T, hn


def reference(src: DFlashSource, feats: np.ndarray, tokens, embed: np.ndarray, head: np.ndarray) -> np.ndarray:
    """Plain DFlash's block logits [len(tokens) − 1, vocab] (rows 1..: q of the drafted tokens), float64; the
    arguments as ``forward``'s."""
    return forward(src, feats, tokens, embed, head)[0][1:]


def markov_rows(src: DFlashSource, base: np.ndarray, anchor: int, assumed: np.ndarray) -> np.ndarray:
    """DSpark: draft rows ``base`` [k, vocab] plus the Markov bias of the anchor (row 0) and of the argmax of
    ``assumed``'s previous row (the graph's rows: it chains on its own output) after that."""
    w1 = src.float32("markov_head.markov_w1.weight").astype(np.float64)
    w2 = src.float32("markov_head.markov_w2.weight").astype(np.float64)
    prev = [int(anchor)] + [int(np.argmax(r)) for r in assumed[:-1]]
    return base + w1[prev] @ w2.T


def confidence_error(src: DFlashSource, conf: np.ndarray, hidden: np.ndarray, anchor: int,
                     assumed: np.ndarray) -> float:
    """DSpark: the largest absolute error of the graph's confidences ``conf`` [k] against
    sigmoid(proj · [h; markov_w1[prev]] + bias), h the reference's final normed hidden states [k, hidden] and prev
    chained as in ``markov_rows``."""
    w1 = src.float32("markov_head.markov_w1.weight").astype(np.float64)
    prev = [int(anchor)] + [int(np.argmax(r)) for r in assumed[:-1]]
    z = np.concatenate([hidden, w1[prev]], axis=1) @ src.float32("confidence_head.proj.weight").astype(np.float64)[0]
    z = z + float(src.float32("confidence_head.proj.bias")[0])
    return float(np.abs(conf - 1.0 / (1.0 + np.exp(-z))).max())


def lattice_error(src: DFlashSource, lattice: np.ndarray, logits: np.ndarray, hidden: np.ndarray,
                  anchor: int) -> float:
    """DFlash2: the largest relative error of the graph's selector ``lattice`` [k, n_embd] (positions 1..k)
    against the reference's ``logits`` / ``hidden`` [k, ·] of the same positions, given the graph's own
    candidates (inf when a candidate set differs from the reference's top-k)."""
    k = src.conv("selector_top_k")
    prev_cb = src.float32("candidate_selector.predecessor_codebook").astype(np.float64)
    next_cb = src.float32("candidate_selector.successor_codebook").astype(np.float64)
    gates = hidden @ src.float32("candidate_selector.hidden_projection.weight").astype(np.float64).T
    err, scale, before = 0.0, 1e-30, np.array([int(anchor)])
    for j, row in enumerate(lattice):
        cand = np.rint(row[:k]).astype(np.int64)
        if set(cand.tolist()) != set(np.argsort(-logits[j])[:k].tolist()):
            return float("inf")
        score = (prev_cb[before] * gates[j]) @ next_cb[cand].T + logits[j][cand]  # [n_pred, k]
        got = row[k: k + k * k].reshape(k, k)
        err, scale = max(err, float(np.abs(got - score).max())), max(scale, float(np.abs(score).max()))
        before = cand  # position 1's predecessor is the anchor (its scores repeat over the slots); then candidates
    return err / scale


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
        k = min(4, graph.max_draft)
        feats = rng.normal(size=(n, len(graph.layers) * src.hidden)).astype(np.float32)
        token = int(rng.integers(graph.vocab_size))
        graph.observe(feats, 0)
        got, lattice, conf = graph.draft(token, k), graph.lattice, graph.confidence
        mask, first = graph.mask_id, int(graph.max_draft < graph.block_size)
    finally:
        if graph is not None:
            graph.close()
        tgt.close()
    logits, hidden = forward(src, feats, [token] + [mask] * (k - 1 + first), embed, head)
    ref = logits[first:]
    if src.variant == "dspark":
        ref = markov_rows(src, ref, token, got)
    err = float(np.abs(got - ref).max() / np.abs(ref).max())
    if src.variant == "dflash2":
        err = max(err, lattice_error(src, lattice, ref, hidden[first:], token))
    if conf is not None:  # probabilities: their absolute error
        err = max(err, confidence_error(src, conf, hidden[first:], token, got))
    # the target's (quantized or f16) embeddings / LM head: llama.cpp rounds activations to f16 against them
    tol = TOLERANCE[dtype] if src.has("embed_tokens.weight") and src.has("lm_head.weight") else TOLERANCE["f16"]
    report = {"rows": k, "context": n, "logit_rel": err, "tolerance": tol,
              "argmax_agree": float(np.mean(got.argmax(-1) == ref.argmax(-1))), "ok": err <= tol}
    if not report["ok"]:
        raise OndeviceError(f"{draft_gguf.name}: llama.cpp's block logits differ from the source's by {err:.2e} "
                            f"(relative; {tol:.0e} allowed); conversion refused")
    return report
