"""MLX backend on mlx-lm model classes: Metal GPU on a Mac, CPU elsewhere.

The cache is mlx-lm's per-layer list; rollback trims it. Caches that cannot be trimmed are refused
at load. Sliding-window layers (Gemma 3, ...) get a full-size ``KVCache`` instead of mlx-lm's
``RotatingKVCache``, as llama.cpp's ``swa_full``: mlx-lm builds the window into the attention mask
(``window_size``), so the logits are the same, and every position stays for an exact rollback.

Each backend runs on its own device (``mx.stream(device)`` around its work); the process-wide default
device is never changed, so two backends on different devices do not move each other.

Optional hidden states (``enable_hidden``, for heads drafting): each forward then runs the model's inner
stack (``model.model``, ending in the final norm) and its own output layer (``lm_head``, or the tied
``embed_tokens.as_linear``) itself, so the same pass gives the logits and the LM head's input;
``enable_hidden`` checks on a probe that this reproduces the model's own logits bit for bit and refuses
an architecture that does more after the output layer (logit soft-capping, scaling, ...).

Optional layer inputs (``enable_layer_inputs``, for EAGLE-3 drafts run in MLX by ``mlx_eagle3``): the same passes
tap the inputs of chosen decoder layers (``ondevice.backends.mlx_layers``).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import numpy as np

from ondevice.backends.base import check_room
from ondevice.backends.hf_vocab import HFVocab, no_remote_code
from ondevice.backends.mlx_layers import MLXLayerInputs
from ondevice.errors import OndeviceError

PREFILL_CHUNK = 512


def pick_device(device: str | None):
    """'gpu' | 'cpu' | None (Metal GPU when available, else CPU) → an mx.Device (the default is left alone)."""
    import mlx.core as mx

    has_gpu = mx.metal.is_available() if hasattr(mx, "metal") else False
    if device not in (None, "gpu", "cpu"):
        raise OndeviceError(f"device={device!r}: choose 'gpu' or 'cpu'")
    if device == "gpu" and not has_gpu:
        raise OndeviceError("device='gpu' needs Metal (Apple silicon); use device='cpu' here")
    return mx.gpu if (device == "gpu" or (device is None and has_gpu)) else mx.cpu


def mlx_tokenizer(path: Path, eos_token_ids=None):
    """mlx-lm's tokenizer wrapper for the model folder ``path``, never running code from the folder (an
    ``auto_map`` is not followed: ``hf_vocab.no_remote_code``). Every MLX path loads its tokenizer here."""
    from mlx_lm.utils import load_tokenizer

    return no_remote_code(path, lambda **kw: load_tokenizer(Path(path), kw, eos_token_ids=eos_token_ids))


class MLXBackend(MLXLayerInputs, HFVocab):
    """An mlx-lm model directory and its KV cache (see ``ondevice.backends.Backend``).

    Args:
        path: an mlx-lm style directory (config.json, *.safetensors, tokenizer files).
        n_ctx: context length (checked on every eval).
        device: 'gpu', 'cpu' or None (Metal when available).
    """

    # post-norm hidden states, after ``enable_hidden`` (heads); decoder-layer inputs (EAGLE-3: ``mlx_layers``)
    features = frozenset({"hidden", "layer_inputs"})

    def __init__(self, path: str | Path, *, n_ctx: int = 4096, device: str | None = None, threads: int | None = None) -> None:
        self.path = Path(path)
        for need in ("config.json", "tokenizer.json"):
            if not (self.path / need).is_file():
                raise OndeviceError(f"{self.path / need}: missing; an MLX model directory needs config.json, weights and tokenizer.json")
        self.device = pick_device(device)
        import mlx.core as mx
        self._mx = mx
        self.kernels = f"mlx {mx.__version__}"
        try:
            with mx.stream(self.device):
                self.model, self.tokenizer = self._load_model()
        except (ValueError, FileNotFoundError, KeyError) as e:
            raise OndeviceError(f"{self.path}: mlx-lm could not load this model ({e})") from e
        self.cache = self._new_cache()
        self._valid: int | None = None  # while an eval is in flight: positions known to be complete
        self._head = None  # enable_hidden(): (output layer module, its call on a hidden state)
        self._hidden: tuple[int, np.ndarray] | None = None  # (first position, rows) of the last eval
        self._tree_hidden: np.ndarray | None = None  # every node's hidden state of the last eval_tree
        self.n_ctx = int(n_ctx)
        args = getattr(self.model, "args", None)
        self.vocab_size = int(getattr(args, "vocab_size", 0) or len(self.tokenizer.get_vocab()))
        self._init_vocab(self.tokenizer._tokenizer, self.tokenizer.eos_token_ids or [])  # the HF fast tokenizer

    def _load_model(self):
        """(model, tokenizer) from mlx-lm (``ondevice.distributed.sharded`` overrides this to split the model over ranks)."""
        from mlx_lm.utils import load_model

        model, config = load_model(self.path)  # mlx-lm refuses a config's model_file (custom code) by default
        return model, mlx_tokenizer(self.path, config.get("eos_token_id"))

    def _new_cache(self) -> list:
        """mlx-lm's cache for this model, with full-size caches for sliding-window layers."""
        from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

        cache = [KVCache() if isinstance(c, RotatingKVCache) and c.keep == 0 else c for c in make_prompt_cache(self.model)]
        for c in cache:
            if not isinstance(c, (KVCache, RotatingKVCache)) or not hasattr(c, "trim"):
                raise OndeviceError(f"{self.path}: its {type(c).__name__} cache cannot be rolled back; speculative decoding needs a trimmable cache")
        return cache

    # -- cache -----------------------------------------------------------------------------------
    @property
    def n_past(self) -> int:
        """Positions every layer holds (an interrupted forward may have advanced only some layers)."""
        if self.model is None:
            raise OndeviceError(f"{self.path.name}: this model was closed; load it again")
        n = min(int(c.offset) for c in self.cache)
        return n if self._valid is None else min(n, self._valid)

    def _whole(self) -> bool:
        """Whether this is one whole model (not a subclass splitting it: hidden states and layer inputs need it)."""
        return type(self) is MLXBackend

    # -- hidden states (optional) ----------------------------------------------------------------
    def enable_hidden(self) -> int:
        """Keep the post-norm hidden state (the output layer's input) of every row each later ``eval``
        outputs; returns its size. Refuses, in one line naming the model's mlx-lm file, an architecture
        whose logits are not its output layer applied to its inner model's output."""
        if self._head is not None:
            return self.n_embd
        if type(self) is not MLXBackend:
            raise OndeviceError(f"{type(self).__name__}: hidden states (heads) are not implemented for a split model")
        mx, net = self._mx, self.model
        where = getattr(sys.modules.get(type(net).__module__), "__file__", None) or type(net).__module__
        body = getattr(net, "model", None)
        layers = [(m, m) for m in (getattr(net, "lm_head", None),) if m is not None]
        emb = getattr(body, "embed_tokens", None)
        if emb is not None:
            layers.append((emb, emb.as_linear))
        probe = mx.array([[(7 * i + 3) % self.vocab_size for i in range(8)]])
        found, h = None, None
        try:
            with mx.stream(self.device):
                ref = net(probe, cache=self._new_cache())
                h = body(probe, cache=self._new_cache()) if body is not None else None
                for layer, call in layers:
                    got = call(h)
                    if got.shape == ref.shape and bool(mx.array_equal(got, ref).item()):
                        found = (layer, call)
                        break
        except Exception:  # an inner model that does not take (tokens, cache): no hidden state to read
            found = None
        if found is None or h is None:
            raise OndeviceError(f"{self.path.name}: its logits are not its output layer applied to its inner model's output "
                                f"(checked on a probe; {where} does something else, e.g. logit soft-capping or scaling); "
                                "heads cannot use it")
        self._head = found
        self.n_embd = int(h.shape[-1])
        return self.n_embd

    def output_rows(self, ids: Sequence[int]) -> tuple[np.ndarray, np.ndarray, str]:
        """(output-layer rows, token-embedding rows, architecture) for ``ids``, float32 [n, d]: the rows the
        logits are computed with (``enable_hidden`` first), quantized layers dequantized by ``mx.dequantize``."""
        if self._head is None:
            raise ValueError("output_rows needs enable_hidden() first")
        mx = self._mx
        idx = mx.array(np.asarray(ids, np.int64).astype(np.int32))
        out_layer, emb = self._head[0], self.model.model.embed_tokens
        if "bias" in out_layer:
            raise OndeviceError(f"{self.path.name}: its output layer has a bias; heads draft from its rows alone")

        def rows(layer) -> np.ndarray:
            if "scales" in layer:  # QuantizedLinear / QuantizedEmbedding: only the rows asked for
                biases = layer.get("biases")
                w = mx.dequantize(layer["weight"][idx], scales=layer["scales"][idx], biases=None if biases is None else biases[idx],
                                  group_size=layer.group_size, bits=layer.bits, mode=getattr(layer, "mode", "affine"))
            else:
                w = layer["weight"][idx]
            return np.array(w.astype(mx.float32))

        with mx.stream(self.device):
            out, e = rows(out_layer), rows(emb)
        return out, e, self._model_type()

    def token_table(self, chunk: int = 16384) -> np.ndarray:
        """Every token's embedding row, float32 [V, h] (``output_rows`` a chunk at a time: its output rows dropped)."""
        table = np.empty((self.vocab_size, self.enable_hidden()), np.float32)
        for s in range(0, self.vocab_size, chunk):
            table[s:s + chunk] = self.output_rows(np.arange(s, min(self.vocab_size, s + chunk)))[1]
        return table

    def _model_type(self) -> str:
        return str(getattr(self.model, "model_type", None) or getattr(getattr(self.model, "args", None), "model_type", ""))

    def final_norm(self) -> np.ndarray:
        """The scale of the final RMSNorm (float32 [h]; Gemma's norms scale by 1 + weight, as its GGUF stores);
        a one-line refusal where the mlx-lm model has none at ``model.norm``."""
        w = getattr(getattr(getattr(self.model, "model", None), "norm", None), "weight", None)
        if w is None:
            raise OndeviceError(f"{self.path.name}: no final norm (model.norm.weight) in its mlx-lm model")
        out = np.array(w.astype(self._mx.float32)).reshape(-1)
        return out + 1.0 if self._model_type().startswith("gemma") else out

    def _forward(self, x, cache):
        """(logits, hidden states or None) of one pass: with hidden states on, the inner model and the
        output layer (checked in ``enable_hidden`` to be the model's own logits)."""
        if self._head is None:
            return self.model(x, cache=cache), None
        h = self.model.model(x, cache=cache)
        return self._head[1](h), h

    def eval(self, tokens: Sequence[int], logits: Literal["all", "last"] = "all") -> np.ndarray:
        mx = self._mx
        n = len(tokens)
        self._valid = base = self.n_past
        self._hidden = None
        check_room(self._valid, n, self.n_ctx, self.path)
        tokens = list(tokens)
        kept = []  # (first position, layer-input rows) of each pass, kept once the eval has finished
        with mx.stream(self.device), self._recording() as rec:
            if logits == "last" and n > 1:
                # All but the last token only fill the cache: their logits are never evaluated (MLX is
                # lazy), so the output layer runs for one row, as in mlx-lm's own prefill.
                for start in range(0, n - 1, PREFILL_CHUNK):
                    self.model(mx.array([tokens[start : min(start + PREFILL_CHUNK, n - 1)]]), cache=self.cache)
                    kept.append((base + start, self._drain(rec, [c.state for c in self.cache])))
                tokens = tokens[-1:]
            outs = [self._forward(mx.array([tokens[s : s + PREFILL_CHUNK]]), self.cache)
                    for s in range(0, len(tokens), PREFILL_CHUNK)]  # ([1, m, V], [1, m, d] | None) each
            rows = [lg[0] for lg, _ in outs]
            res = (rows[0] if len(rows) == 1 else mx.concatenate(rows)).astype(mx.float32)
            if self._head is not None:
                hid = mx.concatenate([h[0] for _, h in outs]).astype(mx.float32)
                kept.append((base + n - len(tokens), self._drain(rec, res, hid)))
                self._hidden = (base + n - len(tokens), np.array(hid))
            else:
                kept.append((base + n - len(tokens), self._drain(rec, res)))
            out = np.array(res)
        self._valid = None  # every layer now holds every position
        for pos0, f in kept:
            if f is not None:
                self._keep_rows(pos0, f)
        return out

    # -- trees -----------------------------------------------------------------------------------
    def tree_unsupported(self) -> str | None:
        """Why this model cannot verify a tree in one pass (None when it can)."""
        from mlx_lm.models.cache import KVCache

        if type(self) is not MLXBackend:
            return f"{type(self).__name__}: tree passes are not implemented for a split model"
        if any(type(c) is not KVCache for c in self.cache):
            return f"{self.path.name}: its {type(self.cache[-1]).__name__} layers cannot take a tree mask"
        return None

    def eval_tree(self, tokens: Sequence[int], parents: Sequence[int]) -> np.ndarray:
        """Evaluate a token tree after the cache's positions in one forward pass.

        The nodes go in as a batch of n one-token sequences, so that each has its own RoPE position
        (n_past + depth: mlx-lm's RoPE takes one offset per batch row, as for its ``BatchKVCache``), with
        an explicit boolean attention mask [n, 1, 1, n_past + n]: node i sees the context and its
        ancestors and itself. Each layer's cache stores the n new K/V rows once, in node order; the rows
        every node attends over are that cache broadcast to the n rows (a cost of n × context reads).

        Args:
            tokens: [n] ids; tokens[0] is the root (the token after the cache).
            parents: [n] parent indices, parents[0] == -1 and parents[i] < i.
        Returns:
            [n, vocab_size] float32 logits, row i scoring the token after node i's path.
            Call ``keep_path`` next; until then ``n_past`` reports the context only.
        """
        mx, n = self._mx, len(tokens)
        if n == 0 or parents[0] != -1 or any(not 0 <= parents[i] < i for i in range(1, n)):
            raise ValueError(f"bad tree: parents {list(parents)}")
        why = self.tree_unsupported()
        if why:
            raise OndeviceError(why)
        base = self.n_past
        check_room(base, n, self.n_ctx, self.path)
        see = np.zeros((n, base + n), dtype=bool)  # see[i, j]: node i attends to cache row j
        see[:, :base] = True
        depth = [0] * n
        for i in range(n):
            see[i, base + i] = True
            if i:
                depth[i] = depth[parents[i]] + 1
                see[i, base : base + i] |= see[parents[i], base : base + i]
        pos = np.array([base + d for d in depth])
        self._valid = base  # the cache holds every branch until keep_path
        self._hidden = self._tree_hidden = self._tree_rows = None
        with mx.stream(self.device), self._recording() as rec:
            proxies = [_TreeCache(c, mx.array(pos), see, mx) for c in self.cache]
            out, h = self._forward(mx.array([[int(t)] for t in tokens]), proxies)
            out = out[:, -1, :].astype(mx.float32)  # [n, V]
            if h is not None:  # every node's hidden state (``hidden`` after ``keep_path``)
                h = h[:, -1, :].astype(mx.float32)
            rows = self._drain(rec, out, *([] if h is None else [h]))
            if h is not None:
                self._tree_hidden = np.array(h)
            self._tree_rows = rows  # every node's layer inputs (``feature`` after ``keep_path``)
            out = np.array(out)
        self._tree = (base, list(parents))
        return out

    def keep_path(self, path: Sequence[int]) -> None:
        """After ``eval_tree``: keep the context and the nodes of ``path`` (``[0, a1, .., ak]``, root first),
        moved to positions n_past .. n_past + k in every layer; drop the other nodes."""
        tree = getattr(self, "_tree", None)
        if tree is None:
            raise ValueError("keep_path needs an eval_tree before it")
        mx = self._mx
        base, parents = tree
        path = list(path)
        if path and (path[0] != 0 or any(parents[b] != a for a, b in zip(path[:-1], path[1:], strict=True))):
            raise ValueError(f"{path} is not a path from the root of the last tree")
        self._tree = None
        th, self._tree_hidden = self._tree_hidden, None
        if th is not None and path:  # the kept nodes are positions base.. in path order
            self._hidden = (base, th[path])
        rows, self._tree_rows = self._tree_rows, None
        if rows is not None and path:
            self._keep_rows(base, rows[path])
        idx = mx.array([base + i for i in path], dtype=mx.int32)
        with mx.stream(self.device):
            for c in self.cache:
                if path:
                    c.keys[..., base : base + len(path), :] = mx.take(c.keys, idx, axis=2)
                    c.values[..., base : base + len(path), :] = mx.take(c.values, idx, axis=2)
                c.offset = base + len(path)
            mx.eval([c.state for c in self.cache])
        self._valid = None

    def rollback(self, n_past: int) -> None:
        cur = self.n_past
        if n_past > cur or n_past < 0:
            raise ValueError(f"cannot roll back to {n_past}: cache holds {cur} positions")
        self._tree_rows = None
        if n_past == 0:  # a fresh cache: always possible, whatever state the old one was left in
            self.cache = self._new_cache()
            self._valid = None
            self._trim_rows(0)
            return
        over = [c for c in self.cache if c.offset > n_past]
        for c in over:
            if not c.is_trimmable():
                raise OndeviceError(
                    f"{self.path.name}: its {type(c).__name__} has wrapped around its window; rolling back would "
                    f"give wrong logits, so it is refused (use a context no longer than the window)"
                )
        for c in over:
            c.trim(c.offset - n_past)
        self._valid = None
        self._trim_rows(n_past)

    def close(self) -> None:
        self._tree = None
        self._hidden = self._tree_hidden = self._head = self._tree_rows = None
        self._layer_ids = None
        self.cache = []
        self.model = None
        try:
            self._mx.clear_cache()
        except AttributeError:  # older mlx
            pass


class _TreeCache:
    """One layer's ``KVCache`` as mlx-lm's attention sees it during ``MLXBackend.eval_tree``: a batch of n
    one-token rows with per-row RoPE offsets and the tree's boolean mask (only the protocol mlx-lm's
    attention uses: ``offset``, ``update_and_fetch``, ``make_mask``)."""

    def __init__(self, cache, offset, see: np.ndarray, mx) -> None:
        self.cache, self.offset, self._see, self._mx = cache, offset, see, mx

    def update_and_fetch(self, keys, values):
        mx = self._mx
        n = keys.shape[0]  # [n, H, 1, D] → one [1, H, n, D] block appended in node order
        k, v = self.cache.update_and_fetch(keys.transpose(2, 1, 0, 3), values.transpose(2, 1, 0, 3))
        return mx.broadcast_to(k, (n, *k.shape[1:])), mx.broadcast_to(v, (n, *v.shape[1:]))

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None, **kw):
        see = self._see
        if window_size:  # sliding-window layers: a node sees positions > its own − window (as llama.cpp)
            base = see.shape[1] - see.shape[0]
            pos_q = np.asarray(self.offset.tolist())[:, None]
            pos_k = np.concatenate([np.arange(base), np.asarray(self.offset.tolist())])[None, :]
            see = see & (pos_q - pos_k < window_size)
        return self._mx.array(see[:, None, None, :])
