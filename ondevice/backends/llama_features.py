"""What a llama.cpp target pass hands a drafter beyond its logits (``Backend.features``), kept per cached position.

``layer_inputs`` (EAGLE-3): the inputs of the draft's 3 target layers (``llama_ext.record_layer_inputs``), read
after *every* ``llama_decode`` chunk (llama.cpp keeps only the last decode's rows), stored one row per cached
position and cut back on every rollback, so after a verify pass and its rollback the rows of exactly the accepted
prefix are there. They are read even on steps that will not draft (``keep_features`` is only a hint): the
draft's cache needs every position, and a read is a copy. A pass that did not go through ``eval`` (a tree)
leaves a gap (``feature`` answers None there); the drafter drops rows it has consumed (``release_features``).

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
from ondevice.errors import OndeviceError

MTP_RS_SEQ = 9  # recurrent snapshots: a rollback over a verify pass of up to 8 drafts (``Traits.max_gamma``)


class LlamaFeatures:
    """Mixin of ``LlamaBackend``: the per-position feature rows (see the module docstring)."""

    _layer_ids: list[int] | None = None  # layers whose inputs are recorded (``enable_layer_inputs``)
    _layer_pos0 = 0  # position of _layer_rows[0]
    _layer_rows: list[np.ndarray]
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

    def enable_layer_inputs(self, ids: list[int]) -> int:
        """Record the inputs of target layers ``ids`` for every token of each later pass; returns a row's width
        (len(ids) × hidden size). Raises ``OndeviceError`` (one line naming the architecture) where this
        llama.cpp's graph does not record them (qwen2: its process would abort)."""
        self._check_open()
        llama_ext.record_layer_inputs(self._ctx, self._model, ids, name=self.path.name)
        self._layer_ids = [int(i) for i in ids]
        self._layer_rows, self._layer_pos0 = [], 0
        self._n_embd_trunk = int(self._lib.llama_model_n_embd(self._model))
        return len(ids) * self._n_embd_trunk

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
        rows = llama_ext.layer_inputs(self._ctx, self._layer_ids, m, self._n_embd_trunk)
        if pos0 != self._layer_pos0 + len(self._layer_rows):  # a gap (passes made without them): start over
            self._layer_rows, self._layer_pos0 = [], pos0
        self._layer_rows.extend(rows)

    def _trim_features(self, n_past: int) -> None:
        """The cache now holds ``n_past`` positions: rows beyond are gone; the MTP head keeps positions below it."""
        if self._mtp is not None:
            n = min(n_past, self._mtp.n_past)
            del self._nextn_rows[n:]
            self._mtp.rollback(n, self._nextn_rows[-1] if n else None)
        if self._layer_ids is not None:
            del self._layer_rows[max(0, n_past - self._layer_pos0):]

    def release_features(self, before: int) -> None:
        """Drop kept rows of positions below ``before`` (the drafter has consumed them)."""
        if self._layer_ids is not None and before > self._layer_pos0:
            k = min(before - self._layer_pos0, len(self._layer_rows))
            del self._layer_rows[:k]
            self._layer_pos0 += k

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
