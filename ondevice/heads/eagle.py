"""The EAGLE-style drafter trained by ``train-heads`` (in JAX): its weights, its forward unrolled over drafting
depths ("training-time test"), the loss and one optimiser step.

Layout = a SpecForge EAGLE-3 checkpoint (HF names, ``x @ W.T``), so ``converters.eagle3`` writes it as a GGUF
of arch ``eagle3`` that llama.cpp's own graph runs, and ``converters.eagle3_check.reference`` (numpy) is its
independent forward. One decoder layer, shared across depths:

    g_p    = fc(rms(f_p))                  f_p = the inputs of 3 target layers at position p (width 3·h_t)
    x      = [rms(E[t_{p+1}]) ; rms(g_p)]  the token after p (embedded with the target's table) and the feature
    h1     = Attn(x) + g_p                 causal attention over the draft's own positions, RoPE
    pre_p  = h1 + MLP(rms(h1))             fed back as g at the next depth
    logits = lm_head · rms(pre_p)          over the draft vocabulary (rows of the target's own LM head at start)

Drafting from base b (target features known up to b, x_{b+1} pending): depth 0 is the row (x_{b+1}, g_b) at
position b; depth j the row (x̂_{b+j+1}, pre of depth j−1) at position b + j. Training runs every base of a
sequence at once: step j's query at position p is depth j of base p − j, which attends to the step-0 keys at
positions ≤ p − j and to the step-i key at position p − j + i for i = 1..j (its own earlier depths), exactly the
draft's KV cache while it drafts (EAGLE-3's training-time test; tested against ``reference`` on that cache).
Every step predicts the target's distribution at row p + 1 (the tokens fed are the target's, i.e. what an
accepted draft is); loss = Σ_j 0.8^j · soft cross-entropy to the target's top-k probabilities.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from ondevice.errors import OndeviceError

NEG = -1e30  # a masked score (not −inf: its gradient would be NaN where a row is all masked)
DECAY = 0.8  # weight of depth j's loss: DECAY ** j


@dataclass(frozen=True)
class Shape:
    """The drafter's sizes (the target's hidden size, heads and RoPE, a chosen MLP width and draft vocabulary)."""

    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn: int
    draft_vocab: int
    n_feat: int = 3  # target layers fused by fc
    eps: float = 1e-5
    rope_theta: float = 10000.0

    def config(self, target_vocab: int, layer_ids: list[int], extra: dict | None = None) -> dict:
        """The checkpoint's config.json (SpecForge layout, read by ``converters.eagle3_source``)."""
        return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_act": "silu",
                "hidden_size": self.hidden, "target_hidden_size": self.hidden, "num_attention_heads": self.n_heads,
                "num_key_value_heads": self.n_kv_heads, "head_dim": self.head_dim, "intermediate_size": self.ffn,
                "num_hidden_layers": 1, "rms_norm_eps": self.eps, "rope_theta": self.rope_theta,
                "vocab_size": int(target_vocab), "draft_vocab_size": self.draft_vocab,
                "eagle_aux_hidden_state_layer_ids": [int(i) for i in layer_ids], "norm_before_fc": True,
                "norm_before_residual": False, "max_position_embeddings": 32768, "ondevice": extra or {},
                "shape": asdict(self)}


def fused_layers(layers, n_layers: int, name: str = "the target") -> list[int]:
    """The target layers whose inputs fc fuses: EAGLE-3's [2, L/2, L − 3] clipped to 1 .. L − 1 (qwen2 cannot hand
    out layer 0's), or ``layers`` checked: 3 integers in 1 .. L − 1, ascending and distinct (as many as L has) —
    ``init``'s fc_top takes the last as the highest, and EAGLE-3 runtimes concatenate them in layer order."""
    L = int(n_layers)
    default = [min(max(i, 1), L - 1) for i in (2, L // 2, L - 3)]
    if layers is None:
        return default
    got = list(layers) if np.iterable(layers) and not isinstance(layers, (str, bytes)) else [layers]
    ints = all(isinstance(i, (int, np.integer)) and not isinstance(i, (bool, np.bool_)) for i in got)
    if not (len(got) == 3 and ints and got == sorted(got) and len(set(got)) == min(3, L - 1) and 1 <= got[0]
            and got[-1] <= L - 1):
        raise OndeviceError(f"layers=[{', '.join(map(str, got))}]: give 3 target layer ids between 1 and {L - 1}, "
                            f"ascending and distinct ({name} has {L} layers; default {default})")
    return [int(i) for i in got]


def init(shape: Shape, lm_rows: np.ndarray, norm_w: np.ndarray, seed: int, fc_top: bool = False) -> dict[str, np.ndarray]:
    """Initial weights (float32, canonical names of ``converters.eagle3_source``): the LM head and its norm
    from the target's (``lm_rows`` [Vd, h], ``norm_w`` [h]), the rest random at scale 1/sqrt(fan-in), the MLP's
    and attention's outputs small so that pre ≈ g at the start. ``fc_top``: fc starts as the identity on the
    highest fused layer's input (g = that feature, a representation the target's head already reads) instead
    of a random mix of the three."""
    rng = np.random.default_rng(seed)
    h, nh, nkv, hd, f = shape.hidden, shape.n_heads, shape.n_kv_heads, shape.head_dim, shape.ffn

    def lin(o: int, i: int, gain: float = 1.0) -> np.ndarray:
        return (rng.standard_normal((o, i)) * gain / np.sqrt(i)).astype(np.float32)

    out = {
        "input_norm.weight": np.ones(shape.n_feat * h, np.float32),
        "fc.weight": lin(h, shape.n_feat * h),
        "layer.input_layernorm.weight": np.ones(h, np.float32),
        "layer.hidden_norm.weight": np.ones(h, np.float32),
        "layer.post_attention_layernorm.weight": np.ones(h, np.float32),
        "layer.self_attn.q_proj.weight": lin(nh * hd, 2 * h),
        "layer.self_attn.k_proj.weight": lin(nkv * hd, 2 * h),
        "layer.self_attn.v_proj.weight": lin(nkv * hd, 2 * h),
        "layer.self_attn.o_proj.weight": lin(h, nh * hd, 0.1),
        "layer.mlp.gate_proj.weight": lin(f, h),
        "layer.mlp.up_proj.weight": lin(f, h),
        "layer.mlp.down_proj.weight": lin(h, f, 0.1),
        "norm.weight": np.asarray(norm_w, np.float32).copy(),
        "lm_head.weight": np.asarray(lm_rows, np.float32).copy(),
    }
    if fc_top:
        fc = np.zeros((h, shape.n_feat * h), np.float32)
        fc[:, (shape.n_feat - 1) * h:] = np.eye(h, dtype=np.float32)
        out["fc.weight"] = fc
    return out


def _rms(x, w, eps):
    import jax.numpy as jnp

    return x * (1.0 / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)) * w


def _rope(x, cos, sin):
    """HF rotate-half RoPE on [B, T, heads, hd]; cos / sin [T, hd / 2]."""
    import jax.numpy as jnp

    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def rope_tables(shape: Shape, T: int) -> tuple[np.ndarray, np.ndarray]:
    inv = 1.0 / (shape.rope_theta ** (np.arange(0, shape.head_dim, 2, dtype=np.float64) / shape.head_dim))
    ang = np.arange(T, dtype=np.float64)[:, None] * inv[None, :]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def _shift(x, n: int):
    """x[:, p - n] at p (zeros where p < n), along axis 1."""
    import jax.numpy as jnp

    if n == 0:
        return x
    pad = jnp.zeros((x.shape[0], n, *x.shape[2:]), x.dtype)
    return jnp.concatenate([pad, x[:, : x.shape[1] - n]], axis=1)


def unrolled(params, shape: Shape, feats, emb, cos, sin, depths: int):
    """The forward over every base of a batch of sequences, ``depths`` drafting steps deep.

    Args:
        feats: [B, T, 3·h] target layer inputs of each position.
        emb: [B, T, h] the target's embedding of the token after each position (x_{p+1}).
        cos, sin: ``rope_tables`` for T positions.
    Returns:
        (logits, pre) lists of ``depths`` arrays [B, T, Vd] / [B, T, h]: step j at position p is depth j of base
        p − j (meaningless where p < j).
    """
    import jax
    import jax.numpy as jnp

    p = params
    eps, nh, nkv, hd = shape.eps, shape.n_heads, shape.n_kv_heads, shape.head_dim
    B, T = emb.shape[:2]
    rep = nh // nkv
    scale = 1.0 / np.sqrt(hd)
    e_n = _rms(emb, p["layer.input_layernorm.weight"], eps)
    g = _rms(feats, p["input_norm.weight"], eps) @ p["fc.weight"].T
    idx = jnp.arange(T)
    keys, vals, logits_out, pre_out = [], [], [], []
    for j in range(depths):
        gn = _rms(g, p["layer.hidden_norm.weight"], eps)
        x = jnp.concatenate([e_n, gn], axis=-1)
        q = _rope((x @ p["layer.self_attn.q_proj.weight"].T).reshape(B, T, nh, hd), cos, sin)
        k = _rope((x @ p["layer.self_attn.k_proj.weight"].T).reshape(B, T, nkv, hd), cos, sin)
        v = (x @ p["layer.self_attn.v_proj.weight"].T).reshape(B, T, nkv, hd)
        keys.append(k)
        vals.append(v)
        qg = q.reshape(B, T, nkv, rep, hd)
        s0 = jnp.einsum("btgrd,bsgd->bgrts", qg, keys[0]) * scale
        s0 = jnp.where((idx[None, :] <= idx[:, None] - j)[None, None, None], s0, NEG)
        extra = []
        for i in range(1, j + 1):  # the key of depth i of the same base sits j − i positions back
            ki = _shift(keys[i], j - i)
            e = jnp.einsum("btgrd,btgd->bgrt", qg, ki) * scale
            extra.append(jnp.where((idx >= j - i)[None, None, None], e, NEG))
        scores = jnp.concatenate([s0, jnp.stack(extra, -1)], axis=-1) if extra else s0
        pr = jax.nn.softmax(scores, axis=-1)
        out = jnp.einsum("bgrts,bsgd->btgrd", pr[..., :T], vals[0])
        for i in range(1, j + 1):
            out = out + jnp.einsum("bgrt,btgd->btgrd", pr[..., T + i - 1], _shift(vals[i], j - i))
        h1 = out.reshape(B, T, nh * hd) @ p["layer.self_attn.o_proj.weight"].T + g
        h2 = _rms(h1, p["layer.post_attention_layernorm.weight"], eps)
        mlp = (jax.nn.silu(h2 @ p["layer.mlp.gate_proj.weight"].T) * (h2 @ p["layer.mlp.up_proj.weight"].T)) \
            @ p["layer.mlp.down_proj.weight"].T
        pre = h1 + mlp
        logits_out.append(_rms(pre, p["norm.weight"], eps) @ p["lm_head.weight"].T)
        pre_out.append(pre)
        g = _shift(pre, 1)  # depth j + 1 at position p continues depth j at p − 1
    return logits_out, pre_out


def loss_fn(params, shape: Shape, batch: dict, cos, sin, depths: int, feat_w: float = 0.0, norm_t=None):
    """Σ_j DECAY^j · (mean soft cross-entropy of step j to the target's top-k rows + ``feat_w`` · feature loss);
    (loss, top-1 hits per step).

    ``batch``: feats, emb (``unrolled``), t_idx [B, T, k] the draft-vocabulary index of each of the target's top-k
    tokens at row p + 1 (−1 outside the draft vocabulary), t_pr [B, T, k] their probabilities, valid [B, T] (the
    row p + 1 exists); with ``feat_w`` also hid [B, T, h] the target's post-norm hidden state at row p + 1 and
    hid_ok [B, T] where it is known. The feature loss (EAGLE-1's regression, a dense target: the whole hidden
    state, not 8 probabilities) is SmoothL1 between rms(pre)·``norm_t`` (the target's own final-norm weight, so
    that equality means the target's LM head reads the target's logits) and that hidden state."""
    import jax
    import jax.numpy as jnp

    logits, pre = unrolled(params, shape, batch["feats"], batch["emb"], cos, sin, depths)
    t_idx, t_pr, valid = batch["t_idx"], batch["t_pr"], batch["valid"]
    inside = t_idx >= 0
    w_pr = jnp.where(inside, t_pr, 0.0)
    safe = jnp.where(inside, t_idx, 0)
    T = valid.shape[1]
    total, hits = 0.0, []
    for j, lg in enumerate(logits):
        logp = jax.nn.log_softmax(lg, axis=-1)
        ce = -jnp.sum(w_pr * jnp.take_along_axis(logp, safe, axis=-1), axis=-1)
        m = valid & (jnp.arange(T) >= j)[None, :]
        n = jnp.maximum(jnp.sum(m), 1)
        total = total + DECAY ** j * jnp.sum(jnp.where(m, ce, 0.0)) / n
        if feat_w:
            d = jnp.abs(_rms(pre[j], norm_t, shape.eps) - batch["hid"])
            sl1 = jnp.mean(jnp.where(d < 1.0, 0.5 * d * d, d - 0.5), axis=-1)
            mf = m & batch["hid_ok"]
            total = total + feat_w * DECAY ** j * jnp.sum(jnp.where(mf, sl1, 0.0)) / jnp.maximum(jnp.sum(mf), 1)
        hit = (jnp.argmax(lg, axis=-1) == t_idx[..., 0]) & inside[..., 0]
        hits.append(jnp.stack([jnp.sum(hit & m), jnp.sum(m)]))
    return total, jnp.stack(hits)


def make_step(shape: Shape, depths: int, T: int, lr: float, warmup: int, total: int, clip: float = 1.0, *,
              feat_w: float = 0.0, norm_t=None, frozen: tuple[str, ...] = (), wd: float = 0.0):
    """A jitted AdamW step: (params, opt, batch, t) → (params, opt, loss, hits) for batches of windows up to ``T``
    rows; cosine decay to 10 % of ``lr`` after ``warmup`` linear steps, global gradient norm clipped at ``clip``.

    Args:
        feat_w, norm_t: the feature loss's weight and the target's final-norm weight (``loss_fn``).
        frozen: parameters kept as initialised (e.g. the LM head: the target's own rows).
        wd: decoupled weight decay of the matrices (AdamW), × the step's rate.
    Returns:
        The step; its ``total`` attribute (the schedule's length) may be set before any step (``train_eagle`` sizes
        it from the step's own measured time) without compiling again."""
    import jax
    import jax.numpy as jnp

    cos, sin = (jnp.asarray(a) for a in rope_tables(shape, T))
    b1, b2, eps = 0.9, 0.95, 1e-8
    norm_t = None if norm_t is None else jnp.asarray(norm_t, jnp.float32)

    def inner(params, opt, batch, t, total):
        n = batch["emb"].shape[1]  # any window length up to T (one trace per length)
        (loss, hits), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, shape, batch, cos[:n], sin[:n], depths,
                                                                        feat_w, norm_t)
        grads = {k: jnp.zeros_like(g) if k in frozen else g for k, g in grads.items()}
        norm = jnp.sqrt(sum(jnp.sum(g * g) for g in grads.values()))
        factor = jnp.minimum(1.0, clip / (norm + 1e-6))
        frac = jnp.clip((t - warmup) / jnp.maximum(1, total - warmup), 0.0, 1.0)
        rate = lr * jnp.where(t < warmup, (t + 1) / warmup, 0.1 + 0.45 * (1 + jnp.cos(jnp.pi * frac)))
        new_p, new_m, new_v = {}, {}, {}
        for k, w in params.items():
            g = grads[k] * factor
            m = b1 * opt["m"][k] + (1 - b1) * g
            v = b2 * opt["v"][k] + (1 - b2) * g * g
            mh, vh = m / (1 - b1 ** (t + 1)), v / (1 - b2 ** (t + 1))
            decay = wd * w if (wd and w.ndim == 2 and k not in frozen) else 0.0
            new_p[k] = w - rate * (mh / (jnp.sqrt(vh) + eps) + decay)
            new_m[k], new_v[k] = m, v
        return new_p, {"m": new_m, "v": new_v}, loss, hits

    inner = jax.jit(inner)

    def step(params, opt, batch, t):
        return inner(params, opt, batch, t, step.total)  # total traced: a new value compiles nothing

    step.total = int(total)
    return step


def make_eval(shape: Shape, depths: int, T: int):
    """A jitted forward returning the top-1 hits [depths, B, n] (bool) against the target's top-1 (n ≤ T rows)."""
    import jax
    import jax.numpy as jnp

    cos, sin = (jnp.asarray(a) for a in rope_tables(shape, T))

    def run(params, batch):
        n = batch["emb"].shape[1]
        logits, _ = unrolled(params, shape, batch["feats"], batch["emb"], cos[:n], sin[:n], depths)
        t0 = batch["t_idx"][..., 0]
        return jnp.stack([(jnp.argmax(lg, -1) == t0) & (t0 >= 0) for lg in logits])

    return jax.jit(run)


def zeros_like(params: dict) -> dict:
    return {"m": {k: np.zeros_like(v) for k, v in params.items()}, "v": {k: np.zeros_like(v) for k, v in params.items()}}
