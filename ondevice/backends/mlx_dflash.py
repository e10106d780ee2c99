"""A DFlash block draft GGUF (arch ``dflash``: plain DFlash, DFlash2, DSpark) run in MLX, fed an MLX target's layer
inputs (``mlx_layers``); the runtime's drafter is ``ondevice.drafters.dflash``, the same class as on llama.cpp.

The same file llama.cpp runs, read with ``gguf`` into mx arrays, and the maths of llama.cpp's dflash graph
(src/models/dflash.cpp; ``backends.llama_dflash``), written in MLX:
- ``observe``: the target's layer inputs at positions pos0.. fused by ``fc`` + ``enc.output_norm`` (g), then per
  layer K = rope(k_norm(wk · g)), V = wv · g stored in the draft's own KV cache (mlx-lm's ``KVCache``, one per layer).
- ``draft``: ``[token, mask × …]`` at the next positions through the Qwen3-style layers (q/k norms, NeoX RoPE,
  attention over the cache and the block both ways unless ``dflash.attention.causal``, SwiGLU), ``output_norm`` and
  the LM head (the draft's own, else the MLX target's ``lm_head`` / tied embeddings), placed onto the target
  vocabulary by ``d2t``; the block's K/V are dropped again. DFlash2 adds the per-layer block convolutions and the
  candidate selector's lattice (``lattice``: the rows ``llama_dflash_heads.Block`` reads), DSpark the Markov bias
  chained on each row's argmax (as the graph does; ``Block`` re-conditions on the token actually drafted).
Same interface as ``DFlashGraph`` (``observe``, ``draft``, ``block``, ``rollback``, ``n_past``, ``max_draft``,
``variant``, ``layers``), so ``DFlashDrafter`` runs on either. What llama.cpp's graph has and this runner does not
(DeepSeek-V4 DSpark stages, sliding windows, attention sinks, post-norms, logit / embedding scales, …) is refused in
one line naming it. Weights and activations keep an f16 file's f16 on a GPU (Metal), else f32.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import numpy as np

from ondevice.backends.llama_dflash_heads import Block, MarkovHead
from ondevice.backends.mlx_eagle3 import read_gguf_draft
from ondevice.errors import OndeviceError

_TOP = ("fc.weight", "enc.output_norm.weight", "output_norm.weight")
_LAYER = ("attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight",
          "attn_q_norm.weight", "attn_k_norm.weight", "ffn_norm.weight", "ffn_gate.weight", "ffn_up.weight",
          "ffn_down.weight")
_CONV = ("attn_conv_base", "attn_conv_proj.weight", "ffn_conv_base", "ffn_conv_proj.weight")
_OPTIONAL = ("token_embd.weight", "output.weight", "d2t", "rope_freqs.weight", "markov_w1.weight", "markov_w2.weight",
             "markov_w2.scale", "conf_proj.weight", "conf_proj.bias", "selector_predecessor.weight",
             "selector_successor.weight", "selector_hidden.weight")
# metadata llama.cpp's graph reads that this runner does not implement: (what it is, the values that mean "off")
_REFUSED_KEYS = {"hyper_connection.count": ("DeepSeek-V4 hyper-connections", (0,)),
                 "attention.sliding_window": ("sliding-window attention", (0,)),
                 "embedding_scale": ("an embedding scale", (0, 1)), "attention.scale": ("an attention scale", (0,)),
                 "attention.value_scale": ("an attention value scale", (0, 1)),
                 "logit_scale": ("a logit scale", (0, 1)), "final_logit_softcapping": ("logit soft-capping", (0,)),
                 "rope.scale_linear": ("linear RoPE scaling", (1,)), "rope.scaling.factor": ("RoPE scaling", (0, 1)),
                 "rope.scaling.type": ("RoPE scaling", ("none",)), "hidden_activation": ("its activation", ("silu",))}


def _check_supported(path: Path, meta: dict, names: set[str], n_layer: int) -> None:
    """Refuse (one line) a tensor or metadata key of llama.cpp's dflash graph that this runner does not implement."""
    for key, (what, off) in _REFUSED_KEYS.items():
        v = meta.get(f"dflash.{key}")
        if v is not None and v not in off:
            raise OndeviceError(f"{path.name}: {what} (dflash.{key} = {v}) is not implemented by the MLX DFlash "
                                "runner; run this draft beside a llama.cpp (GGUF) target")
    sections = meta.get("dflash.rope.dimension_sections")
    if sections and any(int(s) for s in list(sections)[1:]):
        raise OndeviceError(f"{path.name}: M-RoPE sections {list(sections)} are not implemented by the MLX DFlash "
                            "runner; run this draft beside a llama.cpp (GGUF) target")
    known = set(_TOP + _OPTIONAL) | {f"blk.{i}.{n}" for i in range(n_layer) for n in _LAYER + _CONV}
    for name in sorted(names - known):
        what = re.sub(r"^blk\.\d+\.", "", name)
        raise OndeviceError(f"{path.name}: tensor {name} ({what}) is not implemented by the MLX DFlash runner; run "
                            "this draft beside a llama.cpp (GGUF) target")


class DFlashMLX:
    """A loaded DFlash draft and its own KV cache (one sequence), in MLX (see the module docstring).

    Args:
        path: the dflash GGUF.
        target: the ``MLXBackend`` target (its device, its token table / LM head when the draft has none, checks
            of hidden size, vocabulary and depth); None: a draft with its own table and head run alone (tests).
        layer_inputs_on: called with ``layers`` once the draft is checked against the target (the drafter
            switches the target's layer inputs on there).
        n_ctx: positions of the draft's cache.
        device: the mx device when ``target`` is None (default CPU).
    Attributes:
        layers, block_size, variant, max_draft, vocab_size, mask_id, top_k, markov, lattice: as ``DFlashGraph``'s.
    Raises:
        OndeviceError: not a dflash GGUF, made for another target, or a feature this runner lacks (one line each).
    """

    n_batch = 512
    confidence = None  # DSpark's confidences are read only by the llama.cpp conversion check

    def __init__(self, path: str | Path, target=None, layer_inputs_on: Callable[[list[int]], object] | None = None, *,
                 n_ctx: int = 4096, device=None) -> None:
        import mlx.core as mx

        self._mx, self.path, self.n_ctx = mx, Path(path), int(n_ctx)
        self.device = (device or mx.cpu) if target is None else target.device
        meta, w = read_gguf_draft(self.path, "dflash", "a DFlash", _TOP)

        def key(name: str, default=None):
            v = meta.get(f"dflash.{name}")
            return default if v is None else v

        self.n_layer = int(key("block_count"))
        _check_supported(self.path, meta, set(w), self.n_layer)
        missing = [f"blk.{i}.{n}" for i in range(self.n_layer) for n in _LAYER if f"blk.{i}.{n}" not in w]
        if missing:
            raise OndeviceError(f"{self.path.name}: a dflash GGUF without {missing[0]}; the MLX DFlash runner needs "
                                "Qwen3-style layers (q/k norms, separate V)")
        self.layers = [int(i) for i in key("target_layers", [])]
        self.n_embd, self.vocab_size = int(key("embedding_length")), int(meta["n_tokens"])
        self.n_head, self.n_head_kv = int(key("attention.head_count")), int(key("attention.head_count_kv"))
        self.head_dim = int(key("attention.key_length", self.n_embd // self.n_head))
        self.n_rot = int(key("rope.dimension_count", self.head_dim))
        self.eps = float(key("attention.layer_norm_rms_epsilon"))
        self.block_size, self._causal = int(key("block_size", 16)), bool(key("attention.causal", False))
        self.conv = "blk.0.attn_conv_proj.weight" in w
        if self.conv:
            self._kernel, self._group = int(key("conv_kernel_size")), int(key("conv_group_size"))
        self.top_k = int(key("selector_top_k", 0)) if "selector_hidden.weight" in w else 0
        self.markov = MarkovHead(self.path, self.vocab_size) if "markov_w1.weight" in w else None
        self.variant = "dspark" if self.markov else "dflash2" if self.top_k > 0 else "dflash"
        self._first = 0 if self.markov and bool(key("sample_from_anchor", True)) else 1  # block row of the 1st draft
        self.max_draft = self.block_size - self._first
        self.lattice: np.ndarray | None = None
        mask = meta.get("tokenizer.ggml.mask_token_id")
        self.mask_id = -1 if mask is None else int(mask)
        if not 0 <= self.mask_id < self.vocab_size:
            raise OndeviceError(f"{self.path.name}: no mask token (tokenizer.ggml.mask_token_id); re-convert the draft")
        if w["fc.weight"].shape[1] != len(self.layers) * self.n_embd or not self.layers:
            raise OndeviceError(f"{self.path.name}: fc {list(w['fc.weight'].shape)} does not fuse {len(self.layers)} "
                                f"layers of hidden size {self.n_embd}; re-convert the draft")
        d2t = w.pop("d2t", None)
        self._d2t = None if d2t is None else np.asarray(d2t, np.int64).reshape(-1)
        self._select = {n.split(".")[0]: np.asarray(w.pop(n), np.float32) for n in (
            "selector_predecessor.weight", "selector_successor.weight", "selector_hidden.weight") if n in w}
        theta = float(key("rope.freq_base", 10000.0))
        periods = theta ** (np.arange(0, self.n_rot, 2, dtype=np.float64) / self.n_rot)
        factors = w.pop("rope_freqs.weight", None)
        if factors is not None:
            periods = periods * np.asarray(factors, np.float64)
        self._embed = self._head = None
        if target is not None:
            self._check_target(target, "token_embd.weight" in w, "output.weight" in w)
        elif "token_embd.weight" not in w or "output.weight" not in w:
            raise OndeviceError(f"{self.path.name}: reads its target's embeddings / LM head; pass the target")
        self._dtype = mx.float16 if self.device == mx.gpu and w["fc.weight"].dtype == np.float16 else mx.float32
        with mx.stream(self.device):
            self._w = {k: mx.array(np.asarray(v, np.float32)).astype(self._dtype) for k, v in w.items()
                       if not k.startswith("conf_") and k != "markov_w2.scale"}
            self._d2t_mx = None if self._d2t is None else mx.array(self._d2t.astype(np.int32))
            self._freqs = mx.array(periods.astype(np.float32))
        self.rollback(0)
        if layer_inputs_on is not None:
            layer_inputs_on(list(self.layers))

    def _check_target(self, target, own_table: bool, own_head: bool) -> None:
        """Hidden size, vocabulary, depth; the target's token table and LM head where the draft has none."""
        name, n_layer, model = self.path.name, len(target._layer_list()), target.model
        hidden = int(getattr(getattr(model, "args", None), "hidden_size", 0) or self.n_embd)
        if any(not 0 <= i < n_layer for i in self.layers) or target.vocab_size != self.vocab_size \
                or hidden != self.n_embd:
            raise OndeviceError(f"{name}: this DFlash draft was made for another target (layers {self.layers}, "
                                f"vocabulary {self.vocab_size}, hidden {self.n_embd}; the target has {n_layer} layers, "
                                f"{target.vocab_size} tokens, hidden {hidden})")
        table = getattr(getattr(model, "model", None), "embed_tokens", None)
        head = getattr(model, "lm_head", None) or (table.as_linear if table is not None else None)
        kind = getattr(model, "model_type", "?")
        if (not own_table and table is None) or (not own_head and head is None):
            raise OndeviceError(f"{name}: reads its target's token table and LM head, and mlx-lm's {kind!r} model "
                                "has no model.embed_tokens / lm_head")
        self._embed = None if own_table else table
        self._head = None if own_head else head

    # -- cache -------------------------------------------------------------------------------------------
    @property
    def n_past(self) -> int:
        """Positions in the draft's cache."""
        return int(self._cache[0].offset)

    def rollback(self, n_past: int) -> None:
        """Drop the draft's cache from position ``n_past`` on."""
        from mlx_lm.models.cache import KVCache

        if n_past <= 0:
            self._cache = [KVCache() for _ in range(self.n_layer)]
        else:
            for c in self._cache:
                c.trim(c.offset - min(int(n_past), c.offset))

    # -- maths ----------------------------------------------------------------------------------------------
    def _rms(self, x, name: str):
        return self._mx.fast.rms_norm(x, self._w[name], self.eps)

    def _heads(self, x, name: str, n: int, norm: str | None, pos0: int):
        """[1, n heads, rows, head_dim] of ``x @ w[name].T`` (head-wise RMS-normed by ``norm``, then RoPE at pos0..)."""
        mx, hd = self._mx, self.head_dim
        t = (x @ self._w[name].T).reshape(1, x.shape[0], n, hd)
        if norm is None:
            return t.transpose(0, 2, 1, 3)
        t = self._rms(t, norm).transpose(0, 2, 1, 3)
        return mx.fast.rope(t, self.n_rot, traditional=False, base=None, scale=1.0, offset=pos0, freqs=self._freqs)

    def _conv(self, x, dyn, base: str, side: int):
        """DFlash2's block convolution (``converters.dflash_check._conv``): out[t] = Σ_tap (coef[t, side, tap] +
        base[side, tap]) · x[t − tap], x before the block = 0, a coefficient per group of dimensions."""
        mx = self._mx
        m, h = x.shape
        coef = dyn.reshape(m, 2, self._kernel, h // self._group)[:, side]
        weight = mx.repeat(coef, self._group, axis=-1) + self._w[base][side][None]
        out = weight[:, 0] * x
        for tap in range(1, min(self._kernel, m)):
            out = out + weight[:, tap] * mx.concatenate([mx.zeros((tap, h), x.dtype), x[: m - tap]])
        return out

    def observe(self, feats: np.ndarray, pos0: int) -> None:
        """Inject the fused target features [n, len(layers) × hidden] of positions pos0.. into the draft's cache
        (drops pos0.. first)."""
        mx = self._mx
        if pos0 > self.n_past:
            raise OndeviceError(f"{self.path.name}: DFlash cache holds {self.n_past} positions, cannot inject at {pos0}")
        feats = np.asarray(feats, np.float32)
        if pos0 + len(feats) > self.n_ctx:
            raise OndeviceError(f"{self.path.name}: the draft's cache holds {self.n_ctx} positions; {pos0 + len(feats)} asked")
        self.rollback(pos0)
        with mx.stream(self.device):
            for s in range(0, len(feats), self.n_batch):
                g = self._rms(mx.array(feats[s: s + self.n_batch]).astype(self._dtype) @ self._w["fc.weight"].T,
                              "enc.output_norm.weight")
                for i, c in enumerate(self._cache):
                    p = f"blk.{i}."
                    c.update_and_fetch(self._heads(g, p + "attn_k.weight", self.n_head_kv, p + "attn_k_norm.weight",
                                                   pos0 + s),
                                       self._heads(g, p + "attn_v.weight", self.n_head_kv, None, 0))
                mx.eval(*[a for c in self._cache for a in (c.keys, c.values)])

    def _layer(self, i: int, x, pos0: int, mask):
        """Decoder layer ``i`` on the block rows ``x`` [m, hidden] at positions pos0.. (their K/V enter the cache)."""
        mx, p, nh, hd = self._mx, f"blk.{i}.", self.n_head, self.head_dim
        a = self._rms(x, p + "attn_norm.weight")
        if self.conv:
            dyn_a = a @ self._w[p + "attn_conv_proj.weight"].T
            a = self._conv(a, dyn_a, p + "attn_conv_base", 0)
        q = self._heads(a, p + "attn_q.weight", nh, p + "attn_q_norm.weight", pos0)
        k, v = self._cache[i].update_and_fetch(
            self._heads(a, p + "attn_k.weight", self.n_head_kv, p + "attn_k_norm.weight", pos0),
            self._heads(a, p + "attn_v.weight", self.n_head_kv, None, 0))
        o = mx.fast.scaled_dot_product_attention(q, k, v, scale=hd ** -0.5, mask=mask)
        o = o.transpose(0, 2, 1, 3).reshape(x.shape[0], nh * hd) @ self._w[p + "attn_output.weight"].T
        x = x + (self._conv(o, dyn_a, p + "attn_conv_base", 1) if self.conv else o)
        h = self._rms(x, p + "ffn_norm.weight")
        if self.conv:
            dyn_f = h @ self._w[p + "ffn_conv_proj.weight"].T
            h = self._conv(h, dyn_f, p + "ffn_conv_base", 0)
        gate = h @ self._w[p + "ffn_gate.weight"].T
        f = (mx.sigmoid(gate) * gate * (h @ self._w[p + "ffn_up.weight"].T)) @ self._w[p + "ffn_down.weight"].T
        return x + (self._conv(f, dyn_f, p + "ffn_conv_base", 1) if self.conv else f)

    def forward(self, tokens: list[int], markov_from: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(logits [m, vocab] over the target vocabulary, −inf outside a reduced draft vocabulary; final normed hidden
        states [m, hidden]), float32, of the block ``tokens`` at positions n_past..; the cache is left as it was.
        DSpark with ``markov_from``: rows from that one on get the Markov bias of the row before's argmax (the anchor,
        tokens[0], for the first), as the graph chains it (``build_dspark_markov_head``)."""
        mx, pos0, m = self._mx, self.n_past, len(tokens)
        if pos0 + m > self.n_ctx:
            raise OndeviceError(f"{self.path.name}: the draft's cache holds {self.n_ctx} positions; {pos0 + m} asked")
        try:
            with mx.stream(self.device):
                ids = mx.array(np.asarray(tokens, np.int64).astype(np.int32))
                x = (self._embed(ids) if self._embed is not None else self._w["token_embd.weight"][ids]).astype(self._dtype)
                mask = None
                if self._causal:  # the cache, then the block up to each row
                    seen = mx.arange(pos0 + m)[None] <= (mx.arange(m) + pos0)[:, None]
                    mask = mx.where(seen, 0.0, -np.inf).astype(self._dtype)
                for i in range(self.n_layer):
                    x = self._layer(i, x, pos0, mask)
                h = self._rms(x, "output_norm.weight")
                out = (self._head(h) if self._head is not None else h @ self._w["output.weight"].T).astype(mx.float32)
                if markov_from is not None and self.markov is not None:
                    out = self._markov_chain(out, ids[0], markov_from)
                h = h.astype(mx.float32)
                mx.eval(out, h)
                out, h = np.array(out), np.array(h)
        finally:
            self.rollback(pos0)
        if self._d2t is None:
            return out, h
        logits = np.full((m, self.vocab_size), -np.inf, np.float32)
        logits[:, self._d2t] = out
        return logits, h

    def _markov_chain(self, out, anchor, start: int):
        """``out`` [m, draft vocabulary] with rows start.. biased by ``markov_w2 · markov_w1[prev]`` (× its scale),
        prev the anchor, then each biased row's argmax (as a target id, through ``d2t``)."""
        mx, w1, w2 = self._mx, self._w["markov_w1.weight"], self._w["markov_w2.weight"]
        rows, prev = [out[i] for i in range(start)], anchor
        for i in range(start, out.shape[0]):
            rows.append(out[i] + (w2 @ w1[prev]).astype(mx.float32) * self.markov.scale)
            prev = mx.argmax(rows[-1])
            prev = prev if self._d2t_mx is None else self._d2t_mx[prev]
        return mx.stack(rows)

    def _selector(self, logits: np.ndarray, h: np.ndarray, anchor: int) -> np.ndarray:
        """DFlash2's lattice rows of block positions 1.. (``build_dflash2_selector``): per position its top-k
        candidates, then their scores ``successor[c] · (predecessor[prev] ⊙ selector_hidden · h) + logit[c]`` for each
        candidate prev of the position before (the anchor, repeated, for position 1), predecessor-major."""
        k, prev_cb, next_cb = self.top_k, self._select["selector_predecessor"], self._select["selector_successor"]
        gates = h @ self._select["selector_hidden"].T
        rows, before = [], np.array([int(anchor)])
        for p in range(1, len(logits)):
            cand = np.argpartition(-logits[p], k)[:k]
            cand = cand[np.argsort(-logits[p][cand], kind="stable")]  # the top k, best first
            score = (prev_cb[before] * gates[p]) @ next_cb[cand].T + logits[p][cand]
            rows.append(np.concatenate([cand.astype(np.float32), np.broadcast_to(score, (k, k)).reshape(-1)]))
            before = cand
        return np.stack(rows)

    def draft(self, token: int, k: int) -> np.ndarray:
        """Logits [k, vocab] of the block after ``token`` (the target's next token, at position n_past), as
        ``DFlashGraph.draft``: row i for the draft token at n_past + 1 + i (DSpark: biased by the Markov head given
        the argmax of row i − 1); DFlash2 leaves its selector rows in ``lattice``. The cache is left as before."""
        if not 1 <= k <= self.max_draft:
            raise OndeviceError(f"{self.path.name}: a {self.variant} block drafts 1..{self.max_draft} tokens, not {k}")
        first = self._first
        logits, h = self.forward([int(token)] + [self.mask_id] * (k + first - 1), markov_from=first)
        if self.top_k > 0:
            self.lattice = self._selector(logits, h, int(token))[first - 1:]
        return logits[first:first + k].copy()

    def block(self, token: int, k: int) -> Block:
        """``draft`` as a ``Block``: the row of each draft position given the token drafted before it."""
        logits = self.draft(token, k)
        return Block(token, logits, self.markov, self.lattice if self.top_k > 0 else None, self.top_k)

    def close(self) -> None:
        self._w, self._embed, self._head, self._cache = {}, None, None, []
