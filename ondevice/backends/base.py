"""The backend contract: one model with a KV cache, fed token ids, returning logits (never sampling).

Implementations (``llama``, ``mlx``, ``coreml``, ``mil``, ``static``, the sharded MLX target) subclass
``Backend``; every member a caller uses is declared here, with a default where one makes sense.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import numpy as np

from ondevice.errors import OndeviceError


class Backend:
    """One model with a KV cache, fed token ids, returning logits.

    Attributes:
        path: the model file or directory.
        vocab_size: rows of the output layer (logits width).
        n_ctx: the context length the cache was created with.
        add_bos / bos_id: whether a prompt starts with BOS, and which id.
        chat_template: the model's jinja chat template, if any.
        chunk: tokens a pass is padded to (a fixed-shape Core ML / MIL prefill runs any batch up to it as one);
            1 for backends whose cost grows with every token.
        threads, device: what the backend runs with (part of the key of its measured costs).
        kernels: the library build and kernel set that compute its passes (also part of that key: a rebuilt
            llama.cpp, or one loaded without its repacked kernels, has another verify curve).
    """

    path: Path
    vocab_size: int
    n_ctx: int
    add_bos: bool
    bos_id: int | None
    chat_template: str | None
    chunk: int = 1
    threads: int | None = None
    device: str | None = None
    kernels: str = ""

    @property
    def n_past(self) -> int:
        """Tokens currently in the KV cache."""
        raise NotImplementedError

    def is_eog(self, token: int) -> bool:
        """Does ``token`` end generation (EOS, EOT, or any other end-of-generation id)?"""
        raise NotImplementedError

    def tokenize(self, text: str, *, add_bos: bool = True, special: bool = True) -> list[int]:
        """Text → ids (BOS only if ``add_bos`` and the model asks for it; special tokens parsed if ``special``)."""
        raise NotImplementedError

    def token_bytes(self, token: int) -> bytes:
        """The bytes one token stands for (special tokens render as their text)."""
        raise NotImplementedError

    def vocab_tokens(self) -> list[str]:
        """Every token's text, in id order (for pair checks)."""
        raise NotImplementedError

    def eval(self, tokens: Sequence[int], logits: Literal["all", "last"] = "all") -> np.ndarray:
        """Append ``tokens`` to the cache in one batch.

        Returns:
            [n, vocab_size] float32 logits, row i scoring the token after tokens[i]
            ([1, vocab_size] for ``logits="last"``).
        """
        raise NotImplementedError

    def rollback(self, n_past: int) -> None:
        """Drop cached positions >= n_past; raise when that cannot be done exactly."""
        raise NotImplementedError

    def close(self) -> None:
        """Free native memory; idempotent."""
        raise NotImplementedError

    # What a target pass can hand a drafter (``ondevice.drafters.base.Traits.needs``): "hidden", the post-norm
    # hidden state of each row kept (heads); "layer_inputs", the inputs of chosen target layers of every token
    # (EAGLE-3, after ``enable_layer_inputs``); "nextn", the model's own MTP head fed every pass (``mtp``).
    features: frozenset[str] = frozenset()

    def mtp(self):
        """The model's own MTP head (``ondevice.backends.llama_mtp.MtpHead``) after ``enable_features({"nextn"})``;
        raises ``OndeviceError`` where the backend has none (the default)."""
        raise OndeviceError(f"{Path(self.path).name}: {type(self).__name__} runs no MTP heads (a GGUF with MTP layers "
                            "on llama.cpp does)")

    def enable_layer_inputs(self, ids: list[int]) -> int:
        """Record the inputs of layers ``ids`` of every token each later ``eval`` passes (``feature("layer_inputs",
        pos)`` reads them, concatenated); returns a row's width. Raises ``OndeviceError`` where the backend
        cannot (the default)."""
        raise OndeviceError(f"{Path(self.path).name}: EAGLE-3 / DFlash drafts need a llama.cpp (GGUF) or MLX "
                            f"target that records its layer inputs; {type(self).__name__} does not")

    def eagle3_draft(self, path, layer_inputs_on, threads: int | None = None, n_ctx: int | None = None):
        """The runner of the EAGLE-3 draft GGUF ``path`` on this target (``Eagle3Drafter``'s graph: ``encode`` /
        ``decode`` / ``rollback`` / ``n_past``), checked against it; it calls ``layer_inputs_on(layer_ids)`` once
        checked, which switches the target's layer inputs on. ``n_ctx``: the draft cache's positions (default: the
        target's). Raises ``OndeviceError`` where the backend has none."""
        raise OndeviceError(f"{Path(self.path).name}: {type(self).__name__} runs no EAGLE-3 drafts (llama.cpp and MLX "
                            "targets do)")

    def dflash_draft(self, path, layer_inputs_on, threads: int | None = None):
        """The runner of the DFlash draft GGUF ``path`` on this target (``DFlashDrafter``'s graph: ``observe`` /
        ``block`` / ``rollback`` / ``n_past`` / ``max_draft``), checked against it; it calls
        ``layer_inputs_on(layer_ids)`` once checked, which switches the target's layer inputs on. Raises
        ``OndeviceError`` where the backend has none (the default)."""
        raise OndeviceError(f"{Path(self.path).name}: {type(self).__name__} runs no DFlash drafts (llama.cpp and MLX "
                            "targets that record layer inputs do)")

    def release_features(self, before: int) -> None:
        """Kept feature rows of positions below ``before`` are no longer needed (a memory hint)."""

    def enable_features(self, needs: frozenset[str]) -> dict[str, int]:
        """Switch on what a drafter reads from each pass; returns each feature's row size. Raises
        ``OndeviceError`` naming the first this backend cannot give."""
        out = {}
        for name in sorted(needs):
            if name == "hidden":
                out[name] = self.enable_hidden()
            else:
                raise OndeviceError(f"{Path(self.path).name}: {type(self).__name__} cannot give a drafter {name!r} "
                                    f"(it gives: {', '.join(sorted(self.features)) or 'nothing'})")
        return out

    def keep_features(self, on: bool) -> None:
        """After ``enable_features``: whether the next evals keep them (a cost hint; off for steps whose next
        step will not draft)."""
        self.want_hidden(on)

    def feature(self, name: str, pos: int) -> np.ndarray | None:
        """The row of feature ``name`` at absolute position ``pos`` from the last ``eval`` (None: not kept)."""
        return self.hidden(pos) if name == "hidden" else None

    def enable_hidden(self) -> int:
        """Keep the post-norm hidden state of the rows each later ``eval`` outputs (heads drafting reads them);
        returns its size. Raises ``OndeviceError`` where the backend cannot (the default)."""
        raise OndeviceError(f"{Path(self.path).name}: heads need a llama.cpp (GGUF) or MLX target that returns hidden states")

    def want_hidden(self, on: bool) -> None:
        """After ``enable_hidden``: whether the next evals keep hidden rows (a cost hint; the default keeps them)."""

    _hidden: tuple[int, np.ndarray] | None = None  # (first position, rows) of the last eval that kept them

    def hidden(self, pos: int) -> np.ndarray | None:
        """[hidden size] float32 state at absolute position ``pos`` from the last ``eval``, or None when that
        eval did not output it or the cache no longer holds it (what it holds since is unchanged, so the
        row is still the model's state for the cached prefix)."""
        h = self._hidden
        if h is None or not h[0] <= pos < h[0] + len(h[1]) or pos >= self.n_past:
            return None
        return h[1][pos - h[0]]

    def tree_unsupported(self) -> str | None:
        """Why this backend cannot verify a token tree in one pass, or None when it can: then it has
        ``eval_tree(tokens, parents) -> logits[n, V]`` and ``keep_path(path)`` (see ``ondevice.tree``)."""
        return f"{type(self).__name__} has no tree pass (eval_tree/keep_path)"


def check_room(n_past: int, n: int, n_ctx: int, path: Path) -> None:
    """Refuse to evaluate ``n`` more tokens when the cache cannot hold them."""
    if n == 0:
        raise ValueError("eval needs at least one token")
    if n_past + n > n_ctx:
        raise OndeviceError(
            f"context overflow: {n_past + n} tokens exceed n_ctx={n_ctx} of {Path(path).name}; raise n_ctx or shorten the prompt"
        )


class KeptLayerRows:
    """Mixin of the backends that record layer inputs (``LlamaFeatures``, ``MLXLayerInputs``): the rows kept per
    cached position, ``_layer_rows[i]`` for position ``_layer_pos0 + i``."""

    _layer_ids: list[int] | None = None  # layers whose inputs are recorded (``enable_layer_inputs``)
    _layer_pos0 = 0  # position of _layer_rows[0]
    _layer_rows: list

    def release_features(self, before: int) -> None:
        """Drop kept rows of positions below ``before`` (the drafter has consumed them)."""
        if self._layer_ids is not None and before > self._layer_pos0:
            k = min(before - self._layer_pos0, len(self._layer_rows))
            del self._layer_rows[:k]
            self._layer_pos0 += k
