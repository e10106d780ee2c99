"""A minimal llama.cpp target loaded with its MTP layers, its trunk and ``MtpHead`` kept in step.

For tests and benches (tests/test_mtp.py, scripts/bench_mtp.py); it shows what ``LlamaBackend`` needs to host
an MTP head: ``load_mtp``, the h rows after each decode, and ``n_rs_seq`` for hybrid (recurrent) trunks.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ondevice.backends.llama_ext import LlamaHandles
from ondevice.backends.llama_mtp import MtpHead, enable_nextn, ext, nextn_rows
from ondevice.errors import OndeviceError


class MtpTarget(LlamaHandles):
    """A target GGUF loaded with its MTP layers: trunk context + ``MtpHead``, kept in step (tests, benches).

    Args:
        path: the .gguf file.
        n_ctx, threads, n_batch: as ``LlamaBackend``.
        n_rs_seq: recurrent-state snapshots per sequence, so a hybrid trunk (qwen35's gated delta net) can
            roll back that many positions; attention-only trunks ignore it.
        nextn: output the target's h rows and keep the MTP head in step (False: a plain target, to time
            the verify overhead).
    """

    _BATCH_FREE = "llama_batch_free"

    def __init__(self, path: str | Path, *, n_ctx: int = 1024, threads: int = 2, n_batch: int = 256,
                 n_rs_seq: int = 8, nextn: bool = True) -> None:
        import llama_cpp

        from ondevice.backends.llama import init_llama

        self._lib, self.path = llama_cpp, Path(path)
        self._model = self._ctx = self._batch = None
        self.head: MtpHead | None = None
        init_llama()
        mp = llama_cpp.llama_model_default_params()
        mp.load_mtp = True
        mp.n_gpu_layers = 0
        self._model = llama_cpp.llama_model_load_from_file(str(self.path).encode(), mp)
        if not self._model:
            raise OndeviceError(f"{self.path}: llama.cpp could not load this GGUF with its MTP layers")
        cp = llama_cpp.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max, cp.n_rs_seq = n_ctx, n_batch, n_batch, 1, n_rs_seq
        cp.n_threads = cp.n_threads_batch = threads
        cp.no_perf = True
        self._ctx = llama_cpp.llama_init_from_model(self._model, cp)
        if not self._ctx:
            self.close()
            raise OndeviceError(f"{self.path}: llama.cpp could not create a context of n_ctx={n_ctx}")
        self._mem = llama_cpp.llama_get_memory(self._ctx)
        self.n_batch = int(llama_cpp.llama_n_batch(self._ctx))
        self._batch = llama_cpp.llama_batch_init(self.n_batch, 0, 1)
        self.vocab_size = int(llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self._model)))
        self.n_embd = int(llama_cpp.llama_model_n_embd_out(self._model))
        if nextn:
            self.head = MtpHead(self._model, n_ctx=n_ctx, threads=threads, n_batch=n_batch, name=self.path.name)
            enable_nextn(self._ctx)

        self._nextn = nextn

    @property
    def n_past(self) -> int:
        return int(self._lib.llama_memory_seq_pos_max(self._mem, 0)) + 1

    def set_nextn(self, on: bool) -> None:
        """Output h rows and feed the head (on), or decode as a plain target (off: to time the overhead).
        Turning it back on leaves the head behind the trunk: only for measurements that stop there."""
        if self.head is None:
            raise OndeviceError(f"{self.path.name}: loaded with nextn=False; no MTP head to feed")
        self._nextn = bool(on)
        ext("set_embeddings_nextn")(self._ctx, self._nextn, False)

    def eval(self, tokens: Sequence[int]) -> np.ndarray:
        """Decode ``tokens`` at n_past..; returns every token's logits [n, vocab]; the head observes them."""
        lib, b = self._lib, self._batch
        rows = []
        for s in range(0, len(tokens), self.n_batch):
            chunk, pos0 = tokens[s : s + self.n_batch], self.n_past
            for i, t in enumerate(chunk):
                b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = int(t), pos0 + i, 1, True
                b.seq_id[i][0] = 0
            b.n_tokens = len(chunk)
            rc = lib.llama_decode(self._ctx, b)
            if rc != 0:
                raise OndeviceError(f"{self.path.name}: llama_decode failed (code {rc}) at position {pos0}")
            rows.append(np.ctypeslib.as_array(lib.llama_get_logits(self._ctx), shape=(len(chunk), self.vocab_size)).copy())
            if self.head is not None and self._nextn:
                self.head.observe(chunk, nextn_rows(self._ctx, len(chunk), self.n_embd), pos0)
        return np.concatenate(rows)

    def rollback(self, n_past: int) -> None:
        """Keep positions below ``n_past`` in the trunk's cache and the head's."""
        if n_past < self.n_past and not self._lib.llama_memory_seq_rm(self._mem, 0, n_past, -1):
            raise OndeviceError(f"{self.path.name}: the trunk cache cannot roll back to {n_past} "
                                "(a recurrent trunk rolls back at most n_rs_seq positions)")
        if self.head is not None:
            self.head.rollback(n_past)

    def close(self) -> None:
        if self.head is not None:
            self.head.close()
            self.head = None
        LlamaHandles.close(self)
