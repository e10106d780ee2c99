"""An EAGLE-3 draft GGUF (arch ``eagle3``) run by llama.cpp's own graphs, fed a target's layer features.

llama.cpp builds two graphs for the arch (``src/models/eagle3.cpp``):
- encoder (``llama_process(ENCODE)``, rows of width 3 × target hidden): ``g = fc(features)`` (after an RMSNorm
  when ``norm_before_fc``), read back as the context's "nextn" embeddings;
- decoder (``llama_process(DECODE)``, each row a token *and* a g row of width draft hidden): one llama decoder
  layer over [norm(embed(token)) ; norm(g)] with the draft's own KV cache and RoPE at the row's position; it
  returns logits over the *target* vocabulary (−inf outside the draft vocabulary, via d2t) and the layer's
  pre-norm output, which is the g of the next depth when drafting a chain.

Convention (as llama.cpp's driver, common/speculative.cpp): the draft's cache position P holds the pair
(token at P + 1, g of the target's features at P). Tokens are embedded with the draft's own table, or with the
target's (through ``ctx_other``, so the target context must outlive this one).

API: ``Eagle3Graph`` (encode / decode / rollback), ``absorb`` (bring the draft's cache up to a target pass),
``draft_chain`` (a chain with q rows from a ``pick``), ``draft_tree`` (top-b branches, greedy continuations).
The target's features come from ``ondevice.backends.llama_ext``: ``record_layer_inputs`` + ``layer_inputs``
(llama, qwen3, … : ``LAYER_INP_ARCHS``) or ``EvalTap`` (cb_eval; qwen2).
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal

import numpy as np

from ondevice.backends import llama_ext
from ondevice.errors import OndeviceError


class Eagle3Graph(llama_ext.LlamaHandles):
    """A loaded EAGLE-3 draft and its own context and KV cache (one sequence).

    Args:
        path: the eagle3 GGUF (``converters.eagle3``).
        target_ctx, target_model: the target's llama_context / llama_model handles (``LlamaBackend._ctx`` /
            ``_model``); the draft borrows the target's token embeddings / output through ``ctx_other`` when it
            has none of its own. Close this graph before the target. None (both): a draft with its own
            embeddings and output run alone (conversion checks). ``target_ctx`` may be a callable: called with
            ``layer_ids`` once the draft is checked against the target, it returns the context (so the target
            can switch its layer inputs on first, which may recreate its context: ``LlamaBackend``).
        n_ctx: positions of the draft's cache.
        n_batch: most rows per encode / decode call.
        threads: CPU threads (default: llama.cpp's).
        gpu: offload the draft's layers (when llama.cpp was built with a GPU backend).
        exact: f32 KV cache and no flash attention (llama.cpp rounds K/V (and Q in flash attention) to f16
            otherwise: 3e-4 relative on logits); conversion checks use it.
    Attributes:
        layer_ids: the 3 target layers whose inputs it reads.
        n_embd: the draft's hidden size (g and pre-norm rows); n_embd_target: the target's.
        vocab_size: the target vocabulary (logit row width).
    Raises:
        OndeviceError: not an eagle3 GGUF, or a target of another hidden size / vocabulary / depth (one line each).
    """

    def __init__(self, path: str | Path, target_ctx, target_model, *, n_ctx: int = 4096, n_batch: int = 512,
                 threads: int | None = None, gpu: bool = False, exact: bool = False) -> None:
        import llama_cpp

        from ondevice.formats.gguf import check_gguf_file

        self._lib = llama_cpp
        self.path = Path(path)
        self._model = self._ctx = self._batch = None
        check_gguf_file(self.path)
        llama_ext.init_llama()
        mp = llama_cpp.llama_model_default_params()
        mp.n_gpu_layers = 999 if gpu else 0
        self._model = llama_cpp.llama_model_load_from_file(str(self.path).encode(), mp)
        if not self._model:
            raise OndeviceError(f"{self.path}: llama.cpp could not load this GGUF (corrupt, or not an eagle3 draft)")
        arch = llama_ext.model_arch(self._model)
        if arch != "eagle3":
            self.close()
            raise OndeviceError(f"{self.path}: architecture {arch!r}, not an EAGLE-3 draft (eagle3)")
        self.layer_ids = llama_ext.target_layer_ids(self._model)
        self.n_embd = int(llama_cpp.llama_model_n_embd(self._model))
        self.n_embd_target = _meta_int(self._model, "eagle3.target_hidden_size") or self.n_embd
        self.vocab_size = int(llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self._model)))
        if target_model is not None:
            try:
                self._check_target(target_model)
            except OndeviceError:
                self.close()
                raise
        if callable(target_ctx):
            target_ctx = self._or_close(target_ctx, list(self.layer_ids))
        cp = llama_cpp.llama_context_default_params()
        cp.n_ctx = int(n_ctx)
        cp.n_batch = cp.n_ubatch = int(n_batch)
        cp.n_seq_max = 1
        cp.no_perf = True
        if exact:
            cp.type_k = cp.type_v = llama_cpp.GGML_TYPE_F32
            cp.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        if threads:
            cp.n_threads = cp.n_threads_batch = int(threads)
        if target_ctx is not None:
            cp.ctx_other = llama_ext._ptr(target_ctx)
        self._ctx = llama_cpp.llama_init_from_model(self._model, cp)
        if not self._ctx:
            self.close()
            raise OndeviceError(f"{self.path.name}: llama.cpp could not create the draft's context (n_ctx={n_ctx})")
        self.n_batch = int(llama_cpp.llama_n_ubatch(self._ctx))
        self._mem = llama_cpp.llama_get_memory(self._ctx)
        self._batch = llama_cpp.llama_batch_ext_init(self._ctx)
        # the encoder's g rows and the decoder's pre-norm rows come back as "nextn" embeddings of output rows
        llama_ext.fn("llama_set_embeddings_nextn")(llama_ext._ptr(self._ctx), True, True)
        self._pos = (ctypes.c_int32 * 4)()

    def _check_target(self, target_model) -> None:
        """Hidden size, vocabulary and depth of the target. Whether its graph records layer inputs is checked
        where they are asked for (``llama_ext.record_layer_inputs``; ``llama_ext.EvalTap`` for those that do not)."""
        lib, name = self._lib, self.path.name
        n_embd = int(lib.llama_model_n_embd(target_model))
        n_vocab = int(lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(target_model)))
        n_layer = int(lib.llama_model_n_layer(target_model))
        if n_embd != self.n_embd_target:
            raise OndeviceError(f"{name}: made for a target of hidden size {self.n_embd_target}, this target has {n_embd}")
        if n_vocab != self.vocab_size:
            raise OndeviceError(f"{name}: made for a vocabulary of {self.vocab_size} tokens, this target has {n_vocab}")
        if any(not 0 <= i < n_layer for i in self.layer_ids):
            raise OndeviceError(f"{name}: reads target layers {self.layer_ids}, this target has {n_layer}")

    # -- cache -------------------------------------------------------------------------------------------
    @property
    def n_past(self) -> int:
        """Positions in the draft's cache (read from llama.cpp)."""
        return int(self._lib.llama_memory_seq_pos_max(self._mem, 0)) + 1

    def rollback(self, n_past: int) -> None:
        """Drop the draft's cache from position ``n_past`` on."""
        if n_past <= 0:
            self._lib.llama_memory_clear(self._mem, False)
        elif not self._lib.llama_memory_seq_rm(self._mem, 0, int(n_past), -1):
            raise OndeviceError(f"{self.path.name}: the draft's cache cannot roll back to {n_past}")

    # -- graphs ------------------------------------------------------------------------------------------
    def encode(self, features: np.ndarray) -> np.ndarray:
        """Target layer features [n, 3 × n_embd_target] → g rows [n, n_embd] (fc; no cache involved)."""
        lib = self._lib
        feats = np.ascontiguousarray(features, dtype=np.float32)
        width = len(self.layer_ids) * self.n_embd_target
        if feats.ndim != 2 or feats.shape[1] != width:
            raise ValueError(f"features of shape {feats.shape}; expected [n, {width}]")
        out = np.empty((feats.shape[0], self.n_embd), np.float32)
        get = llama_ext.fn("llama_get_embeddings_nextn")
        base = self.n_past
        for s in range(0, feats.shape[0], self.n_batch):
            chunk = feats[s:s + self.n_batch]
            lib.llama_batch_ext_clear(self._batch)
            for i, row in enumerate(chunk):
                e = lib.llama_embd(row.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, width)
                idx = lib.llama_batch_ext_add_embd(self._batch, 0, e)
                self._pos[0] = base + i  # ignored by the per-token encoder, but checked against the cache
                if idx < 0 or not lib.llama_batch_ext_set_pos(self._batch, idx, self._pos):
                    raise OndeviceError(f"{self.path.name}: could not build the encoder batch (code {idx})")
                lib.llama_batch_ext_set_output_embd(self._batch, idx, True)
            rc = lib.llama_process(self._ctx, lib.LLAMA_PROCESS_TYPE_ENCODE, self._batch)
            if rc != 0:
                raise OndeviceError(f"{self.path.name}: the EAGLE-3 encoder failed (code {rc})")
            p = get(llama_ext._ptr(self._ctx))
            if not p:
                raise OndeviceError(f"{self.path.name}: the EAGLE-3 encoder returned no rows")
            out[s:s + len(chunk)] = np.ctypeslib.as_array(p, shape=(len(chunk), self.n_embd))
        return out

    def decode(self, tokens: Sequence[int], g: np.ndarray, pos0: int,
               outputs: Literal["all", "last", "none"] = "all") -> tuple[np.ndarray, np.ndarray]:
        """Run the decoder layer on rows (token i, g[i]) at positions pos0 + i, adding them to the cache.

        Args:
            tokens: the token of each row (by the convention above: the token *after* the g row's position).
            g: [n, n_embd] rows: encoder output for target positions, or a previous pre-norm output.
            pos0: position of the first row; the cache must hold exactly pos0 positions (``rollback``).
            outputs: which rows to return. llama.cpp's eagle3 graph computes every row and its context copies
                the first n_outputs of them, so any selection other than a prefix would return the wrong rows:
                "last" decodes the rows before the last without outputs, then the last alone.
        Returns:
            (logits [n_out, vocab_size] over the target vocabulary, pre-norm rows [n_out, n_embd]).
        """
        g = np.ascontiguousarray(g, dtype=np.float32)
        n = len(tokens)
        if g.shape != (n, self.n_embd):
            raise ValueError(f"g of shape {g.shape}; expected [{n}, {self.n_embd}]")
        if n > self.n_batch:
            raise ValueError(f"{n} rows; the draft's context takes at most {self.n_batch} per call")
        if self.n_past != pos0:
            raise ValueError(f"the draft's cache holds {self.n_past} positions, not {pos0}; roll back first")
        if outputs == "last" and n > 1:
            self._decode(tokens[:-1], g[:-1], pos0, False)
            return self._decode(tokens[-1:], g[-1:], pos0 + n - 1, True)
        return self._decode(tokens, g, pos0, outputs != "none")

    def _decode(self, tokens: Sequence[int], g: np.ndarray, pos0: int, out: bool) -> tuple[np.ndarray, np.ndarray]:
        lib = self._lib
        n = len(tokens)
        lib.llama_batch_ext_clear(self._batch)
        for i, t in enumerate(tokens):
            idx = lib.llama_batch_ext_add_token(self._batch, 0, int(t))
            self._pos[0] = pos0 + i
            e = lib.llama_embd(g[i].ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, self.n_embd)
            if idx < 0 or not lib.llama_batch_ext_set_pos(self._batch, idx, self._pos) \
                    or not lib.llama_batch_ext_set_embd_token(self._batch, idx, e):
                raise OndeviceError(f"{self.path.name}: could not build the decoder batch at row {i} (code {idx})")
            lib.llama_batch_ext_set_output_logits(self._batch, idx, out)
        rc = lib.llama_process(self._ctx, lib.LLAMA_PROCESS_TYPE_DECODE, self._batch)
        if rc != 0:
            raise OndeviceError(f"{self.path.name}: the EAGLE-3 decoder failed (code {rc}) at position {pos0}")
        m = n if out else 0
        logits = np.empty((m, self.vocab_size), np.float32)
        pre = np.empty((m, self.n_embd), np.float32)
        get_h = llama_ext.fn("llama_get_embeddings_nextn_ith")
        for i in range(m):
            logits[i] = np.ctypeslib.as_array(lib.llama_get_logits_ith(self._ctx, i), shape=(self.vocab_size,))
            pre[i] = np.ctypeslib.as_array(get_h(llama_ext._ptr(self._ctx), i), shape=(self.n_embd,))
        return logits, pre


def absorb(graph: Eagle3Graph, features: np.ndarray, tokens: Sequence[int], pos0: int,
           next_token: int) -> tuple[np.ndarray, np.ndarray]:
    """Bring the draft's cache up to a target pass (see ``draft_chain``) and return the depth-1 row:
    (logits [1, V], pre-norm [1, n_embd]) of the pair (next_token, g of tokens[-1])."""
    n = len(tokens)
    if features.shape[0] != n or n < 1:
        raise ValueError(f"{features.shape[0]} feature rows for {n} tokens")
    graph.rollback(pos0)
    g = graph.encode(features)
    shifted = [int(t) for t in tokens[1:]] + [int(next_token)]
    for s in range(0, n, graph.n_batch):  # a long prefill in chunks; only the last row's logits are read
        e = min(n, s + graph.n_batch)
        logits, pre = graph.decode(shifted[s:e], g[s:e], pos0 + s, "last" if e == n else "none")
    return logits, pre


def seconds_per_token(graph: Eagle3Graph, reps: int = 7, after: Callable[[np.ndarray], object] | None = None) -> float:
    """Median seconds of one drafted token: a decoder row and its logits (then ``after(logits)``, e.g. the drafter's
    processing of them), timed ``reps`` times on the draft's cache, which is left as it was found."""
    base = graph.n_past
    pre = np.zeros((1, graph.n_embd), np.float32)
    times = []
    try:
        for _ in range(reps):
            t0 = time.perf_counter()
            logits, pre = graph.decode([0], pre, graph.n_past)
            if after is not None:
                after(logits)
            times.append(time.perf_counter() - t0)
    finally:
        graph.rollback(base)
    return float(np.median(times))


def greedy_pick(logits: np.ndarray) -> tuple[int, np.ndarray]:
    """The default ``pick``: the argmax and a one-hot q row."""
    t = int(np.argmax(logits))
    q = np.zeros(logits.shape[-1], np.float64)
    q[t] = 1.0
    return t, q


def draft_chain(graph: Eagle3Graph, features: np.ndarray, tokens: Sequence[int], pos0: int, next_token: int,
                k: int, pick: Callable[[np.ndarray], tuple[int, np.ndarray]] = greedy_pick,
                keep_drafting: Callable[[list[int], np.ndarray], bool] | None = None) -> tuple[list[int], np.ndarray]:
    """Draft a chain of up to ``k`` tokens after a target pass, with the draft's own KV cache.

    The target has just processed ``tokens`` at positions pos0.. (a prefill chunk, or the accepted prefix of a
    verify pass: the token before the drafts and the accepted drafts) and recorded their layer ``features``;
    ``next_token`` is what it chose after them. The draft's cache is rolled back to pos0 (dropping the last
    round's speculative rows; position pos0 − 1 stays as written), the pairs (tokens[i + 1], g[i]) and
    (next_token, g[n − 1]) are decoded in one pass, and each later depth decodes (its drafted token, the
    previous depth's pre-norm output) at the next position, as llama.cpp's ``common/speculative.cpp`` does.

    Args:
        graph: the draft (``Eagle3Graph``).
        features: [n, 3 × target hidden] layer inputs of ``tokens`` (``llama_ext.layer_inputs``).
        pick: logits row over the target vocabulary (−inf outside the draft's) → (token, q row): the request's
            processed distribution and a draw from it (``ondevice.sampling.probs_sparse`` and a sampler), so
            the rejection rule keeps the target's law; the default is greedy with a one-hot q.
        keep_drafting: asked after each drafted token with (tokens so far, q rows so far); False stops.
    Returns:
        (drafted tokens [k'], q rows [k', V]), k' ≤ k.
    """
    logits, pre = absorb(graph, features, tokens, pos0, next_token)
    pos = pos0 + len(tokens)
    drafted: list[int] = []
    qs: list[np.ndarray] = []
    while True:
        t, q = pick(logits[-1])
        drafted.append(t)
        qs.append(q)
        if len(drafted) >= k or (keep_drafting is not None and not keep_drafting(drafted, np.array(qs))):
            break
        logits, pre = graph.decode([t], pre[-1:], pos)
        pos += 1
    return drafted, np.array(qs)


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def draft_tree(graph: Eagle3Graph, features: np.ndarray, tokens: Sequence[int], pos0: int, next_token: int,
               branches: int, depth: int) -> tuple[list[int], list[int], list[float]]:
    """A top-``branches`` tree after a target pass: the draft's ``branches`` most likely first tokens, each
    continued greedily to ``depth`` tokens (arguments as ``draft_chain``).

    Every drafted token is a deterministic guess (distinct siblings, a point-mass q), which ``ondevice.tree``'s
    multi-draft rejection rule keeps exact at any temperature. Branches are decoded one after another from the
    shared rows (the cache is rolled back between them), so a node costs what a chain's token costs.

    Returns:
        (tokens, parents, scores) in ``ondevice.tree.Tree``'s order without the root: node i's parent index
        counts the root as 0 (parents[i] ≤ i); scores[i] is the product of the draft's softmax probabilities
        along node i's path (its estimate that the whole path is accepted).
    """
    n = len(tokens)
    logits, pre0 = absorb(graph, features, tokens, pos0, next_token)
    row = logits[0]
    p0 = _softmax(row.astype(np.float64))
    top = [int(t) for t in np.argsort(-p0, kind="stable")[:branches] if np.isfinite(row[t])]
    shared = graph.n_past  # pos0 + n: every row up to the pending token's pair
    out_t, out_p, out_s = [], [], []
    for t in top:
        graph.rollback(shared)
        out_t.append(t)
        out_p.append(0)
        out_s.append(float(p0[t]))
        parent, score, pos = len(out_t), float(p0[t]), pos0 + n
        g = pre0
        for _ in range(depth - 1):
            logits, pre = graph.decode([t], g, pos)
            pr = _softmax(logits[0].astype(np.float64))
            t = int(np.argmax(logits[0]))
            score *= float(pr[t])
            out_t.append(t)
            out_p.append(parent)
            out_s.append(score)
            parent, g, pos = len(out_t), pre, pos + 1
    return out_t, out_p, out_s


def _meta_int(model, key: str) -> int | None:
    import llama_cpp

    buf = ctypes.create_string_buffer(32)
    n = llama_cpp.llama_model_meta_val_str(model, key.encode(), buf, len(buf))
    return int(buf.value) if n > 0 else None
