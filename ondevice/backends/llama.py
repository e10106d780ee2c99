"""llama.cpp backend on llama-cpp-python's low-level API.

Only the logits rows a caller asks for are copied (never ``logits_all``, which allocates n_ctx × V
floats). Rollback uses ``llama_memory_seq_rm``; sliding-window models get a full-size SWA cache so
that rollback stays exact, and every rollback is checked against the positions the cache holds.

Nothing about the cache is remembered on the Python side: the position count is read from llama.cpp
(``llama_memory_seq_pos_max``) every time, so a Ctrl-C between a ``llama_decode`` and the next line
cannot make the two disagree. Context length and batch size are read back from the context too
(llama.cpp rounds the one and caps the other).

Optional hidden states (``enable_hidden``): the same decode also returns the post-norm hidden state
(llama.cpp's ``result_norm``, the LM head's input) of every output row, read with
``llama_get_embeddings`` (pooling none); ``hidden(pos)`` gives the row of the last ``eval`` at an
absolute position. Heads drafters read it (``ondevice.heads``), so drafting needs no extra target pass.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

import numpy as np

from ondevice.backends import llama_ext
from ondevice.backends.base import Backend, check_room
from ondevice.backends.llama_ext import init_llama  # re-exported: other modules import it from here
from ondevice.backends.llama_features import MTP_RS_SEQ, LlamaFeatures
from ondevice.backends.llama_mtp import file_mtp_layers
from ondevice.backends.llama_state import LlamaState
from ondevice.backends.llama_tree import TREE_SEQS, LlamaTree
from ondevice.errors import OndeviceError
from ondevice.formats.gguf import check_gguf_file
from ondevice.threads import default_threads

# KV-cache element types (``-ctk/-ctv``): name → llama_cpp's GGML type constant. A quantized V cache needs flash
# attention (llama.cpp refuses it otherwise), so the backend switches it on for one.
KV_CACHE_TYPES = {"f16": "GGML_TYPE_F16", "q8_0": "GGML_TYPE_Q8_0", "q4_0": "GGML_TYPE_Q4_0"}


def check_cache_type(name: str, value) -> str:
    """``value`` if it names a KV-cache type, else a one-line ``OndeviceError`` naming ``name`` and the choices."""
    if not isinstance(value, str) or value.lower() not in KV_CACHE_TYPES:
        raise OndeviceError(f"{name}={value!r}: choose a KV-cache type among {', '.join(KV_CACHE_TYPES)}")
    return value.lower()


@contextmanager
def _ctrl_c_deferred():
    """Hold Ctrl-C while llama.cpp calls back into Python (its log callback, during model load and context
    creation), then deliver it to the previous handler. Raised inside a ctypes callback, KeyboardInterrupt is
    printed as "Exception ignored" and dropped: the load went on and the command answered (exit 0)."""
    import signal
    import threading

    previous = signal.getsignal(signal.SIGINT) if threading.current_thread() is threading.main_thread() else None
    if previous is None:  # not the main thread, or a handler installed from C: leave signals alone
        yield
        return
    hit: list[int] = []
    signal.signal(signal.SIGINT, lambda *_: hit.append(1))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if hit:
            signal.raise_signal(signal.SIGINT)


class LlamaBackend(LlamaFeatures, LlamaTree, LlamaState, Backend):  # features wrap LlamaTree's tree pass
    """A GGUF model and its KV cache in llama.cpp (see ``ondevice.backends.Backend``).

    Args:
        path: the .gguf file.
        n_ctx: context length of the KV cache.
        threads: CPU threads for decode and batches (default: ``ondevice.threads.default_threads``, the
            physical cores other processes leave free when the model loads).
        n_batch: most tokens per llama_decode call.
        mmap, mlock: how the weights are loaded.
        device: 'cpu' keeps every layer on the CPU; 'gpu' offloads all; None is llama.cpp's default.
            ``self.device`` says where the layers really run ('gpu' only when this llama.cpp build can
            offload), e.g. for keying measured costs.
        n_seq_max: sequence ids of the context (tree leaves; answers generated together by ``eval_seqs``).
        kv_unified: one KV buffer for every sequence (trees need it). False gives each sequence its own
            ``n_ctx_seq = n_ctx / n_seq_max`` cells, laid out as a one-sequence context lays them out, so
            answers generated together (``eval_seqs``) are bit for bit the ones generated alone; with one
            buffer their cells interleave and llama.cpp's attention rounds differently (greedy answers flip).
        cache_type_k, cache_type_v: element type of the K and V cache, one of ``KV_CACHE_TYPES`` (f16, q8_0,
            q4_0). A quantized V cache runs with flash attention on (llama.cpp requires it). Every pass reads
            the cache it wrote, so verify and rollback stay exact for the cache they run on.
    """

    # post-norm hidden states (``enable_hidden``: heads); layer inputs (``enable_layer_inputs``: EAGLE-3)
    features = frozenset({"hidden", "layer_inputs", "nextn"})  # nextn: the model's own MTP head (``enable_nextn``)

    def __init__(
        self,
        path: str | Path,
        *,
        n_ctx: int = 4096,
        threads: int | None = None,
        n_batch: int = 512,
        mmap: bool = True,
        mlock: bool = False,
        device: str | None = None,
        debug: bool = False,
        n_seq_max: int = TREE_SEQS,
        kv_unified: bool = True,
        cache_type_k: str = "f16",
        cache_type_v: str = "f16",
    ) -> None:
        import llama_cpp

        self._lib = llama_cpp
        self.path = Path(path)
        self.cache_type_k = check_cache_type("cache_type_k", cache_type_k)
        self.cache_type_v = check_cache_type("cache_type_v", cache_type_v)
        check_gguf_file(self.path)
        self._model = self._ctx = self._batch = None  # close() (and __del__) free whatever a Ctrl-C left
        init_llama(debug or bool(os.environ.get("ONDEVICE_DEBUG")))
        mp = llama_cpp.llama_model_default_params()
        mp.load_mode = {
            (True, False): llama_cpp.LLAMA_LOAD_MODE_MMAP,
            (True, True): llama_cpp.LLAMA_LOAD_MODE_MMAP_MLOCK,
            (False, True): llama_cpp.LLAMA_LOAD_MODE_MLOCK,
            (False, False): llama_cpp.LLAMA_LOAD_MODE_NONE,
        }[(mmap, mlock)]
        if device == "cpu":
            mp.n_gpu_layers = 0
        elif device == "gpu":
            mp.n_gpu_layers = 999  # all layers on Metal/CUDA when llama.cpp was built with it
        try:  # a model's own MTP heads: loaded (mmap: untouched until used)
            self.n_mtp = file_mtp_layers(self.path)
        except OndeviceError:
            self.n_mtp = 0  # a header we cannot read: llama.cpp's load below says what is wrong
        mp.load_mtp = self.n_mtp > 0
        self.device = "gpu" if mp.n_gpu_layers != 0 and llama_cpp.llama_supports_gpu_offload() else "cpu"
        build = hashlib.sha256(llama_cpp.llama_print_system_info()).hexdigest()[:8]
        self.kernels = f"llama.cpp {llama_cpp.__version__} {build} {'repack' if mp.use_extra_bufts else 'plain'}"
        with _ctrl_c_deferred():
            self._model = llama_cpp.llama_model_load_from_file(str(self.path).encode(), mp)
        if not self._model:
            raise OndeviceError(f"{self.path}: llama.cpp could not load this GGUF (corrupt, truncated or unsupported); re-download or reconvert it")
        self._vocab = llama_cpp.llama_model_get_vocab(self._model)
        self.vocab_size = int(llama_cpp.llama_vocab_n_tokens(self._vocab))
        self.n_swa = int(llama_cpp.llama_model_n_swa(self._model))
        # a recurrent state (qwen35's gated delta net) reports only its last position: rollbacks restore snapshots
        self._recurrent = bool(llama_cpp.llama_model_is_recurrent(self._model) or llama_cpp.llama_model_is_hybrid(self._model))
        self.threads = int(threads or default_threads())
        self.n_batch, self.n_ctx, self.n_seq_max, self.kv_unified = int(n_batch), int(n_ctx), int(n_seq_max), bool(kv_unified)
        self._n_rs = MTP_RS_SEQ if self.n_mtp else 0  # a hybrid (recurrent) trunk rolls back a verify pass from
        self._last_decode: tuple[int, int] | None = None  # its snapshots (positions into its last decode)
        self._open_context()
        self._batch = llama_cpp.llama_batch_init(self.n_batch, 0, 1)
        self._tree_batch = None  # allocated by the first eval_tree (a token may carry n_seq_max ids)
        self._tree_hidden: np.ndarray | None = None  # every node's hidden state of the last eval_tree
        self._tree: tuple[int, list[int], list[int]] | None = None  # (base, parents, each node's first sequence id)
        self.add_bos = bool(llama_cpp.llama_vocab_get_add_bos(self._vocab))
        bos = int(llama_cpp.llama_vocab_bos(self._vocab))
        self.bos_id = bos if bos >= 0 else None
        tmpl = llama_cpp.llama_model_chat_template(self._model, None)
        self.chat_template = tmpl.decode("utf-8") if tmpl else None
        self._pieces: dict[int, bytes] = {}
        self._buf = ctypes.create_string_buffer(256)
        self._hidden_on = False  # evals keep hidden rows now (enable_hidden, then want_hidden)
        self._hidden_ok = False  # enable_hidden() was called
        self._emb = False  # llama.cpp's embeddings flag right now
        self._hidden: tuple[int, np.ndarray] | None = None  # (first position, rows) of the last eval

    def _open_context(self, cb_eval=None) -> None:
        """Create the llama_context (``_ctx``, ``_mem``) from the settings on ``self``; ``cb_eval``: a scheduler
        callback (``llama_ext.EvalTap``) llama.cpp then calls on every node of every graph (none: no cost)."""
        lib = self._lib
        cp = lib.llama_context_default_params()
        cp.n_ctx = self.n_ctx
        cp.n_batch = cp.n_ubatch = self.n_batch
        # Sequence ids for tree verification (``eval_tree``): one per leaf, all in one unified KV buffer
        # (kv_unified=False splits n_ctx between the sequences: the batched recorder's layout, no trees).
        # Chains use sequence 0 only.
        cp.n_seq_max = self.n_seq_max
        cp.kv_unified = self.kv_unified
        cp.n_threads = cp.n_threads_batch = self.threads
        cp.no_perf = True
        # A full-size SWA cache keeps every position, so rolling back across the window is exact.
        cp.swa_full = self.n_swa > 0
        cp.n_rs_seq = self._n_rs
        cp.type_k = getattr(lib, KV_CACHE_TYPES[self.cache_type_k])
        cp.type_v = getattr(lib, KV_CACHE_TYPES[self.cache_type_v])
        if self.cache_type_v != "f16":  # llama.cpp refuses a quantized V cache without flash attention
            cp.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_ENABLED
        if cb_eval is not None:
            cp.cb_eval, cp.cb_eval_user_data = cb_eval, None
        with _ctrl_c_deferred():
            self._ctx = lib.llama_init_from_model(self._model, cp)
        if not self._ctx:
            self.close()
            if (self.cache_type_k, self.cache_type_v) != ("f16", "f16"):
                raise OndeviceError(
                    f"{self.path}: llama.cpp could not create a context with cache_type_k={self.cache_type_k} "
                    f"cache_type_v={self.cache_type_v} (a quantized cache needs head sizes divisible by 32 and flash "
                    "attention on this device); use f16")
            raise OndeviceError(f"{self.path}: llama.cpp could not create a context of n_ctx={self.n_ctx}; try a smaller --n-ctx")
        # What the context really got: llama.cpp rounds n_ctx up (to 256) and caps n_batch at the n_ctx
        # asked for; one llama_decode takes at most n_batch tokens (GGML_ASSERT otherwise).
        self.n_ctx = int(lib.llama_n_ctx(self._ctx))
        self.n_batch = max(1, min(int(lib.llama_n_batch(self._ctx)), self.n_batch))
        self._mem = lib.llama_get_memory(self._ctx)
        self.n_seq_max = int(lib.llama_n_seq_max(self._ctx))
        self.n_ctx_seq = int(lib.llama_n_ctx_seq(self._ctx))  # cells one sequence may hold

    def _check_open(self) -> None:
        if not self._ctx:
            raise OndeviceError(f"{self.path.name}: this model was closed; load it again")

    # -- vocabulary ------------------------------------------------------------------------------
    def is_eog(self, token: int) -> bool:
        self._check_open()
        return bool(self._lib.llama_vocab_is_eog(self._vocab, int(token)))

    def tokenize(self, text: str, *, add_bos: bool = True, special: bool = True) -> list[int]:
        self._check_open()
        data = text.encode("utf-8")
        n_max = len(data) + 8
        arr = (self._lib.llama_token * n_max)()
        n = self._lib.llama_tokenize(self._vocab, data, len(data), arr, n_max, False, special)
        if n < 0:
            n_max = -n
            arr = (self._lib.llama_token * n_max)()
            n = self._lib.llama_tokenize(self._vocab, data, len(data), arr, n_max, False, special)
        ids = list(arr[:n])
        if add_bos and self.add_bos and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        return ids

    def token_bytes(self, token: int) -> bytes:
        piece = self._pieces.get(token)
        if piece is None:
            self._check_open()
            n = self._lib.llama_token_to_piece(self._vocab, int(token), self._buf, len(self._buf), 0, False)
            piece = self._buf.raw[: max(n, 0)]
            self._pieces[token] = piece
        return piece

    def vocab_tokens(self) -> list[str]:
        self._check_open()
        get = self._lib.llama_vocab_get_text
        return [(get(self._vocab, i) or b"").decode("utf-8", "replace") for i in range(self.vocab_size)]

    # -- cache -----------------------------------------------------------------------------------
    @property
    def n_past(self) -> int:
        """Positions in the cache, as llama.cpp reports them (never a Python-side counter)."""
        self._check_open()
        return int(self._lib.llama_memory_seq_pos_max(self._mem, 0)) + 1

    def eval(self, tokens: Sequence[int], logits: Literal["all", "last"] = "all") -> np.ndarray:
        if not self._hidden_on or logits == "all" or len(tokens) < 2:
            return self._eval(tokens, logits)
        self._set_emb(False)  # "last" with hidden states on: the prefix without embeddings, then the last token
        try:
            self._eval(tokens[:-1], "last")
        finally:
            self._set_emb(True)
        return self._eval(tokens[-1:], "all")

    def _eval(self, tokens: Sequence[int], logits: Literal["all", "last"] = "all") -> np.ndarray:
        n = len(tokens)
        n_past = self.n_past
        check_room(n_past, n, self.n_ctx, self.path)
        lib, b = self._lib, self._batch
        rows, hid, pos0 = [], [], n_past
        self._hidden = None
        for start in range(0, n, self.n_batch):
            chunk = tokens[start : start + self.n_batch]
            last_chunk = start + self.n_batch >= n
            m = len(chunk)
            for i, t in enumerate(chunk):
                b.token[i] = int(t)
                b.pos[i] = n_past + i
                b.n_seq_id[i] = 1
                b.seq_id[i][0] = 0
                b.logits[i] = logits == "all" or (last_chunk and i == m - 1)
            b.n_tokens = m
            rc = lib.llama_decode(self._ctx, b)
            if rc != 0:
                raise OndeviceError(f"{self.path.name}: llama_decode failed (code {rc}) at position {n_past}")
            self._last_decode = (n_past, n_past + m)  # (first position, end): a recurrent state rolls back inside it
            self._read_features(n_past, chunk)  # per chunk: llama.cpp keeps the last decode's layer inputs only
            n_past += m
            n_out = m if logits == "all" else int(last_chunk)
            if n_out:
                ptr = lib.llama_get_logits(self._ctx)
                rows.append(np.ctypeslib.as_array(ptr, shape=(n_out, self.vocab_size)).copy())
            if self._emb:  # llama.cpp output every row of this chunk
                ptr = lib.llama_get_embeddings(self._ctx)
                hid.append(np.ctypeslib.as_array(ptr, shape=(m, self.n_embd)).copy())
        if hid:
            self._hidden = (pos0, hid[0] if len(hid) == 1 else np.concatenate(hid))
        return rows[0] if len(rows) == 1 else np.concatenate(rows)

    def rollback(self, n_past: int) -> None:
        self._rollback_trunk(n_past)
        self._trim_features(n_past)  # after the trunk's: a refused rollback leaves the features as they were

    def _rollback_trunk(self, n_past: int) -> None:
        self._drop_unkept_tree()  # Ctrl-C between eval_tree and the end of keep_path: back to the context alone
        cur = self.n_past
        if n_past > cur or n_past < 0:
            raise ValueError(f"cannot roll back to {n_past}: cache holds {cur} positions")
        if n_past == 0:
            self._lib.llama_memory_clear(self._mem, False)  # always possible, whatever the cache holds
            return
        if n_past == cur:
            return
        self._check_recurrent_rollback(n_past, cur)
        if not self._lib.llama_memory_seq_rm(self._mem, 0, n_past, -1):
            raise OndeviceError(f"{self.path.name}: this model's cache cannot roll back to position {n_past}")
        pos_min = self._lib.llama_memory_seq_pos_min(self._mem, 0)
        pos_max = self._lib.llama_memory_seq_pos_max(self._mem, 0)
        # The next token at position n_past attends to [n_past − n_swa, n_past) (everything without SWA):
        # all of it must still be cached, or the logits after rollback would silently differ.
        need = max(0, n_past - self.n_swa) if self.n_swa > 0 else n_past - 1 if self._recurrent else 0  # its last state
        if pos_max != n_past - 1 or pos_min > need:
            raise OndeviceError(
                f"{self.path.name}: rollback to {n_past} is not exact (cache holds positions {pos_min}..{pos_max}); "
                "this cache pruned positions the model still needs"
            )

    def close(self) -> None:
        lib = self._lib
        self._close_mtp()
        if self._batch is not None:
            lib.llama_batch_free(self._batch)
            self._batch = None
        if getattr(self, "_tree_batch", None) is not None:
            lib.llama_batch_free(self._tree_batch)
            self._tree_batch = None
        if self._ctx:
            llama_ext.forget(self._ctx)
            with _ctrl_c_deferred():
                lib.llama_free(self._ctx)
            self._ctx = None
        if self._model:
            lib.llama_model_free(self._model)
            self._model = None

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:
            pass
