"""Saving and restoring one sequence's KV cache on llama.cpp (``save_seq_state`` / ``load_seq_state``) for
``LlamaBackend`` (a mixin, as ``llama_tree``); the disk prompt cache (``ondevice.prompt_cache``) stores these
bytes."""

from __future__ import annotations

import ctypes

from ondevice.errors import OndeviceError


class LlamaState:
    """Sequence state of a ``LlamaBackend`` (uses its ``_lib``, ``_ctx``, ``_mem``, ``n_ctx_seq``, ``path``)."""

    def seq_positions(self, seq: int = 0) -> int:
        """Positions sequence ``seq`` caches (``n_past`` for sequence 0)."""
        self._check_open()
        return int(self._lib.llama_memory_seq_pos_max(self._mem, seq)) + 1

    def save_seq_state(self, seq: int = 0) -> bytes:
        """The KV state of sequence ``seq`` (every position it caches) as llama.cpp serialises it;
        ``load_seq_state`` puts it back into a context of the same model, build, cache types and layout."""
        self._check_open()
        self._drop_unkept_tree()
        lib = self._lib
        size = int(lib.llama_state_seq_get_size(self._ctx, seq))
        buf = bytearray(size)
        n = int(lib.llama_state_seq_get_data(self._ctx, (ctypes.c_uint8 * size).from_buffer(buf), size, seq))
        if n == 0 or n > size:
            raise OndeviceError(f"{self.path.name}: llama.cpp could not serialise the KV cache ({n} of {size} bytes)")
        return bytes(buf[:n])

    def load_seq_state(self, data: bytes, n_tokens: int, seq: int = 0, keep: int | None = None) -> None:
        """Replace sequence ``seq``'s cache with ``data`` from ``save_seq_state``, which must hold positions
        0..n_tokens-1 (the caller knows which tokens), then keep only the first ``keep`` of them (default all:
        K/V rows depend only on earlier tokens, so a cut-back state is exactly the shorter prefix's).

        Raises:
            OndeviceError: llama.cpp refused the data, or it held other positions; the sequence is left empty.
        """
        self._check_open()
        self._drop_unkept_tree()
        lib, mem = self._lib, self._mem
        lib.llama_memory_seq_rm(mem, seq, -1, -1)
        self._hidden = None  # no eval produced what the cache holds now
        keep = n_tokens if keep is None else int(keep)
        if not 0 < keep <= n_tokens <= self.n_ctx_seq:
            raise OndeviceError(f"{self.path.name}: cannot keep {keep} of a saved state of {n_tokens} tokens "
                                f"in n_ctx={self.n_ctx_seq}")
        src = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        ok = lib.llama_state_seq_set_data(self._ctx, src, len(data), seq) > 0
        span = (int(lib.llama_memory_seq_pos_min(mem, seq)), int(lib.llama_memory_seq_pos_max(mem, seq)))
        if ok and span == (0, n_tokens - 1) and keep < n_tokens:
            ok = lib.llama_memory_seq_rm(mem, seq, keep, -1)
            span = (int(lib.llama_memory_seq_pos_min(mem, seq)), int(lib.llama_memory_seq_pos_max(mem, seq)))
        if not ok or span != (0, keep - 1):
            lib.llama_memory_seq_rm(mem, seq, -1, -1)
            raise OndeviceError(f"{self.path.name}: llama.cpp refused a saved KV state (expected positions 0..{n_tokens - 1})")
