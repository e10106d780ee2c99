"""A target's own MTP (NextN) head, run through llama.cpp's graph (``LLAMA_CONTEXT_TYPE_MTP``).

Models such as Qwen3.5 / 3.6 and GLM-4.5+ store, after their trunk blocks, ``nextn_predict_layers`` extra
blocks trained to predict one token further. llama.cpp loads them with ``llama_model_params.load_mtp`` and
runs them in a second context of type MTP on the same model: its input at position p is the token x_p and
the target's final-norm hidden state h_{p-1} (``h_nextn``), its output the logits of x_{p+1} and its own
``h_nextn``, which feeds the next step of a chain (deeper than the model's trained depth).

The protocol (llama.cpp's reference driver's, written against our loop; docs/mtp.md):
- the target context outputs ``h_nextn`` for every token it decodes (``llama_set_embeddings_nextn(ctx, True,
  masked=False)``); after each target decode the caller passes those rows to ``MtpHead.observe``, which
  writes the pairs (x_p, h_{p-1}) into the MTP context's own KV cache (one MTP pass, no LM head);
- ``MtpHead.draft`` chains from the bonus token at position n_past: the head's logits pick each next
  token (the caller's ``choose``), and its KV entries for the drafted positions are dropped afterwards (the
  verify pass's ``observe`` writes the true pairs);
- after acceptance ``MtpHead.rollback(n_past)`` keeps the MTP cache below n_past and takes h_{n_past-1} from
  the rows last observed.

The C++-linkage functions of ``llama-ext.h`` are bound from the loaded libllama by their mangled names
(``ext``); a build without them is refused in one line. ``llama_mtp_target.MtpTarget`` is a minimal target
for tests and benches; ``LlamaBackend`` needs the same: ``load_mtp``, the nextn rows after each decode, ``n_rs_seq`` for
hybrid (recurrent) trunks.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from ondevice.backends.llama_ext import LlamaHandles
from ondevice.errors import OndeviceError

# (plain name, Itanium mangled name, MSVC mangled name), argtypes, restype — from llama-ext.h.
_EXT = {
    "set_embeddings_nextn": (("llama_set_embeddings_nextn", "_Z26llama_set_embeddings_nextnP13llama_contextbb",
                              "?llama_set_embeddings_nextn@@YAXPEAUllama_context@@_N1@Z"),
                             [ctypes.c_void_p, ctypes.c_bool, ctypes.c_bool], None),
    "get_embeddings_nextn_ith": (("llama_get_embeddings_nextn_ith", "_Z30llama_get_embeddings_nextn_ithP13llama_contexti",
                                  "?llama_get_embeddings_nextn_ith@@YAPEAMPEAUllama_context@@H@Z"),
                                 [ctypes.c_void_p, ctypes.c_int32], ctypes.POINTER(ctypes.c_float)),
    "set_nextn_layer_offset": (("llama_set_nextn_layer_offset", "_Z28llama_set_nextn_layer_offsetP13llama_contexti",
                                "?llama_set_nextn_layer_offset@@YAXPEAUllama_context@@H@Z"),
                               [ctypes.c_void_p, ctypes.c_int32], None),
    "set_embeddings_layer_inp": (("llama_set_embeddings_layer_inp", "_Z30llama_set_embeddings_layer_inpP13llama_contextjb",
                                  "?llama_set_embeddings_layer_inp@@YAXPEAUllama_context@@I_N@Z"),
                                 [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_bool], None),
    "get_embeddings_layer_inp": (("llama_get_embeddings_layer_inp", "_Z30llama_get_embeddings_layer_inpP13llama_contextj",
                                  "?llama_get_embeddings_layer_inp@@YAPEAMPEAUllama_context@@I@Z"),
                                 [ctypes.c_void_p, ctypes.c_uint32], ctypes.POINTER(ctypes.c_float)),
    "model_target_layer_ids": (("llama_model_target_layer_ids", "_Z28llama_model_target_layer_idsPK11llama_model",
                                "?llama_model_target_layer_ids@@YAPEBHPEBUllama_model@@@Z"),
                               [ctypes.c_void_p], ctypes.POINTER(ctypes.c_int32)),
    "model_dflash_selector_top_k": (("llama_model_dflash_selector_top_k",
                                     "_Z33llama_model_dflash_selector_top_kPK11llama_model",
                                     "?llama_model_dflash_selector_top_k@@YAHPEBUllama_model@@@Z"),
                                    [ctypes.c_void_p], ctypes.c_int32),
    "model_target_layer_ids_n": (("llama_model_target_layer_ids_n", "_Z30llama_model_target_layer_ids_nPK11llama_model",
                                  "?llama_model_target_layer_ids_n@@YAIPEBUllama_model@@@Z"),
                                 [ctypes.c_void_p], ctypes.c_uint32),
}
_BOUND: dict[str, object] = {}


def ext(name: str):
    """The C++-linkage function ``name`` of libllama, bound once; a one-line error when this build lacks it."""
    if name not in _BOUND:
        import llama_cpp

        symbols, argtypes, restype = _EXT[name]
        for sym in symbols:
            fn = getattr(llama_cpp.llama_cpp._lib, sym, None)
            if fn is not None:
                fn.argtypes, fn.restype = argtypes, restype
                _BOUND[name] = fn
                break
        else:
            raise OndeviceError(f"this llama.cpp build has no llama_{name} (llama-ext.h); MTP heads need "
                                "llama-cpp-python 0.3.36 or newer")
    return _BOUND[name]


# GGUF architectures whose graphs in llama-cpp-python 0.3.36 have an MTP head (LLM_GRAPH_TYPE_DECODER_MTP).
# glm4 (dense) and exaone4 load NextN tensors but never run them; gemma4 drafts with a separate
# gemma4-assistant model sharing the target's KV cache (another protocol, not this one).
MTP_GRAPH_ARCHS = frozenset({"qwen35", "qwen35moe", "qwen3next", "glm4moe", "glm-dsa", "glm5-next", "deepseek2",
                             "deepseek32", "deepseek4", "mimo2", "step35", "hy_v3", "bailingmoe3", "cohere2moe",
                             "nemotron_h_moe"})


def file_mtp_layers(path: str | Path, *, strict: bool = False) -> int:
    """MTP blocks of a GGUF file that this llama.cpp can run, from its header alone (no load).

    Args:
        path: the .gguf file.
        strict: raise (one line naming the architecture) where the file has none usable, instead of 0.
    Returns:
        ``{arch}.nextn_predict_layers`` when the architecture has an MTP graph here, else 0.
    """
    from ondevice.formats.gguf import read_header

    meta, _ = read_header(path)
    arch = str(meta.get("general.architecture", "?"))
    n = int(meta.get(f"{arch}.nextn_predict_layers", 0) or 0)
    usable = n if arch in MTP_GRAPH_ARCHS else 0
    if strict and not usable:
        why = "carries no MTP (nextn) layers" if n == 0 else f"has {n} MTP layers but llama.cpp has no MTP graph for {arch!r}"
        raise OndeviceError(f"{Path(path).name}: {why}; draft with another drafter")
    return usable


def n_layer_nextn(model) -> int:
    """MTP (NextN) blocks of a loaded llama.cpp model (0: none)."""
    import llama_cpp

    return int(llama_cpp.llama_model_n_layer_nextn(model))


def nextn_rows(ctx, n: int, n_embd: int) -> np.ndarray:
    """The target's ``h_nextn`` rows of every token of its last decode (a copy, [n, n_embd] float32).

    ``ctx`` must output them unmasked (``enable_nextn``): llama.cpp stores one row per token of the batch.
    """
    ptr = ext("get_embeddings_nextn_ith")(ctx, 0)
    if not ptr:
        raise OndeviceError("the target context has no nextn rows; call enable_nextn(ctx) before decoding")
    return np.ctypeslib.as_array(ptr, shape=(n, n_embd)).copy()


def enable_nextn(ctx) -> None:
    """Make a target context output ``h_nextn`` for every token it decodes (read with ``nextn_rows``)."""
    ext("set_embeddings_nextn")(ctx, True, False)


class MtpHead(LlamaHandles):
    """The MTP head of a model loaded with ``load_mtp``, in its own MTP context beside the target's.

    Args:
        model: the llama.cpp model (``llama_model_load_from_file`` with ``params.load_mtp = True``).
        n_ctx: context length (the target's).
        threads: CPU threads.
        n_batch: most pairs per MTP decode.
        name: the model's name for error messages.
    Attributes:
        depth: trained MTP blocks (chains deeper than this reuse the first block on its own output).
        n_embd, vocab_size: row widths of ``observe``'s h and of the logits.
    """

    def __init__(self, model, *, n_ctx: int, threads: int, n_batch: int = 512, name: str = "model") -> None:
        import llama_cpp

        self._lib, self.name = llama_cpp, name
        self._ctx = self._batch = None
        self.depth = n_layer_nextn(model)
        if self.depth <= 0:
            raise OndeviceError(f"{name}: this model has no MTP (nextn) layers; use another --draft")
        cp = llama_cpp.llama_context_default_params()
        cp.ctx_type = llama_cpp.LLAMA_CONTEXT_TYPE_MTP
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = int(n_ctx), int(n_batch), int(n_batch), 1
        cp.n_threads = cp.n_threads_batch = int(threads)
        cp.no_perf = True
        self._ctx = llama_cpp.llama_init_from_model(model, cp)
        if not self._ctx:
            raise OndeviceError(f"{name}: llama.cpp could not create the MTP context (MTP layers not loaded? "
                                "load the model with load_mtp)")
        ext("set_embeddings_nextn")(self._ctx, True, True)  # h_nextn of the output rows: a chain's next input
        self.n_batch = int(llama_cpp.llama_n_batch(self._ctx))
        self._batch = llama_cpp.llama_batch_ext_init(self._ctx)
        self._mem = llama_cpp.llama_get_memory(self._ctx)
        self.n_embd = int(llama_cpp.llama_model_n_embd_out(model))
        self.vocab_size = int(llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model)))
        self._pending = np.zeros(self.n_embd, np.float32)  # the target's h row of position _pending_pos
        self._pending_pos = -1
        self._rows: tuple[int, np.ndarray] | None = None  # (position of row 0, h rows) of the last observe
        self._pos = ctypes.c_int32 * 4  # llama_pos[4]: M-RoPE models read four, text tokens use the first

    # -- cache ----------------------------------------------------------------------------------
    @property
    def n_past(self) -> int:
        """Positions in the MTP cache (the target's n_past once every decoded token was observed)."""
        return int(self._lib.llama_memory_seq_pos_max(self._mem, 0)) + 1

    @property
    def rows(self) -> tuple[int, np.ndarray]:
        """(position of the first row, the target's h rows) passed to the last ``observe``."""
        if self._rows is None:
            raise OndeviceError(f"{self.name}: the MTP head has observed no target decode yet")
        return self._rows

    def _decode(self, tokens: Sequence[int], h: np.ndarray, pos0: int, outputs: bool) -> None:
        lib, b = self._lib, self._batch
        lib.llama_batch_ext_clear(b)
        h = np.ascontiguousarray(h, dtype=np.float32)
        fp = ctypes.POINTER(ctypes.c_float)
        for i, t in enumerate(tokens):
            idx = lib.llama_batch_ext_add_token(b, 0, int(t))
            if idx < 0:
                raise OndeviceError(f"{self.name}: MTP batch rejected token {t} (code {idx})")
            lib.llama_batch_ext_set_pos(b, idx, self._pos(pos0 + i, 0, 0, 0))
            row = lib.llama_embd(h[i].ctypes.data_as(fp), 1, self.n_embd)
            if not lib.llama_batch_ext_set_embd_token(b, idx, row):
                raise OndeviceError(f"{self.name}: MTP batch rejected a hidden row of width {h.shape[-1]}")
            if outputs:
                lib.llama_batch_ext_set_output_logits(b, idx, True)
        rc = lib.llama_process(self._ctx, lib.LLAMA_PROCESS_TYPE_DECODE, b)
        if rc != 0:
            raise OndeviceError(f"{self.name}: MTP decode failed (code {rc}) at position {pos0}")

    def _h_before(self, pos: int) -> np.ndarray:
        """h_{pos-1}: the target row paired with the token at ``pos`` (zeros at position 0)."""
        if pos == 0:
            return np.zeros(self.n_embd, np.float32)
        if pos - 1 == self._pending_pos:
            return self._pending
        if self._rows is not None and 0 <= pos - 1 - self._rows[0] < len(self._rows[1]):
            return self._rows[1][pos - 1 - self._rows[0]]
        last = "none" if self._rows is None else f"{self._rows[0]}..{self._rows[0] + len(self._rows[1]) - 1}"
        raise OndeviceError(f"{self.name}: the MTP head has no target row for position {pos - 1} "
                            f"(last observed rows: {last}); observe every target decode")

    def observe(self, tokens: Sequence[int], h: np.ndarray, pos0: int) -> None:
        """Record a target decode: ``tokens`` at positions pos0.., ``h`` their target ``h_nextn`` rows.

        Writes the pairs (x_p, h_{p-1}) into the MTP cache (the first token pairs with the target row of
        pos0 - 1, kept from an earlier observe); anything the cache held from pos0 on is dropped first.
        """
        if not len(tokens):
            return
        h = np.asarray(h, dtype=np.float32).reshape(len(tokens), self.n_embd)
        if pos0 > self.n_past:
            raise OndeviceError(f"{self.name}: MTP cache holds {self.n_past} positions, cannot observe from {pos0}")
        prev = np.concatenate([self._h_before(pos0)[None], h[:-1]])
        self._lib.llama_memory_seq_rm(self._mem, 0, pos0, -1)
        for s in range(0, len(tokens), self.n_batch):
            self._decode(tokens[s : s + self.n_batch], prev[s : s + self.n_batch], pos0 + s, outputs=False)
        self._pending, self._pending_pos = h[-1].copy(), pos0 + len(tokens) - 1
        self._rows = (pos0, h)

    def rollback(self, n_past: int, h: np.ndarray | None = None) -> None:
        """Keep positions below ``n_past`` (the target's, after acceptance); h_{n_past-1} is ``h`` (the target's row
        of position n_past − 1, kept by a host that keeps them all) or else taken from the last observe."""
        if n_past > self.n_past or n_past < 0:
            raise OndeviceError(f"{self.name}: cannot roll the MTP cache back to {n_past}: it holds {self.n_past}")
        if n_past == 0:
            self._lib.llama_memory_clear(self._mem, False)
            self._pending, self._pending_pos, self._rows = np.zeros(self.n_embd, np.float32), -1, None
            return
        h = self._h_before(n_past).copy() if h is None else np.asarray(h, np.float32).reshape(self.n_embd).copy()
        if not self._lib.llama_memory_seq_rm(self._mem, 0, n_past, -1):
            raise OndeviceError(f"{self.name}: MTP cache cannot roll back to position {n_past}")
        self._pending, self._pending_pos = h, n_past - 1

    # -- drafting -------------------------------------------------------------------------------
    def step(self, token: int, h: np.ndarray, pos: int) -> tuple[np.ndarray, np.ndarray]:
        """One MTP pass: the pair (token, h) at ``pos``; returns (logits [vocab] of position pos + 1, the
        head's ``h_nextn`` [n_embd], the ``h`` of a chained next step). Leaves the pair in the cache."""
        self._decode([token], h[None], pos, outputs=True)
        lib = self._lib
        logits = np.ctypeslib.as_array(lib.llama_get_logits_ith(self._ctx, 0), shape=(self.vocab_size,)).copy()
        h_out = np.ctypeslib.as_array(ext("get_embeddings_nextn_ith")(self._ctx, 0), shape=(self.n_embd,)).copy()
        return logits, h_out

    def draft(self, token: int, k: int, choose: Callable[[np.ndarray, int], int]) -> tuple[list[int], np.ndarray]:
        """Chain ``k`` tokens after ``token`` (the next token of the target, at position ``n_past``).

        Args:
            token: the token the target produced last (not yet decoded by it).
            k: tokens to draft (any depth: after the trained blocks, the first block reads its own output).
            choose: ``choose(logits, depth) -> token`` picks each drafted token from the head's raw logits
                (greedy argmax, or a sample of the caller's processed q).
        Returns:
            (drafted tokens [k], raw logits [k, vocab] of each depth). The MTP cache is left as before.
        """
        pos0 = self.n_past
        h, out, logits = self._h_before(pos0), [], np.empty((k, self.vocab_size), np.float32)
        try:
            for d in range(k):
                logits[d], h = self.step(token, h, pos0 + d)
                token = int(choose(logits[d], d))
                out.append(token)
        finally:
            self._lib.llama_memory_seq_rm(self._mem, 0, pos0, -1)
        return out, logits
