"""Text embeddings through llama.cpp's embedding path: a llama.cpp context of its own (embeddings on) beside the
generating one, pooling as the GGUF's metadata says.

Pooling: ``{arch}.pooling_type`` of the GGUF (mean, cls or last: what an embedding model such as a BERT or a
Qwen3-Embedding GGUF declares). A chat model declares none (its per-token hidden states are its output): its
embedding is then the **mean of the final hidden states** of the input's tokens (``Embedder.pooling`` says
which, ``Embedder.declared`` whether the model said so). Every vector is scaled to unit length.

Inputs go through llama.cpp together, as many sequences per decode as fit in one batch; each must fit the
context on its own (``n_ctx`` tokens; a longer one is an ``OndeviceError`` naming its index, never cut).

Reranking (``Reranker``, ``rerank``): a GGUF declaring pooling 'rank' (a classifier head over the pooled state)
scores each query-document pair; any other model is refused by name.
"""

from __future__ import annotations

import re
import threading
import weakref
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ondevice.errors import OndeviceError
from ondevice.threads import release_omp_team

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
        self._open(code, n_ctx, threads)

    def _open(self, code: int, n_ctx: int, threads: int | None) -> None:
        import llama_cpp

        from ondevice.backends.llama_ext import guard_amx

        guard_amx()
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
        out = self._pooled(seqs, self.n_embd)
        norms = np.linalg.norm(out, axis=1, keepdims=True)
        return out / np.maximum(norms, np.float32(1e-12))

    def _pooled(self, seqs: Sequence[Sequence[int]], width: int) -> np.ndarray:
        """llama.cpp's pooled output of each checked sequence: float32 [len(seqs), width] (finite). The calling
        thread's OpenMP team is freed after (``serve`` embeds on its executor's threads, which live on beside the
        threads that generate: ``ondevice.threads.release_omp_team``)."""
        try:
            return self._decode_pooled(seqs, width)
        finally:
            release_omp_team()

    def _decode_pooled(self, seqs: Sequence[Sequence[int]], width: int) -> np.ndarray:
        """``_pooled`` on this thread's OpenMP team."""
        lib, llm = self._lib, self.llm
        out = np.empty((len(seqs), width), np.float32)
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
                    out[done + j] = np.ctypeslib.as_array(ptr, shape=(width,))
                done += len(batch)
            llm._batch.reset()
            llm._ctx.kv_cache_clear()
        if not np.isfinite(out).all():
            raise OndeviceError(f"{self.path.name}: llama.cpp returned a non-finite output")
        return out

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


class Reranker(Embedder):
    """A reranker GGUF (pooling 'rank': a classifier head over the pooled state) scoring query-document pairs.

    Each pair is one sequence, formatted as llama.cpp's server does: the GGUF's ``tokenizer.chat_template.rerank``
    with ``{query}`` and ``{document}`` filled in (special tokens parsed in the template only, so a document
    cannot write the template's markers), else
    ``[BOS] query [EOS] [SEP] document [EOS]`` as the vocabulary's add-bos / add-eos / add-sep flags say. The
    score is the head's first output (a Qwen3 reranker's softmax of yes / no: P(yes)).

    Args:
        path: the GGUF file; its metadata must declare pooling 'rank'.
        n_ctx: the longest pair in tokens.
        threads: CPU threads for llama.cpp.

    Raises:
        OndeviceError: the model is not a reranker (naming the file and its pooling).
    """

    def __init__(self, path: str | Path, *, n_ctx: int = DEFAULT_N_CTX, threads: int | None = None) -> None:
        from ondevice.formats.gguf import check_gguf_file

        self.path = Path(path)
        if self.path.suffix != ".gguf" or not self.path.is_file():
            raise OndeviceError(f"{self.path.name}: reranking needs a GGUF model file (llama.cpp's rank pooling)")
        check_gguf_file(self.path)
        declared = declared_pooling(self.path)
        if declared != "rank":
            raise OndeviceError(f"{self.path.name} is not a reranker: its GGUF declares pooling {declared or 'none'}, "
                                "not 'rank' (a classifier head scoring query-document pairs); serve a reranker GGUF "
                                "(e.g. bge-reranker, jina-reranker, Qwen3-Reranker)")
        self.declared, self.pooling = True, "rank"
        self._open(4, n_ctx, threads)
        lib, model = self._lib, self.llm._model.model
        template = lib.llama_model_chat_template(model, b"rerank")
        self.template = template.decode("utf-8") if template else None
        vocab = lib.llama_model_get_vocab(model)
        eos = lib.llama_vocab_eos(vocab)
        eos = lib.llama_vocab_sep(vocab) if eos < 0 else eos
        self._marks = {"bos": [lib.llama_vocab_bos(vocab)] if lib.llama_vocab_get_add_bos(vocab) else [],
                       "eos": [eos] if lib.llama_vocab_get_add_eos(vocab) and eos >= 0 else [],
                       "sep": [lib.llama_vocab_sep(vocab)] if lib.llama_vocab_get_add_sep(vocab) else []}

    def pair(self, query: str, document: str) -> list[int]:
        """The token ids of one query-document pair, as the model reads it (see the class)."""
        def tok(text: str, special: bool) -> list[int]:
            return self.llm.tokenize(text.encode("utf-8"), add_bos=False, special=special)

        with self._lock:
            self._check_open()
            if self.template is not None:  # the template's markers are special tokens; the texts never are
                parts = re.split(r"(\{query\}|\{document\})", self.template)
                return [t for part in parts if part for t in (
                    tok(query, False) if part == "{query}" else tok(document, False) if part == "{document}"
                    else tok(part, True))]
            m = self._marks
            return m["bos"] + tok(query, False) + m["eos"] + m["sep"] + tok(document, False) + m["eos"]

    def rerank(self, query: str, documents: Sequence[str]) -> tuple[np.ndarray, int]:
        """(relevance scores float32 [len(documents)] in the documents' order, the tokens read).

        Raises:
            OndeviceError: a non-string query or document, an empty list, or a pair longer than ``n_ctx``
                (``TooLong``, naming the document's index).
        """
        if not isinstance(query, str):
            raise OndeviceError("query must be a string")
        if isinstance(documents, str) or not isinstance(documents, Sequence) or not documents:
            raise OndeviceError("documents must be a non-empty list of strings")
        if len(documents) > MAX_INPUTS:
            raise OndeviceError(f"{len(documents)} documents: at most {MAX_INPUTS} per call")
        seqs = []
        for i, d in enumerate(documents):
            if not isinstance(d, str):
                raise OndeviceError(f"documents[{i}] must be a string, got {type(d).__name__}")
            ids = self.pair(query, d)
            if len(ids) > self.n_ctx:
                raise TooLong(f"documents[{i}] with the query is {len(ids)} tokens; the limit is {self.n_ctx} per "
                              "pair (the reranking context): shorten it")
            seqs.append(ids)
        return self._pooled(seqs, 1)[:, 0], sum(map(len, seqs))


_BY_RUNTIME: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_BY_RUNTIME_LOCK = threading.Lock()


def embedder_for(rt, kind: type[Embedder] = Embedder) -> Embedder:
    """The ``Embedder`` (or ``Reranker``: ``kind``) of a runtime's target GGUF (made at the first call, kept
    while the runtime lives)."""
    with _BY_RUNTIME_LOCK:
        made = _BY_RUNTIME.setdefault(rt, {})
        e = made.get(kind)
        if e is None:
            from ondevice.backends.llama import LlamaBackend

            t = rt.target
            what = "reranking" if kind is Reranker else "embeddings"
            if not isinstance(t, LlamaBackend):
                raise OndeviceError(f"{Path(t.path).name}: {what} need a GGUF model (llama.cpp's pooling); "
                                    "this one runs on another backend")
            e = made[kind] = kind(t.path, n_ctx=min(rt.n_ctx, DEFAULT_N_CTX), threads=t.threads)
        return e


def reranker_for(rt) -> Reranker:
    """The ``Reranker`` of a runtime's target GGUF (an ``OndeviceError`` if the model is not a reranker)."""
    return embedder_for(rt, Reranker)


def rerank(rt, query: str, documents: Sequence[str]) -> np.ndarray:
    """Relevance scores [len(documents)] of each document for ``query`` with ``rt``'s reranker model (higher:
    more relevant; in the documents' order)."""
    return reranker_for(rt).rerank(query, documents)[0]


def embed(rt, texts: Sequence[str | Sequence[int]]) -> np.ndarray:
    """``Runtime.embed``: unit-length embeddings [len(texts), n_embd] of ``texts`` with ``rt``'s model
    (``Embedder``; a string alone is a batch of one)."""
    return embedder_for(rt).embed([texts] if isinstance(texts, str) else texts)[0]


def release(rt) -> None:
    """Close the ``Embedder`` / ``Reranker`` made for ``rt``, if any (when the runtime is unloaded)."""
    with _BY_RUNTIME_LOCK:
        made = _BY_RUNTIME.pop(rt, {})
    for e in made.values():
        e.close()
