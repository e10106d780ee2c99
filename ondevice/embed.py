"""Text embeddings through llama.cpp's embedding path: a llama.cpp context of its own (embeddings on) beside the
generating one, pooling as the GGUF's metadata says.

Pooling: ``{arch}.pooling_type`` of the GGUF (mean, cls or last: what an embedding model such as a BERT or a
Qwen3-Embedding GGUF declares). A chat model declares none (its per-token hidden states are its output): its
embedding is then the **mean of the final hidden states** of the input's tokens (``Embedder.pooling`` says
which, ``Embedder.declared`` whether the model said so). Every vector is scaled to unit length.

Inputs go through llama.cpp together, as many sequences per decode as fit in one batch; each must fit the
context on its own (``n_ctx`` tokens; a longer one is an ``OndeviceError`` naming its index, never cut).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ondevice.errors import OndeviceError

POOLING = {1: "mean", 2: "cls", 3: "last", 4: "rank"}  # llama.cpp's enum llama_pooling_type (0: none)
MAX_INPUTS = 2048  # per call, as OpenAI's /v1/embeddings
DEFAULT_N_CTX = 2048


class TooLong(OndeviceError):
    """An input longer than the embedding context."""


def declared_pooling(path: str | Path) -> str | None:
    """The pooling a GGUF's metadata declares ('mean' | 'cls' | 'last' | 'rank'), or None (none declared)."""
    from ondevice.formats.gguf import read_header

    meta, _ = read_header(path)
    v = meta.get(f"{meta.get('general.architecture')}.pooling_type")
    return POOLING.get(int(v)) if isinstance(v, int) else None


class Embedder:
    """A GGUF loaded for embeddings (weights memory-mapped: they share the page cache with a runtime of the
    same file).

    Args:
        path: the GGUF file.
        n_ctx: the longest input in tokens (capped at the model's training context).
        threads: CPU threads for llama.cpp (default: llama.cpp's choice).
        pooling: 'mean' | 'cls' | 'last' to override the metadata (tests); None: as declared, else mean.
    """

    def __init__(self, path: str | Path, *, n_ctx: int = DEFAULT_N_CTX, threads: int | None = None,
                 pooling: str | None = None) -> None:
        import llama_cpp

        from ondevice.formats.gguf import check_gguf_file

        self.path = Path(path)
        if self.path.suffix != ".gguf" or not self.path.is_file():
            raise OndeviceError(f"{self.path.name}: embeddings need a GGUF model file (llama.cpp's embedding path)")
        check_gguf_file(self.path)
        declared = declared_pooling(self.path)
        self.declared = declared is not None
        self.pooling = pooling or declared or "mean"
        if self.pooling == "rank":
            raise OndeviceError(f"{self.path.name} is a reranker (its pooling is 'rank'): it scores query-document "
                                "pairs and has no embeddings; use an embedding or chat model")
        code = {v: k for k, v in POOLING.items()}.get(self.pooling)
        if code is None:
            raise OndeviceError(f"pooling {self.pooling!r}: use mean, cls or last")
        self._lock = threading.Lock()
        self.llm = llama_cpp.Llama(model_path=str(self.path), embedding=True, n_ctx=n_ctx, n_batch=n_ctx,
                                   n_ubatch=n_ctx, pooling_type=code, verbose=False, use_mmap=True,
                                   **({"n_threads": threads, "n_threads_batch": threads} if threads else {}))
        self._lib = llama_cpp
        self.n_ctx = min(int(self.llm.n_batch), int(self.llm.n_ctx()))
        self.n_embd = int(self.llm.n_embd())
        self.vocab_size = int(self.llm.n_vocab())

    def tokenize(self, text: str) -> list[int]:
        """``text`` as the model's embedding input (its BOS / CLS and SEP as its tokenizer adds them; special
        tokens written in the text stay text)."""
        with self._lock:
            self._check_open()
            return self.llm.tokenize(text.encode("utf-8"), add_bos=True, special=False)

    def _check_open(self) -> None:
        if self.llm._ctx is None:
            raise OndeviceError(f"{self.path.name}: this embedder was closed")

    def ids(self, inputs: Sequence[str | Sequence[int]]) -> list[list[int]]:
        """Each input as token ids, checked: non-empty, in the vocabulary, at most ``n_ctx`` tokens.

        Raises:
            OndeviceError: naming the first bad input by its index.
        """
        if isinstance(inputs, str) or not isinstance(inputs, Sequence) or not inputs:
            raise OndeviceError("input must be a non-empty list of strings or token-id lists")
        if len(inputs) > MAX_INPUTS:
            raise OndeviceError(f"{len(inputs)} inputs: at most {MAX_INPUTS} per call")
        out = []
        for i, x in enumerate(inputs):
            ids = self.tokenize(x) if isinstance(x, str) else list(x)
            if not ids:
                raise OndeviceError(f"input[{i}] is empty")
            bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size]
            if bad:
                raise OndeviceError(f"input[{i}]: token id {bad[0]!r} is outside the vocabulary (size {self.vocab_size})")
            if len(ids) > self.n_ctx:
                raise TooLong(f"input[{i}] is {len(ids)} tokens; the limit is {self.n_ctx} per input (the "
                                    "embedding context): split it")
            out.append(ids)
        return out

    def embed_ids(self, seqs: Sequence[Sequence[int]]) -> np.ndarray:
        """Unit-length embeddings of checked token sequences (``ids``): float32 [len(seqs), n_embd]."""
        lib, llm = self._lib, self.llm
        out = np.empty((len(seqs), self.n_embd), np.float32)
        n_seq_max = int(llm.context_params.n_seq_max)
        with self._lock:
            self._check_open()
            done = 0
            while done < len(seqs):
                batch, used = [], 0
                while done + len(batch) < len(seqs) and len(batch) < n_seq_max:
                    n = len(seqs[done + len(batch)])
                    if batch and used + n > self.n_ctx:
                        break
                    batch.append(seqs[done + len(batch)])
                    used += n
                llm._batch.reset()
                for j, ids in enumerate(batch):
                    llm._batch.add_sequence(list(ids), j, True)
                llm._ctx.kv_cache_clear()
                llm._ctx.decode(llm._batch)
                for j in range(len(batch)):
                    ptr = lib.llama_get_embeddings_seq(llm._ctx.ctx, j)
                    out[done + j] = np.ctypeslib.as_array(ptr, shape=(self.n_embd,))
                done += len(batch)
            llm._batch.reset()
            llm._ctx.kv_cache_clear()
        if not np.isfinite(out).all():
            raise OndeviceError(f"{self.path.name}: llama.cpp returned a non-finite embedding")
        norms = np.linalg.norm(out, axis=1, keepdims=True)
        return out / np.maximum(norms, np.float32(1e-12))

    def embed(self, inputs: Sequence[str | Sequence[int]]) -> tuple[np.ndarray, int]:
        """(unit-length embeddings [len(inputs), n_embd], the tokens read) of strings or token-id lists."""
        seqs = self.ids(inputs)
        return self.embed_ids(seqs), sum(map(len, seqs))

    def close(self) -> None:
        """Free the llama.cpp model and context (idempotent)."""
        with self._lock:
            if self.llm._ctx is not None:
                self.llm.close()
                self.llm._ctx = None


_BY_RUNTIME: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_BY_RUNTIME_LOCK = threading.Lock()


def embedder_for(rt) -> Embedder:
    """The ``Embedder`` of a runtime's target GGUF (made at the first call, kept while the runtime lives)."""
    with _BY_RUNTIME_LOCK:
        e = _BY_RUNTIME.get(rt)
        if e is None:
            from ondevice.backends.llama import LlamaBackend

            t = rt.target
            if not isinstance(t, LlamaBackend):
                raise OndeviceError(f"{Path(t.path).name}: embeddings need a GGUF model (llama.cpp's embedding path); "
                                    "this one runs on another backend")
            e = Embedder(t.path, n_ctx=min(rt.n_ctx, DEFAULT_N_CTX), threads=t.threads)
            _BY_RUNTIME[rt] = e
        return e


def embed(rt, texts: Sequence[str | Sequence[int]]) -> np.ndarray:
    """``Runtime.embed``: unit-length embeddings [len(texts), n_embd] of ``texts`` with ``rt``'s model
    (``Embedder``; a string alone is a batch of one)."""
    return embedder_for(rt).embed([texts] if isinstance(texts, str) else texts)[0]


def release(rt) -> None:
    """Close the ``Embedder`` made for ``rt``, if any (when the runtime is unloaded)."""
    with _BY_RUNTIME_LOCK:
        e = _BY_RUNTIME.pop(rt, None)
    if e is not None:
        e.close()
