"""Tiny random-weight GGUF targets that carry MTP (NextN) layers, written straight to GGUF.

llama.cpp runs a model's own MTP head in a ``LLAMA_CONTEXT_TYPE_MTP`` context over the same weights
(``ondevice.backends.llama_mtp``). Two architectures whose MTP graphs differ:

- ``qwen35`` (Qwen3.5 / 3.6 dense): a hybrid trunk — gated-delta-net (recurrent) layers and full-attention
  layers every ``full_attention_interval`` — and one MTP block shaped as a full-attention layer with a
  gated Q (``attn_q`` outputs query and gate per head), q/k norms, interleaved M-RoPE (plain NEOX rotation for
  text positions), partial rotary, dense SwiGLU FFN;
- ``glm4moe`` (GLM-4.5 / 4.6 / 4.7): an attention trunk (q/k/v biases, partial NEOX rotary, the first
  ``leading_dense_block_count`` layers dense, the rest mixture-of-experts with sigmoid routing, a
  correction bias and a shared expert) and one MTP block that is such an MoE layer.

Both MTP blocks take ``eh_proj([enorm(embed(token)); hnorm(h)])`` where ``h`` is the target's final-norm
hidden state of the previous position, and read logits through the shared LM head after ``output_norm``
(``shared_head_norm`` / ``shared_head_head`` are optional and not written here).

The tokenizer is the test suite's trained byte-level BPE (``ondevice.testing.tokenizers``, family ``qwen2``).
``qwen35_mtp_reference`` computes the qwen35 MTP block in numpy on the weights of a written file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ondevice.testing.gguf_file import gguf_writer

MTP_ARCHS = ("qwen35", "glm4moe")
_GGUF_ARCH = {"qwen35": "qwen35", "glm4moe": "glm4moe"}


@dataclass(frozen=True)
class MtpShape:
    """Dimensions of a synthetic MTP target (defaults: tiny; ``QWEN35_08B`` is Qwen3.5-0.8B's shape)."""

    n_embd: int = 256
    n_layer: int = 2  # trunk layers; the file holds n_layer + n_nextn blocks
    n_nextn: int = 1
    n_ff: int = 512
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 64
    n_rot: int = 32  # partial rotary, as both real families use
    vocab_size: int = 512
    full_attention_interval: int = 2  # qwen35: every 2nd trunk layer is full attention, the others recurrent
    ssm_d_conv: int = 4  # qwen35 gated delta net
    ssm_head_dim: int = 32
    ssm_k_heads: int = 4
    ssm_v_heads: int = 4
    n_expert: int = 4  # glm4moe
    n_expert_used: int = 2
    n_ff_exp: int = 128
    n_dense_lead: int = 1
    tie: bool = False  # no output.weight: the LM head is the token embedding (Qwen3.5 small models)


# Qwen3.5-0.8B (config.json of Qwen/Qwen3.5-0.8B): 24 layers, 3 linear : 1 full attention.
QWEN35_08B = MtpShape(n_embd=1024, n_layer=24, n_ff=3584, n_head=8, n_head_kv=2, head_dim=256, n_rot=64,
                      vocab_size=248320, full_attention_interval=4, ssm_head_dim=128, ssm_k_heads=16,
                      ssm_v_heads=16, tie=True)


def _qwen35_tensors(s: MtpShape, rng, dtype) -> dict[str, np.ndarray]:
    h, hd = s.n_embd, s.head_dim
    kd, vd = s.ssm_head_dim * s.ssm_k_heads, s.ssm_head_dim * s.ssm_v_heads
    big = dtype == np.float16

    def lin(o: int, i: int, gain: float = 1.0) -> np.ndarray:
        w = rng.standard_normal((o, i), dtype=np.float32)
        w *= gain / np.sqrt(i)
        return w.astype(dtype)

    def norm(n: int) -> np.ndarray:
        return (np.ones(n) if big else 1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    t = {"token_embd.weight": (rng.standard_normal((s.vocab_size, h), dtype=np.float32) * 0.5).astype(dtype),
         "output_norm.weight": norm(h)}
    if not s.tie:
        t["output.weight"] = lin(s.vocab_size, h, 4.0)
    for i in range(s.n_layer + s.n_nextn):
        p = f"blk.{i}."
        t[p + "attn_norm.weight"] = norm(h)
        t[p + "post_attention_norm.weight"] = norm(h)
        recurrent = i < s.n_layer and (i + 1) % s.full_attention_interval != 0
        if recurrent:
            t[p + "attn_qkv.weight"] = lin(2 * kd + vd, h)
            t[p + "attn_gate.weight"] = lin(vd, h)
            t[p + "ssm_conv1d.weight"] = (0.5 * rng.standard_normal((2 * kd + vd, s.ssm_d_conv))).astype(np.float32)
            t[p + "ssm_dt.bias"] = rng.uniform(-1.0, 0.0, s.ssm_v_heads).astype(np.float32)
            t[p + "ssm_a"] = -np.exp(rng.uniform(-1.0, 0.5, s.ssm_v_heads)).astype(np.float32)
            t[p + "ssm_beta.weight"] = lin(s.ssm_v_heads, h)
            t[p + "ssm_alpha.weight"] = lin(s.ssm_v_heads, h)
            t[p + "ssm_norm.weight"] = norm(s.ssm_head_dim)
            t[p + "ssm_out.weight"] = lin(h, vd)
        else:
            t[p + "attn_q.weight"] = lin(2 * s.n_head * hd, h, 2.0)  # per head: query then gate
            t[p + "attn_k.weight"] = lin(s.n_head_kv * hd, h, 2.0)
            t[p + "attn_v.weight"] = lin(s.n_head_kv * hd, h)
            t[p + "attn_output.weight"] = lin(h, s.n_head * hd)
            t[p + "attn_q_norm.weight"] = norm(hd)
            t[p + "attn_k_norm.weight"] = norm(hd)
        t[p + "ffn_gate.weight"] = lin(s.n_ff, h)
        t[p + "ffn_up.weight"] = lin(s.n_ff, h)
        t[p + "ffn_down.weight"] = lin(h, s.n_ff)
        if i >= s.n_layer:
            t[p + "nextn.eh_proj.weight"] = lin(h, 2 * h)
            t[p + "nextn.enorm.weight"] = norm(h)
            t[p + "nextn.hnorm.weight"] = norm(h)
    return t


def _glm4moe_tensors(s: MtpShape, rng, dtype) -> dict[str, np.ndarray]:
    h, hd = s.n_embd, s.head_dim

    def lin(*shape: int, gain: float = 1.0) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * (gain / np.sqrt(shape[-1]))).astype(dtype)

    def vec(n: int, base: float = 1.0, scale: float = 0.1) -> np.ndarray:
        return (base + scale * rng.standard_normal(n)).astype(np.float32)

    t = {"token_embd.weight": (rng.standard_normal((s.vocab_size, h), dtype=np.float32) * 0.5).astype(dtype),
         "output_norm.weight": vec(h), "output.weight": lin(s.vocab_size, h, gain=4.0)}
    for i in range(s.n_layer + s.n_nextn):
        p = f"blk.{i}."
        t[p + "attn_norm.weight"] = vec(h)
        t[p + "post_attention_norm.weight"] = vec(h)
        for name, rows in (("attn_q", s.n_head * hd), ("attn_k", s.n_head_kv * hd), ("attn_v", s.n_head_kv * hd)):
            t[p + name + ".weight"] = lin(rows, h, gain=2.0)
            t[p + name + ".bias"] = vec(rows, 0.0)
        t[p + "attn_output.weight"] = lin(h, s.n_head * hd)
        if i < s.n_dense_lead:
            t[p + "ffn_gate.weight"] = lin(s.n_ff, h)
            t[p + "ffn_up.weight"] = lin(s.n_ff, h)
            t[p + "ffn_down.weight"] = lin(h, s.n_ff)
        else:
            t[p + "ffn_gate_inp.weight"] = lin(s.n_expert, h, gain=4.0).astype(np.float32)
            t[p + "exp_probs_b.bias"] = vec(s.n_expert, 0.0, 0.5)
            t[p + "ffn_gate_exps.weight"] = lin(s.n_expert, s.n_ff_exp, h)
            t[p + "ffn_up_exps.weight"] = lin(s.n_expert, s.n_ff_exp, h)
            t[p + "ffn_down_exps.weight"] = lin(s.n_expert, h, s.n_ff_exp)
            t[p + "ffn_gate_shexp.weight"] = lin(s.n_ff_exp, h)
            t[p + "ffn_up_shexp.weight"] = lin(s.n_ff_exp, h)
            t[p + "ffn_down_shexp.weight"] = lin(h, s.n_ff_exp)
        if i >= s.n_layer:
            t[p + "nextn.eh_proj.weight"] = lin(h, 2 * h)
            t[p + "nextn.enorm.weight"] = vec(h)
            t[p + "nextn.hnorm.weight"] = vec(h)
    return t


def _hparams(w, arch: str, s: MtpShape) -> None:
    a = _GGUF_ARCH[arch]
    w.add_context_length(4096)
    w.add_embedding_length(s.n_embd)
    w.add_block_count(s.n_layer + s.n_nextn)
    w.add_uint32(f"{a}.nextn_predict_layers", s.n_nextn)
    w.add_feed_forward_length(s.n_ff)
    w.add_head_count(s.n_head)
    w.add_head_count_kv(s.n_head_kv)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_rope_dimension_count(s.n_rot)
    w.add_rope_freq_base(1e7 if arch == "qwen35" else 1e6)
    w.add_layer_norm_rms_eps(1e-6)
    if arch == "qwen35":
        half = s.n_rot // 2
        w.add_array(f"{a}.rope.dimension_sections", [half - 2 * (half // 3), half // 3, half // 3, 0])
        w.add_uint32(f"{a}.full_attention_interval", s.full_attention_interval)
        w.add_uint32(f"{a}.ssm.conv_kernel", s.ssm_d_conv)
        w.add_uint32(f"{a}.ssm.inner_size", s.ssm_head_dim * s.ssm_v_heads)
        w.add_uint32(f"{a}.ssm.state_size", s.ssm_head_dim)
        w.add_uint32(f"{a}.ssm.time_step_rank", s.ssm_v_heads)
        w.add_uint32(f"{a}.ssm.group_count", s.ssm_k_heads)
    else:
        w.add_uint32(f"{a}.expert_count", s.n_expert)
        w.add_uint32(f"{a}.expert_used_count", s.n_expert_used)
        w.add_uint32(f"{a}.expert_shared_count", 1)
        w.add_uint32(f"{a}.expert_feed_forward_length", s.n_ff_exp)
        w.add_uint32(f"{a}.leading_dense_block_count", s.n_dense_lead)
        w.add_float32(f"{a}.expert_weights_scale", 1.0)
        w.add_bool(f"{a}.expert_weights_norm", True)
        w.add_uint32(f"{a}.expert_gating_func", 2)  # sigmoid


def add_test_vocab(w, vocab_size: int) -> None:
    """The trained byte-level BPE of the test suite (family ``qwen2``), padded to ``vocab_size`` rows."""
    import gguf

    from ondevice.testing import CHATML_TEMPLATE
    from ondevice.testing.tokenizers import special_ids, train

    n_train = min(vocab_size, 512)
    tj = json.loads(train("qwen2", n_train).to_str())
    by_id = {i: (t, gguf.TokenType.NORMAL) for t, i in tj["model"]["vocab"].items()}
    by_id.update({a["id"]: (a["content"], gguf.TokenType.CONTROL) for a in tj["added_tokens"]})
    tokens = [by_id.get(i, (f"[PAD{i}]", gguf.TokenType.UNUSED)) for i in range(vocab_size)]
    ids = special_ids("qwen2")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list([t for t, _ in tokens])
    w.add_token_types([int(ty) for _, ty in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]])
    w.add_bos_token_id(ids["bos"])
    w.add_eos_token_id(ids["eos"])
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML_TEMPLATE)


def make_tiny_mtp_gguf(out: str | Path, arch: str = "qwen35", *, shape: MtpShape | None = None, seed: int = 0,
                       dtype: str = "f32") -> Path:
    """Write a random-weight GGUF target with MTP layers and return its path.

    Args:
        out: the .gguf file to write (parent folders are created); written whole or not at all.
        arch: one of ``MTP_ARCHS``.
        shape: dimensions (default ``MtpShape()``: 2 trunk layers + 1 MTP block, hidden 256, vocabulary 512).
        seed: weight seed.
        dtype: "f32" (tiny models, exact against numpy) or "f16" (shape-true models; norms stay F32).
    Returns:
        ``out`` as a Path.
    """
    import gguf

    if arch not in MTP_ARCHS:
        raise ValueError(f"unsupported MTP arch {arch!r}; one of {', '.join(MTP_ARCHS)}")
    if dtype not in ("f32", "f16"):
        raise ValueError(f"dtype must be 'f32' or 'f16', got {dtype!r}")
    s = shape or MtpShape()
    rng = np.random.default_rng(seed)
    np_dtype = np.float32 if dtype == "f32" else np.float16
    tensors = (_qwen35_tensors if arch == "qwen35" else _glm4moe_tensors)(s, rng, np_dtype)
    out = Path(out)
    with gguf_writer(out, _GGUF_ARCH[arch], tensors) as w:
        w.add_name(f"tiny-{arch}-mtp")
        w.add_file_type(gguf.LlamaFileType.ALL_F32 if dtype == "f32" else gguf.LlamaFileType.MOSTLY_F16)
        _hparams(w, arch, s)
        add_test_vocab(w, s.vocab_size)
    return out


def read_tensors(path: str | Path, names: list[str]) -> dict[str, np.ndarray]:
    """Tensors of a GGUF file as float32 numpy arrays in GGUF (reversed ggml) layout."""
    import gguf

    r = gguf.GGUFReader(str(path))
    found = {t.name: t for t in r.tensors}
    out = {}
    for n in names:
        t = found[n]
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        out[n] = np.asarray(t.data, dtype=np.float32).reshape(shape)
    return out


def _rms(x: np.ndarray, w: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _neox(x: np.ndarray, pos: np.ndarray, n_rot: int, base: float) -> np.ndarray:
    """NEOX rotation of the first ``n_rot`` dims of x [T, heads, hd] (pairs i, i + n_rot/2)."""
    half = n_rot // 2
    theta = pos[:, None] * base ** (-np.arange(half) * 2.0 / n_rot)  # [T, half]
    c, s = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    a, b = x[..., :half], x[..., half:n_rot]
    return np.concatenate([a * c - b * s, a * s + b * c, x[..., n_rot:]], axis=-1)


def _causal_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Causal GQA attention over a whole run: q [T, nh, hd], k / v [T, nkv, hd] → [T, nh·hd]."""
    T, nh, hd = q.shape
    rep = nh // k.shape[1]
    k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
    scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(hd)
    scores = np.where(np.tril(np.ones((T, T), bool))[None], scores, -np.inf)
    pr = np.exp(scores - scores.max(-1, keepdims=True))
    pr /= pr.sum(-1, keepdims=True)
    return np.einsum("hts,shd->thd", pr, v).reshape(T, nh * hd)


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def glm4moe_mtp_reference(path: str | Path, tokens: list[int], h: np.ndarray, pos0: int,
                          shape: MtpShape | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The glm4moe MTP block in numpy (float64); arguments and result as ``qwen35_mtp_reference``.

    Attention with q/k/v biases and partial NEOX rotary; an MoE FFN: sigmoid router, experts chosen by
    probability + correction bias, weighted by their probabilities normalised to sum 1, plus a shared expert.
    """
    s = shape or MtpShape()
    p = f"blk.{s.n_layer}."
    names = ["token_embd.weight", "output_norm.weight", "output.weight"] + [p + n for n in (
        "nextn.eh_proj.weight", "nextn.enorm.weight", "nextn.hnorm.weight", "attn_norm.weight", "attn_q.weight",
        "attn_q.bias", "attn_k.weight", "attn_k.bias", "attn_v.weight", "attn_v.bias", "attn_output.weight",
        "post_attention_norm.weight", "ffn_gate_inp.weight", "exp_probs_b.bias", "ffn_gate_exps.weight",
        "ffn_up_exps.weight", "ffn_down_exps.weight", "ffn_gate_shexp.weight", "ffn_up_shexp.weight",
        "ffn_down_shexp.weight")]
    w = {k: v.astype(np.float64) for k, v in read_tensors(path, names).items()}
    T, hd = len(tokens), s.head_dim
    e = w["token_embd.weight"][np.asarray(tokens)]
    x = np.concatenate([_rms(e, w[p + "nextn.enorm.weight"]), _rms(h.astype(np.float64), w[p + "nextn.hnorm.weight"])], -1)
    x = x @ w[p + "nextn.eh_proj.weight"].T
    a = _rms(x, w[p + "attn_norm.weight"])
    pos = np.arange(pos0, pos0 + T, dtype=np.float64)

    def proj(name: str, heads: int) -> np.ndarray:
        return (a @ w[p + name + ".weight"].T + w[p + name + ".bias"]).reshape(T, heads, hd)

    q = _neox(proj("attn_q", s.n_head), pos, s.n_rot, 1e6)
    k = _neox(proj("attn_k", s.n_head_kv), pos, s.n_rot, 1e6)
    x = x + _causal_attention(q, k, proj("attn_v", s.n_head_kv)) @ w[p + "attn_output.weight"].T
    f = _rms(x, w[p + "post_attention_norm.weight"])
    probs = 1.0 / (1.0 + np.exp(-(f @ w[p + "ffn_gate_inp.weight"].T)))
    top = np.argsort(-(probs + w[p + "exp_probs_b.bias"]), axis=-1)[:, : s.n_expert_used]
    ffn = _silu(f @ w[p + "ffn_gate_shexp.weight"].T) * (f @ w[p + "ffn_up_shexp.weight"].T) @ w[p + "ffn_down_shexp.weight"].T
    for t in range(T):
        wt = probs[t, top[t]] / probs[t, top[t]].sum()
        for ex, c in zip(top[t], wt, strict=True):
            g = w[p + "ffn_gate_exps.weight"][ex] @ f[t]
            u = w[p + "ffn_up_exps.weight"][ex] @ f[t]
            ffn[t] += c * (w[p + "ffn_down_exps.weight"][ex] @ (_silu(g) * u))
    h_out = _rms(x + ffn, w["output_norm.weight"])
    return h_out @ w["output.weight"].T, h_out


def qwen35_mtp_reference(path: str | Path, tokens: list[int], h: np.ndarray, pos0: int,
                         shape: MtpShape | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The qwen35 MTP block in numpy (float64) over a run of (token, h) pairs at positions pos0, pos0 + 1, …

    Args:
        path: a file written by ``make_tiny_mtp_gguf(arch="qwen35")`` with ``shape``.
        tokens: the MTP input tokens x_{p}, one per position.
        h: [len(tokens), n_embd] the hidden state paired with each token (the target's h_{p-1}, or the
            MTP head's own output for a chained step).
        pos0: position of the first pair; attention is causal over the run (the run is the whole cache).
    Returns:
        (logits [T, vocab], h_out [T, n_embd]): the MTP head's logits and its post-norm hidden state.
    """
    s = shape or MtpShape()
    il = s.n_layer
    p = f"blk.{il}."
    names = ["token_embd.weight", "output_norm.weight", *([] if s.tie else ["output.weight"])] + [
        p + n for n in ("nextn.eh_proj.weight", "nextn.enorm.weight", "nextn.hnorm.weight", "attn_norm.weight",
                        "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_q_norm.weight", "attn_k_norm.weight",
                        "attn_output.weight", "post_attention_norm.weight", "ffn_gate.weight", "ffn_up.weight",
                        "ffn_down.weight")]
    w = {k: v.astype(np.float64) for k, v in read_tensors(path, names).items()}
    T, hd, nh, nkv = len(tokens), s.head_dim, s.n_head, s.n_head_kv
    e = w["token_embd.weight"][np.asarray(tokens)]
    x = np.concatenate([_rms(e, w[p + "nextn.enorm.weight"]), _rms(h.astype(np.float64), w[p + "nextn.hnorm.weight"])], -1)
    x = x @ w[p + "nextn.eh_proj.weight"].T
    a = _rms(x, w[p + "attn_norm.weight"])
    qg = (a @ w[p + "attn_q.weight"].T).reshape(T, nh, 2 * hd)
    q, gate = qg[..., :hd], qg[..., hd:].reshape(T, nh * hd)
    k = (a @ w[p + "attn_k.weight"].T).reshape(T, nkv, hd)
    v = (a @ w[p + "attn_v.weight"].T).reshape(T, nkv, hd)
    pos = np.arange(pos0, pos0 + T, dtype=np.float64)
    q = _neox(_rms(q, w[p + "attn_q_norm.weight"]), pos, s.n_rot, 1e7)
    k = _neox(_rms(k, w[p + "attn_k_norm.weight"]), pos, s.n_rot, 1e7)
    att = _causal_attention(q, k, v) * (1.0 / (1.0 + np.exp(-gate)))
    x = x + att @ w[p + "attn_output.weight"].T
    f = _rms(x, w[p + "post_attention_norm.weight"])
    x = x + (_silu(f @ w[p + "ffn_gate.weight"].T) * (f @ w[p + "ffn_up.weight"].T)) @ w[p + "ffn_down.weight"].T
    h_out = _rms(x, w["output_norm.weight"])
    return h_out @ w["token_embd.weight" if s.tie else "output.weight"].T, h_out
