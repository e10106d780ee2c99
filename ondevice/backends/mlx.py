"""MLX backend on mlx-lm model classes: Metal GPU on a Mac, CPU elsewhere.

The cache is mlx-lm's per-layer list; rollback trims it. Caches that cannot be trimmed are refused
at load. Sliding-window layers (Gemma 3, ...) get a full-size ``KVCache`` instead of mlx-lm's
``RotatingKVCache``, as llama.cpp's ``swa_full``: mlx-lm builds the window into the attention mask
(``window_size``), so the logits are the same, and every position stays for an exact rollback.

Each backend runs on its own device (``mx.stream(device)`` around its work); the process-wide default
device is never changed, so two backends on different devices do not move each other.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import numpy as np

from ondevice.backends.base import check_room
from ondevice.backends.hf_vocab import HFVocab
from ondevice.errors import OndeviceError

PREFILL_CHUNK = 512


def pick_device(device: str | None):
    """'gpu' | 'cpu' | None (Metal GPU when available, else CPU) → an mx.Device (the default is left alone)."""
    import mlx.core as mx

    has_gpu = mx.metal.is_available() if hasattr(mx, "metal") else False
    if device not in (None, "gpu", "cpu"):
        raise OndeviceError(f"device={device!r}: choose 'gpu' or 'cpu'")
    if device == "gpu" and not has_gpu:
        raise OndeviceError("device='gpu' needs Metal (Apple silicon); use device='cpu' here")
    return mx.gpu if (device == "gpu" or (device is None and has_gpu)) else mx.cpu


class MLXBackend(HFVocab):
    """An mlx-lm model directory and its KV cache (see ``ondevice.backends.Backend``).

    Args:
        path: an mlx-lm style directory (config.json, *.safetensors, tokenizer files).
        n_ctx: context length (checked on every eval).
        device: 'gpu', 'cpu' or None (Metal when available).
    """

    def __init__(self, path: str | Path, *, n_ctx: int = 4096, device: str | None = None, threads: int | None = None) -> None:
        self.path = Path(path)
        for need in ("config.json", "tokenizer.json"):
            if not (self.path / need).is_file():
                raise OndeviceError(f"{self.path / need}: missing; an MLX model directory needs config.json, weights and tokenizer.json")
        self.device = pick_device(device)
        import mlx.core as mx
        self._mx = mx
        try:
            with mx.stream(self.device):
                self.model, self.tokenizer = self._load_model()
        except (ValueError, FileNotFoundError, KeyError) as e:
            raise OndeviceError(f"{self.path}: mlx-lm could not load this model ({e})") from e
        self.cache = self._new_cache()
        self._valid: int | None = None  # while an eval is in flight: positions known to be complete
        self.n_ctx = int(n_ctx)
        args = getattr(self.model, "args", None)
        self.vocab_size = int(getattr(args, "vocab_size", 0) or len(self.tokenizer.get_vocab()))
        self._init_vocab(self.tokenizer._tokenizer, self.tokenizer.eos_token_ids or [])  # the HF fast tokenizer

    def _load_model(self):
        """(model, tokenizer) from mlx-lm (``ondevice.distributed.sharded`` overrides this to split the model over ranks)."""
        from mlx_lm.utils import load

        return load(str(self.path))

    def _new_cache(self) -> list:
        """mlx-lm's cache for this model, with full-size caches for sliding-window layers."""
        from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

        cache = [KVCache() if isinstance(c, RotatingKVCache) and c.keep == 0 else c for c in make_prompt_cache(self.model)]
        for c in cache:
            if not isinstance(c, (KVCache, RotatingKVCache)) or not hasattr(c, "trim"):
                raise OndeviceError(f"{self.path}: its {type(c).__name__} cache cannot be rolled back; speculative decoding needs a trimmable cache")
        return cache

    # -- cache -----------------------------------------------------------------------------------
    @property
    def n_past(self) -> int:
        """Positions every layer holds (an interrupted forward may have advanced only some layers)."""
        if self.model is None:
            raise OndeviceError(f"{self.path.name}: this model was closed; load it again")
        n = min(int(c.offset) for c in self.cache)
        return n if self._valid is None else min(n, self._valid)

    def eval(self, tokens: Sequence[int], logits: Literal["all", "last"] = "all") -> np.ndarray:
        mx = self._mx
        n = len(tokens)
        self._valid = self.n_past
        check_room(self._valid, n, self.n_ctx, self.path)
        tokens = list(tokens)
        with mx.stream(self.device):
            if logits == "last" and n > 1:
                # All but the last token only fill the cache: their logits are never evaluated (MLX is
                # lazy), so the output layer runs for one row, as in mlx-lm's own prefill.
                for start in range(0, n - 1, PREFILL_CHUNK):
                    self.model(mx.array([tokens[start : min(start + PREFILL_CHUNK, n - 1)]]), cache=self.cache)
                    mx.eval([c.state for c in self.cache])
                tokens = tokens[-1:]
            rows = [self.model(mx.array([tokens[s : s + PREFILL_CHUNK]]), cache=self.cache)[0]
                    for s in range(0, len(tokens), PREFILL_CHUNK)]  # [m, V] each
            res = rows[0] if len(rows) == 1 else mx.concatenate(rows)
            out = np.array(res.astype(mx.float32))
        self._valid = None  # every layer now holds every position
        return out

    def rollback(self, n_past: int) -> None:
        cur = self.n_past
        if n_past > cur or n_past < 0:
            raise ValueError(f"cannot roll back to {n_past}: cache holds {cur} positions")
        if n_past == 0:  # a fresh cache: always possible, whatever state the old one was left in
            self.cache = self._new_cache()
            self._valid = None
            return
        over = [c for c in self.cache if c.offset > n_past]
        for c in over:
            if not c.is_trimmable():
                raise OndeviceError(
                    f"{self.path.name}: its {type(c).__name__} has wrapped around its window; rolling back would "
                    f"give wrong logits, so it is refused (use a context no longer than the window)"
                )
        for c in over:
            c.trim(c.offset - n_past)
        self._valid = None

    def close(self) -> None:
        self.cache = []
        self.model = None
        try:
            self._mx.clear_cache()
        except AttributeError:  # older mlx
            pass
