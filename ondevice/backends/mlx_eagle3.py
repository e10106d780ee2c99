"""An EAGLE-3 draft GGUF (arch ``eagle3``) run in MLX, fed an MLX target's layer inputs (``mlx_layers``).

The same file llama.cpp runs (``ondevice convert EAGLE_DIR --to gguf --target T``, or what ``train-heads`` writes),
read with ``gguf`` into mx arrays, and the same two steps as llama.cpp's eagle3 graphs
(``ondevice.backends.eagle3``), written in MLX:
- encode: ``g = fc(features)`` (after an RMSNorm when ``norm_before_fc``);
- decode: one llama decoder layer over [rms(embed(token)) ; rms(g)] with the draft's own KV cache (mlx-lm's
  ``KVCache``) and RoPE at the row's position (llama.cpp's interleaved pairs: the GGUF's q/k rows are permuted
  for it, so ``mx.fast.rope(traditional=True)``; llama-3 ``rope_freqs`` as periods), the residual from g (or
  rms(g) when ``norm_before_residual``), the MLP, then ``output_norm`` and the draft's LM head placed onto the
  target vocabulary by ``d2t`` (−inf elsewhere). The pre-norm output is the next depth's g.
Tokens are embedded with the draft's own table, or with the target's (``model.model.embed_tokens``, quantized or
not). Same convention and API as ``Eagle3Graph`` (``encode``, ``decode``, ``rollback``, ``n_past``, ``n_batch``),
so ``Eagle3Drafter``'s chains and trees and ``eagle3.absorb`` / ``seconds_per_token`` run on either.

Weights and activations keep an f16 file's f16 on a GPU (Metal); elsewhere they are f32 (as llama.cpp's graph
computes); q is whatever the draft computes, so either keeps the rejection rule exact.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal

import numpy as np

from ondevice.errors import OndeviceError

_NAMES = ("blk.0.attn_norm.weight", "blk.0.attn_norm_2.weight", "blk.0.ffn_norm.weight", "blk.0.attn_q.weight",
          "blk.0.attn_k.weight", "blk.0.attn_v.weight", "blk.0.attn_output.weight", "blk.0.ffn_gate.weight",
          "blk.0.ffn_up.weight", "blk.0.ffn_down.weight", "fc.weight", "output_norm.weight", "output.weight")


def read_gguf_draft(path: Path, arch: str, what: str, required: tuple[str, ...]) -> tuple[dict, dict[str, np.ndarray]]:
    """(metadata, {tensor name: array in numpy order}) of a draft GGUF of architecture ``arch``; the metadata holds
    the ``arch.…`` keys (full names), the mask token id and ``n_tokens`` (the vocabulary's size). Float tensors keep
    f16 / f32, other types are dequantized to f32, int64 ones (``d2t``) stay int64. Refuses (one line, naming the
    kind as ``what``, e.g. "an EAGLE-3") another architecture or a file without the ``required`` tensors."""
    import gguf

    from ondevice.formats.gguf import GGUFFile

    g = GGUFFile(path)
    if g.arch != arch:
        raise OndeviceError(f"{path}: architecture {g.arch!r}, not {what} draft ({arch})")
    meta = {k: g.get(k) for k in g.reader.fields if k.startswith(arch + ".")}
    tokens = g.reader.fields.get("tokenizer.ggml.tokens")
    meta.update({"tokenizer.ggml.mask_token_id": g.get("tokenizer.ggml.mask_token_id"),
                 "n_tokens": 0 if tokens is None else len(tokens.data)})
    out = {}
    kept = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.I64)
    for t in g.reader.tensors:
        shape = [int(d) for d in reversed(t.shape)]
        if t.name == "d2t" or t.tensor_type in kept:
            out[t.name] = np.array(t.data).reshape(shape)
        else:
            out[t.name] = np.asarray(gguf.dequantize(t.data, t.tensor_type), np.float32).reshape(shape)
    missing = [n for n in required if n not in out]
    if missing:
        raise OndeviceError(f"{path}: an {arch} GGUF without {', '.join(missing)}; reconvert the draft")
    return meta, out


def read_eagle3(path: Path) -> tuple[dict, dict[str, np.ndarray]]:
    """``read_gguf_draft`` of an eagle3 GGUF."""
    return read_gguf_draft(path, "eagle3", "an EAGLE-3", _NAMES)


class Eagle3MLX:
    """A loaded EAGLE-3 draft and its own KV cache (one sequence), in MLX (see the module docstring).

    Args:
        path: the eagle3 GGUF.
        target: the ``MLXBackend`` target (its device, its token table when the draft has none, checks of hidden
            size, vocabulary and depth); None: a draft with its own token table run alone (tests), on ``device``.
        layer_inputs_on: called with the draft's ``layer_ids`` once it is checked against the target (the drafter
            switches the target's layer inputs on there).
        n_ctx: positions of the draft's cache.
    Attributes:
        layer_ids, n_embd, n_embd_target, vocab_size: as ``Eagle3Graph``'s.
    Raises:
        OndeviceError: not an eagle3 GGUF, or made for another target (one line each).
    """

    n_batch = 512

    def __init__(self, path: str | Path, target=None, layer_inputs_on: Callable[[list[int]], object] | None = None, *,
                 n_ctx: int = 4096, device=None) -> None:
        import mlx.core as mx
        from mlx_lm.models.cache import KVCache

        self._mx, self.path, self.n_ctx = mx, Path(path), int(n_ctx)
        self.device = (device or mx.cpu) if target is None else target.device
        meta, w = read_eagle3(self.path)
        self.layer_ids = [int(i) for i in meta["eagle3.target_layers"]]
        self.n_embd = int(meta["eagle3.embedding_length"])
        self.n_embd_target = int(meta["eagle3.target_hidden_size"])
        self.vocab_size = int(meta["eagle3.vocab_size"])
        self.n_head = int(meta["eagle3.attention.head_count"])
        self.n_head_kv = int(meta["eagle3.attention.head_count_kv"])
        self.head_dim = int(meta.get("eagle3.attention.key_length") or self.n_embd // self.n_head)
        self.eps = float(meta["eagle3.attention.layer_norm_rms_epsilon"])
        self.norm_before_residual = bool(meta.get("eagle3.norm_before_residual", False))
        self.norm_before_fc = bool(meta.get("eagle3.norm_before_fc", False))
        d2t = w.pop("d2t", None)
        self._d2t = None if d2t is None else np.asarray(d2t, np.int64).reshape(-1)
        theta = float(meta.get("eagle3.rope.freq_base", 10000.0))
        periods = theta ** (np.arange(0, self.head_dim, 2, dtype=np.float64) / self.head_dim)
        factors = w.pop("rope_freqs.weight", None)
        if factors is not None:
            periods = periods * np.asarray(factors, np.float64)
        self._embed = None
        if target is not None:
            self._check_target(target, "token_embd.weight" in w)
        # one compute dtype: the file's f16 on a GPU, else f32 (norm vectors, stored f32, follow the matrices)
        self._dtype = mx.float16 if self.device == mx.gpu and w["fc.weight"].dtype == np.float16 else mx.float32
        with mx.stream(self.device):
            self._w = {k: mx.array(v).astype(self._dtype) for k, v in w.items()}
            self._freqs = mx.array(periods.astype(np.float32))
        self._cache = KVCache()
        if layer_inputs_on is not None:
            layer_inputs_on(list(self.layer_ids))

    def _check_target(self, target, own_table: bool) -> None:
        """Hidden size, vocabulary, depth and (without a table of its own) the target's token table."""
        name, n_layer, model = self.path.name, len(target._layer_list()), target.model
        hidden = int(getattr(getattr(model, "args", None), "hidden_size", 0) or self.n_embd_target)
        if hidden != self.n_embd_target:
            raise OndeviceError(f"{name}: made for a target of hidden size {self.n_embd_target}, this target has {hidden}")
        if target.vocab_size != self.vocab_size:
            raise OndeviceError(f"{name}: made for a vocabulary of {self.vocab_size} tokens, this target has "
                                f"{target.vocab_size}")
        if any(not 0 <= i < n_layer for i in self.layer_ids):
            raise OndeviceError(f"{name}: reads target layers {self.layer_ids}, this target has {n_layer}")
        if not own_table:
            self._embed = getattr(getattr(model, "model", None), "embed_tokens", None)
            if self._embed is None:
                raise OndeviceError(f"{name}: embeds tokens with its target's table, and mlx-lm's "
                                    f"{getattr(model, 'model_type', '?')!r} model has no model.embed_tokens")

    # -- cache -------------------------------------------------------------------------------------------
    @property
    def n_past(self) -> int:
        """Positions in the draft's cache."""
        return int(self._cache.offset)

    def rollback(self, n_past: int) -> None:
        """Drop the draft's cache from position ``n_past`` on."""
        from mlx_lm.models.cache import KVCache

        if n_past <= 0:
            self._cache = KVCache()
        elif n_past < self.n_past:
            self._cache.trim(self.n_past - int(n_past))

    # -- the two steps -----------------------------------------------------------------------------------
    def _rms(self, x, name: str):
        return self._mx.fast.rms_norm(x, self._w[name], self.eps)

    def encode(self, features: np.ndarray) -> np.ndarray:
        """Target layer features [n, 3 × n_embd_target] → g rows [n, n_embd] (float32)."""
        mx = self._mx
        width = len(self.layer_ids) * self.n_embd_target
        feats = np.asarray(features, np.float32)
        if feats.ndim != 2 or feats.shape[1] != width:
            raise ValueError(f"features of shape {feats.shape}; expected [n, {width}]")
        with mx.stream(self.device):
            f = mx.array(feats).astype(self._dtype)
            if self.norm_before_fc:
                f = self._rms(f, "enc.output_norm.weight")
            return np.array((f @ self._w["fc.weight"].T).astype(mx.float32))

    def decode(self, tokens: Sequence[int], g: np.ndarray, pos0: int,
               outputs: Literal["all", "last", "none"] = "all") -> tuple[np.ndarray, np.ndarray]:
        """Run the decoder layer on rows (token i, g[i]) at positions pos0 + i, adding them to the cache (the
        contract of ``Eagle3Graph.decode``).

        Returns:
            (logits [n_out, vocab_size] float32 over the target vocabulary, −inf outside the draft's; pre-norm rows
            [n_out, n_embd] float32), n_out = n, 1 or 0 for ``outputs`` all, last, none.
        """
        mx, w = self._mx, self._w
        n = len(tokens)
        g = np.asarray(g, np.float32)
        if g.shape != (n, self.n_embd):
            raise ValueError(f"g of shape {g.shape}; expected [{n}, {self.n_embd}]")
        if self.n_past != pos0:
            raise ValueError(f"the draft's cache holds {self.n_past} positions, not {pos0}; roll back first")
        if pos0 + n > self.n_ctx:
            raise OndeviceError(f"{self.path.name}: the draft's cache holds {self.n_ctx} positions; {pos0 + n} asked")
        nh, nkv, hd = self.n_head, self.n_head_kv, self.head_dim
        with mx.stream(self.device):
            ids = mx.array(np.asarray(tokens, np.int64).astype(np.int32))
            e = (self._embed(ids) if self._embed is not None else w["token_embd.weight"][ids]).astype(self._dtype)
            gx = mx.array(g).astype(self._dtype)
            gn = self._rms(gx, "blk.0.attn_norm_2.weight")
            x = mx.concatenate([self._rms(e, "blk.0.attn_norm.weight"), gn], axis=-1)[None]  # [1, n, 2h]

            def heads(name: str, k: int):
                return (x @ w[name].T).reshape(1, n, k, hd).transpose(0, 2, 1, 3)

            def rope(t):
                return mx.fast.rope(t, hd, traditional=True, base=None, scale=1.0, offset=pos0, freqs=self._freqs)

            q, k, v = rope(heads("blk.0.attn_q.weight", nh)), rope(heads("blk.0.attn_k.weight", nkv)), \
                heads("blk.0.attn_v.weight", nkv)
            k, v = self._cache.update_and_fetch(k, v)
            a = mx.fast.scaled_dot_product_attention(q, k, v, scale=hd ** -0.5, mask="causal" if n > 1 else None)
            h1 = a.transpose(0, 2, 1, 3).reshape(n, nh * hd) @ w["blk.0.attn_output.weight"].T
            h1 = h1 + (gn if self.norm_before_residual else gx)
            h2 = self._rms(h1, "blk.0.ffn_norm.weight")
            mlp = (mx.sigmoid(gate := h2 @ w["blk.0.ffn_gate.weight"].T) * gate * (h2 @ w["blk.0.ffn_up.weight"].T)) \
                @ w["blk.0.ffn_down.weight"].T
            pre = mlp + h1
            keep = {"all": slice(0, n), "last": slice(n - 1, n), "none": slice(0, 0)}[outputs]
            pre = pre[keep]
            draft = (self._rms(pre, "output_norm.weight") @ w["output.weight"].T).astype(mx.float32)
            pre = pre.astype(mx.float32)
            mx.eval(draft, pre, self._cache.keys, self._cache.values)
            draft, pre = np.array(draft), np.array(pre)
        if self._d2t is None:
            return draft, pre
        logits = np.full((len(draft), self.vocab_size), -np.inf, np.float32)
        logits[:, self._d2t] = draft
        return logits, pre

    def close(self) -> None:
        self._w, self._embed, self._cache = {}, None, None
