"""A DFlash block draft (GGUF arch ``dflash``) run through llama.cpp's own graph (``DFlashGraph``); the runtime's
drafter is ``ondevice.drafters.dflash``.

DFlash drafts a whole block in one pass: its KV cache holds, at every target position, K/V projected from
the target's *layer inputs* at ``dflash.target_layers`` (fused by ``fc`` + ``enc.output_norm``); a draft is
one non-causal decode of ``[last token, mask × k]`` at the next k + 1 positions, whose logits at block
index i (1..k) are q for draft token i. q_i does not depend on the tokens drafted before i (the block
holds masks there), which is still a valid draft law for rejection sampling, position by position.

The protocol against our loop (as llama.cpp's reference driver): the target context records the layer
inputs (``llama_set_embeddings_layer_inp``, or the backend's cb_eval tap: a callable ``target_ctx``); after each
target decode ``observe`` injects those rows at
their positions (one draft decode of embedding rows, no LM head); ``draft`` decodes the block and drops
its positions; ``rollback`` keeps the draft cache below the target's n_past.

Variants (``variant``): DSpark drafts (a Markov head) with ``dflash.sample_from_anchor`` (the default) read the
first draft from the anchor's own row, so a pass of k tokens ``[last, mask × (k − 1)]`` drafts k (up to
block_size); DFlash2 drafts (a candidate selector) also hand back the selector's lattice. ``block`` wraps a pass
for the drafter: the row of each position given the token drafted before it (``llama_dflash_heads``).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ondevice.backends.llama_dflash_heads import Block, MarkovHead
from ondevice.backends.llama_ext import LlamaHandles, _ptr, init_llama
from ondevice.backends.llama_mtp import ext
from ondevice.errors import OndeviceError


class DFlashGraph(LlamaHandles):
    """A DFlash GGUF beside a target context whose model shares its vocabulary and hidden size.

    Args:
        path: the DFlash .gguf.
        target_model, target_ctx: the target's llama.cpp model and context. ``target_ctx`` may be a callable:
            called with ``layers`` once the draft is checked against the target, it switches the target's
            layer inputs on itself and returns the context (``LlamaBackend.enable_layer_inputs`` may recreate
            it: qwen2's cb_eval tap); a plain context gets llama.cpp's layer-input recording switched on here.
        n_ctx, threads, n_batch: the draft context's (n_ctx: the target's).
        exact: f32 KV cache and no flash attention (conversion checks; llama.cpp rounds K/V to f16 otherwise).
    Attributes:
        block_size: the trained block.
        variant: dflash | dflash2 (conv + selector) | dspark (Markov head).
        max_draft: the most draft tokens one pass gives (block_size − 1; block_size for an anchor-first DSpark).
        layers: target layer ids whose inputs the draft reads.
        vocab_size: the logit row width (the target's vocabulary).
    Raises:
        OndeviceError: not a DFlash GGUF, or one made for another target (layers, vocabulary, hidden size).
    """

    def __init__(self, path: str | Path, target_model, target_ctx, *, n_ctx: int, threads: int | None,
                 n_batch: int = 256, exact: bool = False) -> None:
        import llama_cpp

        from ondevice.formats.gguf import check_gguf_file

        self._lib, self.path = llama_cpp, Path(path)
        self._model = self._ctx = self._batch = None
        check_gguf_file(self.path)
        init_llama()
        mp = llama_cpp.llama_model_default_params()
        mp.n_gpu_layers = 0
        self._model = llama_cpp.llama_model_load_from_file(str(self.path).encode(), mp)
        if not self._model:
            raise OndeviceError(f"{self.path}: llama.cpp could not load this DFlash draft")
        arch = ctypes.create_string_buffer(64)
        llama_cpp.llama_model_meta_val_str(self._model, b"general.architecture", arch, 64)
        if arch.value != b"dflash":
            self.close()
            raise OndeviceError(f"{self.path}: architecture {arch.value.decode()!r} is not a DFlash draft")
        n = int(ext("model_target_layer_ids_n")(self._model))
        ids = ext("model_target_layer_ids")(self._model)
        self.layers = [int(ids[i]) for i in range(n)]
        n_layer_tgt = int(llama_cpp.llama_model_n_layer(target_model))
        self.n_embd_tgt = int(llama_cpp.llama_model_n_embd(target_model))
        self.n_embd = int(llama_cpp.llama_model_n_embd(self._model))
        v_tgt = int(llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(target_model)))
        self._vocab = llama_cpp.llama_model_get_vocab(self._model)
        self.vocab_size = int(llama_cpp.llama_vocab_n_tokens(self._vocab))
        if not self.layers or max(self.layers) >= n_layer_tgt or self.vocab_size != v_tgt \
                or self.n_embd != self.n_embd_tgt:
            self.close()
            raise OndeviceError(f"{self.path}: this DFlash draft was made for another target (layers {self.layers}, "
                                f"vocabulary {self.vocab_size}, hidden {self.n_embd}; the target has {n_layer_tgt} "
                                f"layers, {v_tgt} tokens, hidden {self.n_embd_tgt})")
        buf = ctypes.create_string_buffer(32)
        self.block_size = 16
        if llama_cpp.llama_model_meta_val_str(self._model, b"dflash.block_size", buf, 32) >= 0:
            self.block_size = int(buf.value)
        causal = llama_cpp.llama_model_meta_val_str(self._model, b"dflash.attention.causal", buf, 32) >= 0 \
            and buf.value == b"true"
        anchor = llama_cpp.llama_model_meta_val_str(self._model, b"dflash.sample_from_anchor", buf, 32) < 0 \
            or buf.value == b"true"
        self.top_k = int(ext("model_dflash_selector_top_k")(self._model))
        from ondevice.formats.gguf import GGUFFile

        names = self._or_close(lambda: {t.name for t in GGUFFile(self.path).reader.tensors})
        self.markov = self._or_close(MarkovHead, self.path, self.vocab_size) if "markov_w1.weight" in names else None
        self.variant = "dspark" if self.markov else "dflash2" if self.top_k > 0 else "dflash"
        self._first = 0 if self.markov and anchor else 1  # block row of the first draft
        self.max_draft = self.block_size - self._first
        self.lattice: np.ndarray | None = None  # DFlash2: the selector rows of the last draft
        self.mask_id = int(llama_cpp.llama_vocab_mask(self._vocab))
        if not 0 <= self.mask_id < self.vocab_size:
            self.close()
            raise OndeviceError(f"{self.path}: no mask token (tokenizer.ggml.mask_token_id); re-convert the draft")
        if callable(target_ctx):
            target_ctx = self._or_close(target_ctx, list(self.layers))
        else:
            for lid in self.layers:
                ext("set_embeddings_layer_inp")(target_ctx, lid, True)
        cp = llama_cpp.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = int(n_ctx), int(n_batch), int(n_batch), 1
        if threads:
            cp.n_threads = cp.n_threads_batch = int(threads)
        cp.no_perf = True
        if exact:
            cp.type_k = cp.type_v = llama_cpp.GGML_TYPE_F32
            cp.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        cp.ctx_other = _ptr(target_ctx)  # a draft without its own embeddings / LM head reads the target's
        self._ctx = llama_cpp.llama_init_from_model(self._model, cp)
        if not self._ctx:
            self.close()
            raise OndeviceError(f"{self.path}: llama.cpp could not create the DFlash context")
        llama_cpp.llama_set_causal_attn(self._ctx, causal)  # the block attends both ways unless trained causal
        # the selector's lattice comes back as h_nextn, one row per block token; so do DSpark's confidences (its
        # confidence head, read only by the conversion check: ``exact``)
        self._conf = exact and self.markov is not None and "conf_proj.weight" in names
        if self.top_k > 0 or self._conf:
            ext("set_embeddings_nextn")(self._ctx, True, False)
        self.confidence: np.ndarray | None = None  # DSpark (exact): the confidence of each row of the last draft
        self._tgt = target_ctx
        self.n_batch = int(llama_cpp.llama_n_batch(self._ctx))
        self._batch = llama_cpp.llama_batch_ext_init(self._ctx)
        self._mem = llama_cpp.llama_get_memory(self._ctx)
        self._pos = ctypes.c_int32 * 4

    @property
    def n_past(self) -> int:
        return int(self._lib.llama_memory_seq_pos_max(self._mem, 0)) + 1

    def features(self, n: int) -> np.ndarray:
        """The target's layer-input rows of its last decode of ``n`` tokens, fused per token [n, L × hidden]."""
        cols = []
        for lid in self.layers:
            ptr = ext("get_embeddings_layer_inp")(self._tgt, lid)
            if not ptr:
                raise OndeviceError(f"the target recorded no input of layer {lid} (its graph may not record layer inputs)")
            cols.append(np.ctypeslib.as_array(ptr, shape=(n, self.n_embd_tgt)))
        return np.concatenate(cols, axis=1).astype(np.float32)

    def observe(self, feats: np.ndarray, pos0: int) -> None:
        """Inject the fused target features of positions pos0.. into the draft's cache (drops pos0.. first)."""
        lib, b = self._lib, self._batch
        if pos0 > self.n_past:
            raise OndeviceError(f"{self.path.name}: DFlash cache holds {self.n_past} positions, cannot inject at {pos0}")
        self._lib.llama_memory_seq_rm(self._mem, 0, pos0, -1)
        feats = np.ascontiguousarray(feats, dtype=np.float32)
        fp = ctypes.POINTER(ctypes.c_float)
        for s in range(0, len(feats), self.n_batch):
            lib.llama_batch_ext_clear(b)
            for i, row in enumerate(feats[s : s + self.n_batch]):
                p = pos0 + s + i
                idx = lib.llama_batch_ext_add_embd(b, 0, lib.llama_embd(row.ctypes.data_as(fp), 1, row.shape[0]))
                if idx < 0:
                    raise OndeviceError(f"{self.path.name}: DFlash batch rejected a feature row (code {idx})")
                lib.llama_batch_ext_set_pos(b, idx, self._pos(p, p, p, 0))
            rc = lib.llama_process(self._ctx, lib.LLAMA_PROCESS_TYPE_DECODE, b)
            if rc != 0:
                raise OndeviceError(f"{self.path.name}: DFlash injection failed (code {rc}) at position {pos0 + s}")

    def draft(self, token: int, k: int) -> np.ndarray:
        """Logits [k, vocab] of the block after ``token`` (the target's next token, at position n_past):
        row i is the graph's row for the draft token at n_past + 1 + i (DSpark: conditioned on the argmax of row
        i − 1; ``block`` conditions on the token drafted). DFlash2 leaves the selector's rows of the same
        positions in ``lattice`` [k, n_embd]. The draft cache is left as before."""
        if not 1 <= k <= self.max_draft:
            raise OndeviceError(f"{self.path.name}: a {self.variant} block drafts 1..{self.max_draft} tokens, not {k}")
        lib, b, pos0, first = self._lib, self._batch, self.n_past, self._first
        lib.llama_batch_ext_clear(b)
        for i, t in enumerate([token] + [self.mask_id] * (k + first - 1)):
            idx = lib.llama_batch_ext_add_token(b, 0, int(t))
            lib.llama_batch_ext_set_pos(b, idx, self._pos(pos0 + i, 0, 0, 0))
            # every row out, as llama.cpp's driver does: the dflash graph selects no output rows, so the context
            # copies the first n_outputs rows whatever the flags say (rows 1..k alone came back as rows 0..k-1)
            lib.llama_batch_ext_set_output_logits(b, idx, True)
        try:
            rc = lib.llama_process(self._ctx, lib.LLAMA_PROCESS_TYPE_DECODE, b)
            if rc != 0:
                raise OndeviceError(f"{self.path.name}: DFlash draft failed (code {rc}) at position {pos0}")
            rows = range(first, first + k)
            if self.top_k > 0 or self._conf:
                get = ext("get_embeddings_nextn_ith")
                nextn = np.stack([np.ctypeslib.as_array(get(self._ctx, i), shape=(self.n_embd,)) for i in rows]).copy()
                self.lattice, self.confidence = (nextn, None) if self.top_k > 0 else (None, nextn[:, 0])
            return np.stack([np.ctypeslib.as_array(lib.llama_get_logits_ith(self._ctx, i), shape=(self.vocab_size,))
                             for i in rows]).copy()
        finally:
            lib.llama_memory_seq_rm(self._mem, 0, pos0, -1)

    def block(self, token: int, k: int) -> Block:
        """``draft`` as a ``Block``: the row of each draft position given the token drafted before it."""
        logits = self.draft(token, k)
        return Block(token, logits, self.markov, self.lattice if self.top_k > 0 else None, self.top_k)

    def rollback(self, n_past: int) -> None:
        """Drop the draft's cache from position ``n_past`` on."""
        if not self._lib.llama_memory_seq_rm(self._mem, 0, n_past, -1):
            raise OndeviceError(f"{self.path.name}: DFlash cache cannot roll back to position {n_past}")


DFlashDrafter = DFlashGraph  # the name scripts/bench_dflash.py imports


def observe_target(drafter: DFlashGraph, tokens: Sequence[int], pos0: int) -> None:
    """After the target decoded ``tokens`` at pos0.. (in one llama_decode): inject their features."""
    drafter.observe(drafter.features(len(tokens)), pos0)
