"""Tree verification on llama.cpp: ``eval_tree`` / ``keep_path`` for ``LlamaBackend`` (a mixin, so the
backend module stays one concern). See ``ondevice.tree`` for the rule and docs/tree.md for the layout."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import numpy as np

from ondevice.backends.base import check_room
from ondevice.errors import OndeviceError

TREE_SEQS = 16  # most leaves a tree verified in one pass may have (llama.cpp sequence ids)


class LlamaTree:
    """``eval_tree`` / ``keep_path`` on a ``LlamaBackend`` context created with ``n_seq_max = TREE_SEQS`` and
    ``kv_unified = True`` (uses its ``_lib``, ``_ctx``, ``_mem``, ``n_batch``, ``n_seq_max``, ``n_past``)."""

    _tree_base: int | None = None  # n_past before the last eval_tree until its keep_path has finished

    def tree_unsupported(self) -> str | None:
        return None if self.kv_unified else "a context with one KV buffer per sequence (kv_unified=False)"

    def eval_tree(self, tokens: Sequence[int], parents: Sequence[int]) -> np.ndarray:
        """Evaluate a token tree after the cache's positions in one ``llama_decode``.

        Tree attention by sequence ids: leaf j's root-to-leaf path is sequence j (j < n_seq_max), the
        context (sequence 0) is copied into every leaf's sequence first (``llama_memory_seq_cp`` shares
        the cells, it copies nothing), a node carries the ids of every leaf under it, and its position is
        n_past + its depth. llama.cpp masks a query by its first sequence id and causality: a node sees the
        cells of one leaf's path at positions <= its own, i.e. the context, its ancestors and itself.

        Args:
            tokens: [n] ids; tokens[0] is the root (the token after the cache), n <= n_batch.
            parents: [n] parent indices, parents[0] == -1 and parents[i] < i.
        Returns:
            [n, vocab_size] float32 logits, row i scoring the token after node i's path.
            Call ``keep_path`` next: until then the cache holds every branch.
        """
        lib, n = self._lib, len(tokens)
        if n == 0 or parents[0] != -1 or any(not 0 <= parents[i] < i for i in range(1, n)):
            raise ValueError(f"bad tree: parents {list(parents)}")
        depth, has_child = [0] * n, [False] * n
        for i in range(1, n):
            depth[i] = depth[parents[i]] + 1
            has_child[parents[i]] = True
        leaves = [i for i in range(n) if not has_child[i]]
        if len(leaves) > self.n_seq_max or n > self.n_batch:
            raise ValueError(f"a tree of {n} nodes and {len(leaves)} leaves exceeds this context "
                             f"(n_batch {self.n_batch}, {self.n_seq_max} sequences)")
        base = self.n_past
        check_room(base, n, self.n_ctx, self.path)  # every node takes a cache cell
        seqs: list[list[int]] = [[] for _ in range(n)]
        for j, leaf in enumerate(leaves):
            i = leaf
            while i >= 0:
                seqs[i].append(j)
                i = parents[i]
        self._tree_base = base  # until keep_path has finished (``_drop_unkept_tree``)
        for s in range(1, len(leaves)):
            lib.llama_memory_seq_rm(self._mem, s, -1, -1)  # nothing left over from an interrupted tree
            lib.llama_memory_seq_cp(self._mem, 0, s, -1, -1)
        if self._tree_batch is None:
            self._tree_batch = lib.llama_batch_init(self.n_batch, 0, self.n_seq_max)
        b = self._tree_batch
        for i, t in enumerate(tokens):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = int(t), base + depth[i], len(seqs[i]), True
            for k, s in enumerate(seqs[i]):
                b.seq_id[i][k] = s
        b.n_tokens = n
        self._tree = (base, list(parents), [min(s) for s in seqs])
        self._hidden = None
        rc = lib.llama_decode(self._ctx, b)
        if rc != 0:
            self.keep_path([])
            raise OndeviceError(f"{self.path.name}: llama_decode of a {n}-node tree failed (code {rc}) at position {base}")
        self._tree_hidden = (np.ctypeslib.as_array(lib.llama_get_embeddings(self._ctx), shape=(n, self.n_embd)).copy()
                             if self._emb else None)  # every node's hidden state (``hidden`` after ``keep_path``)
        return np.ctypeslib.as_array(lib.llama_get_logits(self._ctx), shape=(n, self.vocab_size)).copy()

    def keep_path(self, path: Sequence[int]) -> None:
        """After ``eval_tree``: keep the context and the nodes of ``path`` as sequence 0, drop the rest.

        Args:
            path: node indices from the root down (``[0, a1, .., ak]``); ``[]`` drops the whole tree.
        The sequence s of a leaf under the path's last node holds context + that node's path + more:
        ``seq_keep(s)`` frees every cell outside s, ``seq_rm(s, base + len(path), -1)`` the tail past the
        path, and s is renamed 0 (``seq_cp`` then ``seq_rm``). The cache then holds n_past + len(path)
        positions, exactly as a chain's ``rollback`` would leave it.
        """
        if self._tree is None:
            raise ValueError("keep_path needs an eval_tree before it")
        lib, mem = self._lib, self._mem
        base, parents, first = self._tree
        path = list(path)
        if path and (path[0] != 0 or any(parents[b] != a for a, b in zip(path[:-1], path[1:], strict=True))):
            raise ValueError(f"{path} is not a path from the root of the last tree")
        s = first[path[-1]] if path else 0
        self._tree = None
        th, self._tree_hidden = self._tree_hidden, None
        if th is not None and path:  # the kept nodes are positions base.. in path order
            self._hidden = (base, th[path])
        lib.llama_memory_seq_keep(mem, s)
        lib.llama_memory_seq_rm(mem, s, base + len(path), -1)
        if s != 0:
            lib.llama_memory_seq_cp(mem, s, 0, -1, -1)
            lib.llama_memory_seq_rm(mem, s, -1, -1)
        if path != list(range(len(path))):
            self._compact(base)
        self._tree_base = None
        if self.n_past != base + len(path) or lib.llama_memory_seq_pos_min(mem, 0) > (0 if base + len(path) else -1):
            raise OndeviceError(f"{self.path.name}: keeping a tree path left the cache at {self.n_past} positions, "
                                f"not {base + len(path)}")

    def _drop_unkept_tree(self) -> None:
        """Leave sequence 0 holding the context before the last tree when that tree's ``keep_path`` never finished
        (Ctrl-C while the tree was verified, or inside ``keep_path``): the cells of its other branches (or of the
        copy ``_compact`` makes) would stay taken, the next tokens would go into cells after them and later ones
        into the holes they leave, out of position order, and the logits would differ (``_compact``)."""
        base, self._tree_base = self._tree_base, None
        if base is None:
            return
        self._tree = self._tree_hidden = None
        self._lib.llama_memory_seq_keep(self._mem, 0)
        self._lib.llama_memory_seq_rm(self._mem, 0, base, -1)

    def eval_seqs(self, items: Sequence[tuple[int, int, int]], hidden: bool = False,
                  outputs: Sequence[bool] | None = None) -> tuple[np.ndarray, np.ndarray | None]:
        """One ``llama_decode`` of tokens of independent sequences (batched generation, e.g. recording
        many answers at once for ``train-heads``); every row outputs its logits.

        Args:
            items: (sequence id < n_seq_max, position, token) per row; a sequence's rows in position order,
                each position right after what that sequence already holds.
            hidden: also return every row's post-norm hidden state (needs ``enable_hidden`` first).
            outputs: which rows return logits (default all; with ``hidden`` llama.cpp outputs every row).
        Returns:
            ([rows out, vocab_size] logits, [n, n_embd] hidden states or None). Sequence 0 is the chain's cache:
            ``clear_seqs`` before using the backend for anything else.
        """
        lib, b, n = self._lib, self._batch, len(items)
        if not 0 < n <= self.n_batch:
            raise ValueError(f"eval_seqs takes 1..{self.n_batch} rows, not {n}")
        out = [True] * n if outputs is None or hidden else [bool(o) for o in outputs]
        for i, (s, pos, t) in enumerate(items):
            if not 0 <= s < self.n_seq_max:
                raise ValueError(f"sequence id {s} outside 0..{self.n_seq_max - 1}")
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = int(t), int(pos), 1, out[i]
            b.seq_id[i][0] = int(s)
        b.n_tokens = n
        was = self._emb
        self._set_emb(bool(hidden))
        try:
            rc = lib.llama_decode(self._ctx, b)
            if rc != 0:
                raise OndeviceError(f"{self.path.name}: llama_decode of {n} rows failed (code {rc}); "
                                    "is the context full? use a larger n_ctx")
            m = sum(out)
            logits = (np.ctypeslib.as_array(lib.llama_get_logits(self._ctx), shape=(m, self.vocab_size)).copy()
                      if m else np.zeros((0, self.vocab_size), np.float32))
            hid = (np.ctypeslib.as_array(lib.llama_get_embeddings(self._ctx), shape=(n, self.n_embd)).copy()
                   if hidden else None)
        finally:
            self._set_emb(was)
        return logits, hid

    def clear_seqs(self, seq: int = -1) -> None:
        """Empty one sequence's cache cells (``seq``), or every sequence's (−1)."""
        if seq < 0:
            self._lib.llama_memory_clear(self._mem, False)
        else:
            self._lib.llama_memory_seq_rm(self._mem, int(seq), -1, -1)

    def seq_len(self, seq: int) -> int:
        """Positions sequence ``seq`` holds, as llama.cpp reports them (never a Python-side counter)."""
        return int(self._lib.llama_memory_seq_pos_max(self._mem, int(seq))) + 1

    def rollback_seq(self, seq: int, n: int) -> bool:
        """Keep only sequence ``seq``'s first ``n`` positions (``rollback`` for one sequence of several).

        Returns False when llama.cpp cannot cut there exactly (the positions the next token attends to are not
        all cached): the caller then clears the sequence and evaluates it again."""
        lib, mem, seq = self._lib, self._mem, int(seq)
        if n <= 0:
            self.clear_seqs(seq)
            return True
        if not lib.llama_memory_seq_rm(mem, seq, int(n), -1):
            return False
        need = max(0, n - self.n_swa) if self.n_swa > 0 else 0
        return self.seq_len(seq) == n and lib.llama_memory_seq_pos_min(mem, seq) <= need

    def _compact(self, base: int) -> None:
        """Move sequence 0's cells at positions >= base into the first free cells, in position order.

        The kept nodes of a tree sit in the cells the whole tree took, with holes where other branches
        were; the next tokens would fill those holes, before cells of earlier positions. llama.cpp's CPU
        flash attention accumulates V in f16 in cell order, so the logits would then differ (by rounding,
        ~0.2 on the tiny test models) from a cache filled in order. Saving those cells as a sequence
        (``llama_state_seq_get_data``: only the kept nodes, K/V of every layer), freeing them, and loading
        them back (``llama_state_seq_set_data`` takes free cells in order, right after the context) keeps
        the cache laid out exactly as a chain would have left it.
        """
        lib, mem, ctx, tmp = self._lib, self._mem, self._ctx, 1
        lib.llama_memory_seq_cp(mem, 0, tmp, base, -1)
        size = lib.llama_state_seq_get_size(ctx, tmp)
        buf = (ctypes.c_uint8 * size)()
        n = lib.llama_state_seq_get_data(ctx, buf, size, tmp)
        lib.llama_memory_seq_rm(mem, tmp, -1, -1)
        lib.llama_memory_seq_rm(mem, 0, base, -1)
        if n == 0 or lib.llama_state_seq_set_data(ctx, buf, n, tmp) == 0:
            raise OndeviceError(f"{self.path.name}: could not re-lay the kept tree path in the cache")
        lib.llama_memory_seq_cp(mem, tmp, 0, -1, -1)
        lib.llama_memory_seq_rm(mem, tmp, -1, -1)

