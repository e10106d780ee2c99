"""What a llama.cpp target pass hands a drafter beyond its logits (``Backend.features``), kept per cached position.

``layer_inputs`` (EAGLE-3): the inputs of the draft's 3 target layers (``llama_ext.record_layer_inputs``, or on
an architecture whose graph records none, qwen2, a ``llama_ext.EvalTap`` installed as the context's cb_eval),
read after *every* ``llama_decode`` chunk (llama.cpp keeps only the last decode's rows), stored one row per cached
position and cut back on every rollback, so after a verify pass and its rollback the rows of exactly the accepted
prefix are there; a tree pass (``eval_tree``) keeps every node's rows until ``keep_path`` stores those of the
kept path. They are read even on steps that will not draft (``keep_features`` is only a hint): the draft's cache
needs every position, and a read is a copy. Positions no pass read (a KV state loaded from the prompt cache)
leave a gap (``feature`` answers None there); the drafter drops rows it has consumed (``release_features``).

``nextn`` (a model's own MTP heads): a GGUF whose architecture has an MTP graph here and that carries MTP layers
is loaded with them (``load_mtp``; mmap leaves them untouched until used) and its context keeps
``MTP_RS_SEQ`` recurrent-state snapshots (a hybrid trunk, qwen35, can then roll back a verify pass).
``enable_features({"nextn"})`` opens the head (``llama_mtp.MtpHead``) and makes every later decode chunk output
its h rows, which the head observes (whether or not a drafter will read them: its cache must follow the
trunk's); the rows are kept per position, so a rollback to any cached position hands the head its h.
"""

from __future__ import annotations

import numpy as np

from ondevice.backends import llama_ext, llama_mtp
from ondevice.backends.base import KeptLayerRows
from ondevice.errors import OndeviceError

MTP_RS_SEQ = 9  # recurrent snapshots: a rollback over a verify pass of up to 8 drafts (``Traits.max_gamma``)


class LlamaFeatures(KeptLayerRows):
    """Mixin of ``LlamaBackend``: the per-position feature rows (see the module docstring)."""

    _tree_rows: np.ndarray | None = None  # every node's layer-input rows of the last eval_tree (until keep_path)
    _tap: llama_ext.EvalTap | None = None  # cb_eval tap of a context whose graph records no layer inputs (qwen2)
    n_mtp = 0  # MTP blocks loaded with the model (``file_mtp_layers``)
    _mtp: llama_mtp.MtpHead | None = None  # the open head (``enable_nextn``)
    _nextn_rows: list[np.ndarray]  # the target's h row of every cached position (the head's rollback)

    def enable_nextn(self) -> int:
        """Open the model's MTP head and feed it every later decode; returns the h width. Raises ``OndeviceError``
        (one line) where the model carries no MTP layers this llama.cpp runs."""
        self._check_open()
        if self._mtp is None:
            if not self.n_mtp:
                llama_mtp.file_mtp_layers(self.path, strict=True)  # says why not
                raise OndeviceError(f"{self.path.name}: loaded without its MTP layers")
            self.rollback(0)  # the head observes every position from the first
            self._mtp = llama_mtp.MtpHead(self._model, n_ctx=self.n_ctx, threads=self.threads, n_batch=self.n_batch,
                                          name=self.path.name)
            llama_mtp.enable_nextn(self._ctx)
            self._nextn_rows = []
        return self._mtp.n_embd

    def mtp(self) -> llama_mtp.MtpHead:
        """The open MTP head (``enable_nextn`` first)."""
        if self._mtp is None:
            raise OndeviceError(f"{self.path.name}: no MTP head is open (enable_features({{'nextn'}}) first)")
        return self._mtp

    def _close_mtp(self) -> None:
        if self._mtp is not None:
            self._mtp.close()  # before the model it runs on
            self._mtp = None

    def enable_hidden(self) -> int:
        """Keep the post-norm hidden state of every row each later ``eval`` outputs; returns its size.

        llama.cpp outputs every row of a batch while embeddings are on, so an ``eval(..., "last")`` of
        several tokens runs its first tokens with them off and the last token alone with them on.
        """
        self._check_open()
        lib = self._lib
        if lib.llama_pooling_type(self._ctx) != lib.LLAMA_POOLING_TYPE_NONE:
            raise OndeviceError(f"{self.path.name}: this model pools its embeddings; it has no per-token hidden state for heads")
        self._hidden_on = self._hidden_ok = True
        self._set_emb(True)
        self.n_embd = int(lib.llama_model_n_embd_out(self._model))
        return self.n_embd

    def want_hidden(self, on: bool) -> None:
        """After ``enable_hidden``: whether the next evals keep hidden rows (off for steps whose next step
        will not draft: llama.cpp's embeddings output is not free)."""
        if self._hidden_ok:
            self._hidden_on = bool(on)
            self._set_emb(self._hidden_on)

    def _set_emb(self, on: bool) -> None:
        if self._emb != on:
            self._lib.llama_set_embeddings(self._ctx, on)
            self._emb = on


    def enable_layer_inputs(self, ids: list[int]) -> int:
        """Record the inputs of target layers ``ids`` for every token of each later pass; returns a row's width
        (len(ids) × hidden size). ``feature("layer_inputs", pos)`` then gives position pos's row.

        Architectures whose graph records them (``llama_ext.LAYER_INP_ARCHS``) switch recording on in place.
        Others (qwen2) are read through a ``llama_ext.EvalTap``: the first call recreates the context with the
        tap as its ``cb_eval`` (llama.cpp takes the callback only at creation), which empties the cache (call it
        before the prompt, and before a drafter borrows the context); later calls only change its layers. Its
        cost is llama.cpp asking a Python callback about each graph node: ~1 ms per pass (Qwen2.5-0.5B: 822 nodes;
        ×1.05 a 1-thread CPU decode, ×1.01 a 64-token prefill; ``scripts/bench_layer_tap.py``).
        Raises ``OndeviceError`` (one line) for a bad layer id, or an architecture whose layer outputs the tap
        cannot find either (a one-token probe decode on the empty context says so).
        """
        self._check_open()
        ids = [int(i) for i in ids]
        n_layer = int(self._lib.llama_model_n_layer(self._model))
        self._n_embd_trunk = int(self._lib.llama_model_n_embd(self._model))
        if llama_ext.model_arch(self._model) in llama_ext.LAYER_INP_ARCHS:
            llama_ext.record_layer_inputs(self._ctx, self._model, ids, name=self.path.name)
            stale = set(self._layer_ids or ()) - set(ids)
            if stale:  # no longer read: stop copying them
                llama_ext.record_layer_inputs(self._ctx, self._model, sorted(stale), on=False, name=self.path.name)
        else:
            try:
                if self._tap is None:
                    self._install_tap(llama_ext.EvalTap(ids, self._n_embd_trunk, n_layer))
                else:
                    self._tap.set_ids(ids)
            except OndeviceError as e:
                raise OndeviceError(f"{self.path.name}: architecture {llama_ext.model_arch(self._model)!r} records no "
                                    f"layer inputs in this llama.cpp; read through cb_eval, {e}") from None
        self._layer_ids = ids
        self._layer_rows, self._layer_pos0 = [], 0
        return len(ids) * self._n_embd_trunk

    def eagle3_draft(self, path, layer_inputs_on, threads: int | None = None, n_ctx: int | None = None):
        """llama.cpp's own eagle3 graph (``backends.eagle3.Eagle3Graph``), borrowing this context's token table
        (``ctx_other``) once ``layer_inputs_on`` ran (a qwen2 target recreates its context there)."""
        from ondevice.backends.eagle3 import Eagle3Graph

        def context(ids: list[int]):
            layer_inputs_on(ids)
            return self._ctx

        return Eagle3Graph(path, context, self._model, n_ctx=n_ctx or self.n_ctx, threads=threads)

    def dflash_draft(self, path, layer_inputs_on, threads: int | None = None):
        """llama.cpp's own dflash graph (``backends.llama_dflash.DFlashGraph``), borrowing this context (its token
        table and LM head when the draft has none) once ``layer_inputs_on`` ran (a qwen2 target recreates its
        context there)."""
        from ondevice.backends.llama_dflash import DFlashGraph

        def context(ids: list[int]):
            layer_inputs_on(ids)
            return self._ctx

        return DFlashGraph(path, self._model, context, n_ctx=self.n_ctx, threads=threads)

    def _install_tap(self, tap: llama_ext.EvalTap) -> None:
        """Recreate the (emptied) context with ``tap`` as its cb_eval, carry its switches over, and check with a
        one-token decode that the tap finds this architecture's layer outputs."""
        lib = self._lib
        self.rollback(0)
        llama_ext.forget(self._ctx)
        lib.llama_free(self._ctx)
        self._ctx = None
        self._open_context(tap.callback)
        self._tap, self._last_decode, self._hidden = tap, None, None
        if self._emb:
            lib.llama_set_embeddings(self._ctx, True)
        if self._mtp is not None:
            llama_mtp.enable_nextn(self._ctx)
        one = (lib.llama_token * 1)(self.bos_id or 0)
        rc = lib.llama_decode(self._ctx, lib.llama_batch_get_one(one, 1))
        lib.llama_memory_clear(self._mem, False)
        try:
            if rc != 0:
                raise OndeviceError(f"llama_decode failed (code {rc})")
            if tap.ids:
                tap.read(1)
        except OndeviceError:
            tap.set_ids([])  # idle: later decodes run as before
            raise OndeviceError("its graph names no layer outputs l_out either (EAGLE-3 needs them; recorded by: "
                                f"{', '.join(sorted(llama_ext.LAYER_INP_ARCHS))})") from None

    def _read_features(self, pos0: int, tokens) -> None:
        """After a decode of ``tokens`` at ``pos0``: the MTP head observes them; their layer-input rows are kept."""
        m = len(tokens)
        if self._mtp is not None and pos0 == len(self._nextn_rows) == self._mtp.n_past:
            h = llama_mtp.nextn_rows(self._ctx, m, self._mtp.n_embd)
            self._nextn_rows.extend(h)
            self._mtp.observe(tokens, h, pos0)
        # else positions the head never saw (a KV state loaded from the prompt cache): it stays behind, and the MTP
        # drafter proposes nothing, until the cache is rolled back to what the head holds
        if self._layer_ids is None:
            return
        rows = self._layer_inputs(m)
        if pos0 != self._layer_pos0 + len(self._layer_rows):  # a gap (passes made without them): start over
            self._layer_rows, self._layer_pos0 = [], pos0
        self._layer_rows.extend(rows)

    def _layer_inputs(self, m: int) -> np.ndarray:
        """[m, width]: the layer-input rows of the last decode's m tokens."""
        if self._tap is not None:
            return self._tap.read(m)
        return llama_ext.layer_inputs(self._ctx, self._layer_ids, m, self._n_embd_trunk)

    def eval_tree(self, tokens, parents) -> np.ndarray:
        """``LlamaTree.eval_tree``, keeping every node's layer-input rows until ``keep_path`` (if recorded)."""
        logits = super().eval_tree(tokens, parents)
        self._tree_rows = None if self._layer_ids is None else self._layer_inputs(len(tokens))
        return logits

    def keep_path(self, path) -> None:
        """``LlamaTree.keep_path``; the kept nodes' layer-input rows become those of positions base.. in path order,
        as a chain's ``eval`` of them would have left them."""
        base = self._tree[0] if self._tree is not None else None
        rows, self._tree_rows = self._tree_rows, None
        super().keep_path(path)
        if rows is not None and path and self._layer_ids is not None:
            if base != self._layer_pos0 + len(self._layer_rows):  # a gap: start over
                self._layer_rows, self._layer_pos0 = [], base
            self._layer_rows.extend(rows[list(path)])

    def _trim_features(self, n_past: int) -> None:
        """The cache now holds ``n_past`` positions: rows beyond are gone; the MTP head keeps positions below it."""
        if self._mtp is not None:
            n = min(n_past, self._mtp.n_past)
            del self._nextn_rows[n:]
            self._mtp.rollback(n, self._nextn_rows[-1] if n else None)
        if self._layer_ids is not None:
            del self._layer_rows[max(0, n_past - self._layer_pos0):]

    def _layer_row(self, pos: int) -> np.ndarray | None:
        i = pos - self._layer_pos0
        if self._layer_ids is None or not 0 <= i < len(self._layer_rows) or pos >= self.n_past:
            return None
        return self._layer_rows[i]

    def _no_feature(self, name: str) -> OndeviceError:
        return OndeviceError(f"{self.path.name}: {type(self).__name__} cannot give a drafter {name!r} "
                             f"(it gives: {', '.join(sorted(self.features))})")

    def enable_features(self, needs: frozenset[str]) -> dict[str, int]:
        out = {}
        for name in sorted(needs):
            if name == "layer_inputs" and self._layer_ids is None:
                raise OndeviceError(f"{self.path.name}: layer inputs need their layer ids (enable_layer_inputs)")
            if name not in self.features:
                raise self._no_feature(name)
            out[name] = self.enable_hidden() if name == "hidden" else self.enable_nextn() if name == "nextn" \
                else len(self._layer_ids) * self._n_embd_trunk
        return out

    def feature(self, name: str, pos: int) -> np.ndarray | None:
        return self.hidden(pos) if name == "hidden" else self._layer_row(pos) if name == "layer_inputs" else None

    def _check_recurrent_rollback(self, n_past: int, cur: int) -> None:
        """Refuse a rollback from ``cur`` to ``n_past`` a recurrent state cannot make exactly: llama.cpp restores one
        only inside the last decode, from its ``n_rs_seq`` snapshots (and says it succeeded elsewhere too, with a
        wrong state)."""
        last, self._last_decode = self._last_decode, None
        if self._recurrent and (last is None or last[1] != cur or not max(last[0] + 1, cur - self._n_rs + 1) <= n_past):
            raise OndeviceError(f"{self.path.name}: this model's recurrent state cannot roll back to position {n_past} "
                                "(only into its last pass)")
