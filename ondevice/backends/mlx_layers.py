"""Layer inputs of an MLX target (``Backend.features`` "layer_inputs", for EAGLE-3 and DFlash drafts), read from its own passes.

``enable_layer_inputs(ids)`` makes every later ``eval`` / ``eval_tree`` of ``MLXBackend`` swap the chosen entries of
the mlx-lm model's decoder-layer list (``model.layers``) for taps for the duration of the pass: a tap notes the
hidden state its layer is called with (the residual stream entering the layer, as llama.cpp's ``layer_inp``) and
calls the layer. The verify pass itself thus yields the rows: no extra target pass, and the model's parameters
are never touched (the list is restored when the pass ends, also on an error). Rows are kept one per cached
position (the ids' inputs concatenated, float32), cut back on every rollback; a tree pass keeps every node's rows
until ``keep_path`` stores those of the kept path, as ``LlamaFeatures`` does for llama.cpp targets.

A model without such a list (``model.layers``) is refused in one line naming its mlx-lm model type.
"""

from __future__ import annotations

import contextlib
import sys

import numpy as np

from ondevice.backends.base import KeptLayerRows
from ondevice.errors import OndeviceError


class _Tap:
    """A decoder layer seen through its first argument: notes it in ``sink``, then calls the layer (other
    attributes, e.g. ``use_sliding``, are the layer's)."""

    def __init__(self, layer, sink: list) -> None:
        self.layer, self.sink = layer, sink

    def __call__(self, x, *args, **kwargs):
        self.sink.append(x)
        return self.layer(x, *args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.layer, name)


class MLXLayerInputs(KeptLayerRows):
    """Mixin of ``MLXBackend``: recording and keeping the layer-input rows (see the module docstring)."""

    _tree_rows: np.ndarray | None = None  # every node's rows of the last eval_tree (until keep_path)
    _sinks: list[list] | None = None  # during a recorded pass: what each tap saw, per layer id

    def _layer_list(self) -> list:
        """The mlx-lm model's decoder-layer list, or a one-line refusal naming the model type. An inner model
        with mlx-lm's ``PipelineMixin`` (qwen2, deepseek, …) runs a fresh slice of its ``layers`` each pass
        (``pipeline_layers``, also what ``model.layers`` returns): that list, unsplit, is the one to tap."""
        body = getattr(self.model, "model", None)
        if hasattr(type(body), "pipeline_layers") and getattr(body, "pipeline_size", 1) == 1:
            layers = getattr(body, "layers", None)
        else:
            layers = getattr(self.model, "layers", None)
        if not isinstance(layers, list) or not layers:
            kind = getattr(self.model, "model_type", None) or type(self.model).__module__
            where = getattr(sys.modules.get(type(self.model).__module__), "__file__", None) or type(self.model).__module__
            raise OndeviceError(f"{self.path.name}: mlx-lm's {kind!r} model ({where}) has no `layers` list of decoder "
                                "layers to read their inputs from; EAGLE-3 / DFlash drafts cannot run on it")
        return layers

    def enable_layer_inputs(self, ids: list[int]) -> int:
        """Record the inputs of decoder layers ``ids`` for every token of each later pass; returns a row's width
        (len(ids) × hidden size). Refuses (one line) a split model, a model without a ``layers`` list, a layer id
        out of range, or layers not called with the hidden state first (checked on a 2-token probe)."""
        if not self._whole():
            raise OndeviceError(f"{type(self).__name__}: layer inputs (EAGLE-3) are not implemented for a split model")
        mx = self._mx
        layers = self._layer_list()
        ids = [int(i) for i in ids]
        if any(not 0 <= i < len(layers) for i in ids):
            raise OndeviceError(f"{self.path.name}: layer inputs of {ids} asked, this model has {len(layers)} layers")
        self._layer_ids, self._layer_rows, self._layer_pos0, self._tree_rows = ids, [], 0, None
        self._n_embd_trunk = 0
        if not ids:
            return 0
        with mx.stream(self.device), self._recording() as rec:
            self.model(mx.array([[1, 2]]), cache=self._new_cache())
            seen = [s[0].shape if len(s) == 1 else None for s in rec]
        d = seen[0][-1] if seen[0] else 0
        if any(s is None or tuple(s) != (1, 2, d) for s in seen):
            self._layer_ids = None
            raise OndeviceError(f"{self.path.name}: its mlx-lm layers are not each called once with the hidden state "
                                f"first (saw {seen}); EAGLE-3 / DFlash drafts cannot read their inputs")
        self._n_embd_trunk = int(d)
        return len(ids) * self._n_embd_trunk

    @contextlib.contextmanager
    def _recording(self):
        """Taps on the chosen layers for the duration of a pass; yields the per-id sinks (None: not recording)."""
        if not self._layer_ids:
            yield None
            return
        layers = self._layer_list()
        saved = {i: layers[i] for i in self._layer_ids}
        by_id: dict[int, list] = {i: [] for i in saved}  # one tap per layer: an id named twice reads it twice
        sinks = [by_id[i] for i in self._layer_ids]
        try:
            for i, sink in by_id.items():
                layers[i] = _Tap(saved[i], sink)
            yield sinks
        finally:
            for i, layer in saved.items():
                layers[i] = layer

    def _tapped(self, sinks) -> object:
        """The recorded rows of a pass as one lazy float32 mx array [rows, width] (per forward call, in order;
        a batch of one-token tree rows [n, 1, d] and a sequence [1, m, d] both give one row per token)."""
        mx = self._mx
        calls = [mx.concatenate([s[k].reshape(-1, s[k].shape[-1]) for s in sinks], axis=-1) for k in range(len(sinks[0]))]
        return (calls[0] if len(calls) == 1 else mx.concatenate(calls)).astype(mx.float32)

    def eagle3_draft(self, path, layer_inputs_on, threads: int | None = None, n_ctx: int | None = None):
        """The draft's layer in MLX on this target's device (``backends.mlx_eagle3.Eagle3MLX``)."""
        from ondevice.backends.mlx_eagle3 import Eagle3MLX

        return Eagle3MLX(path, self, layer_inputs_on, n_ctx=n_ctx or self.n_ctx)

    def dflash_draft(self, path, layer_inputs_on, threads: int | None = None):
        """The DFlash draft in MLX on this target's device (``backends.mlx_dflash.DFlashMLX``)."""
        from ondevice.backends.mlx_dflash import DFlashMLX

        return DFlashMLX(path, self, layer_inputs_on, n_ctx=self.n_ctx)

    def _drain(self, sinks, *also) -> np.ndarray | None:
        """Evaluate ``also`` (mx arrays) in one go with the rows recorded since the last drain, and return those
        rows (float32 [rows, width]; None when not recording). The sinks are emptied."""
        mx = self._mx
        if not sinks or not sinks[0]:
            mx.eval(*also)
            return None
        f = self._tapped(sinks)
        mx.eval(f, *also)
        for s in sinks:
            s.clear()
        return np.array(f)

    def _keep_rows(self, pos0: int, rows: np.ndarray) -> None:
        """Rows of positions pos0.. from the last pass (a gap, positions no pass recorded, starts over)."""
        if pos0 != self._layer_pos0 + len(self._layer_rows):
            self._layer_rows, self._layer_pos0 = [], pos0
        self._layer_rows.extend(rows)

    def _trim_rows(self, n_past: int) -> None:
        if self._layer_ids is not None:
            del self._layer_rows[max(0, n_past - self._layer_pos0):]

    def enable_features(self, needs: frozenset[str]) -> dict[str, int]:
        """"hidden" (``enable_hidden``) and "layer_inputs" (after ``enable_layer_inputs``); "nextn" is refused in
        one line: mlx-lm drops a checkpoint's MTP weights at load."""
        out = {}
        for name in sorted(needs):
            if name == "hidden":
                out[name] = self.enable_hidden()
            elif name == "layer_inputs" and self._layer_ids is not None:
                out[name] = len(self._layer_ids) * self._n_embd_trunk
            elif name == "layer_inputs":
                raise OndeviceError(f"{self.path.name}: layer inputs need their layer ids (enable_layer_inputs)")
            elif name == "nextn":
                self.mtp()
            else:
                raise OndeviceError(f"{self.path.name}: {type(self).__name__} cannot give a drafter {name!r} "
                                    f"(it gives: {', '.join(sorted(self.features))})")
        return out

    def mtp(self):
        """Refused (one line): mlx-lm's model code drops MTP (nextn) weights when it loads a checkpoint (none of
        its models keeps them), whether or not the config declares MTP layers."""
        import json

        import mlx_lm

        try:
            cfg = json.loads((self.path / "config.json").read_text())
        except (OSError, ValueError):
            cfg = {}
        cfgs = [cfg, cfg.get("text_config") or {}]
        n = max(int(c.get(k) or 0) for c in cfgs for k in ("num_nextn_predict_layers", "mtp_num_hidden_layers"))
        kind = cfg.get("model_type", "?")
        has = f"its config declares {n} MTP (nextn) layers but" if n else "its config declares no MTP (nextn) layers, and"
        raise OndeviceError(f"{self.path.name}: {has} mlx-lm {mlx_lm.__version__} drops MTP weights when it loads a "
                            f"model (here {kind!r}), so draft='mtp' cannot run on an MLX target; use the model's GGUF "
                            "(llama.cpp runs its MTP heads)")

    def feature(self, name: str, pos: int) -> np.ndarray | None:
        if name == "hidden":
            return self.hidden(pos)
        if name != "layer_inputs" or self._layer_ids is None:
            return None
        i = pos - self._layer_pos0
        return self._layer_rows[i] if 0 <= i < len(self._layer_rows) and pos < self.n_past else None
