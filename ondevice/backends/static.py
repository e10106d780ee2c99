"""Host side of a fixed-shape model with a position-indexed KV cache (Core ML, and its numpy reference).

Such a model has two entry points of fixed width — ``decode`` (1 token) and ``prefill`` (``chunk``
tokens) — that write their tokens' keys/values at cache slots [position, position + S) and attend
causally over every slot. The cache therefore needs no trimming: ``n_past`` is the write position,
rollback moves it back, and slots past it are overwritten before any query can see them (a query at
position p reads slots ≤ p only). A short prefill tail is padded; the padding's slots lie past the
new write position, so they are garbage nobody reads.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import numpy as np

from ondevice.backends.base import check_room
from ondevice.backends.hf_vocab import HFVocab, load_tokenizer
from ondevice.errors import OndeviceError

MIN_PREFILL = 4  # below this many tokens, single-token decodes are used instead of a padded prefill


def plan(n_past: int, n: int, chunk: int, context: int, min_prefill: int = MIN_PREFILL) -> list[tuple[str, int, int]]:
    """Split ``n`` new tokens at write position ``n_past`` into calls.

    Returns:
        [(function, offset into the new tokens, count)], function 'prefill' (count ≤ chunk, padded to
        chunk) or 'decode' (count 1). A prefill is used only while its full padded width fits the cache.
    """
    calls, done = [], 0
    while done < n:
        left, pos = n - done, n_past + done
        if chunk > 1 and left >= min_prefill and pos + chunk <= context:
            count = min(left, chunk)
            calls.append(("prefill", done, count))
        else:
            count = 1
            calls.append(("decode", done, 1))
        done += count
    return calls


class StaticCacheBackend(HFVocab):
    """A ``Backend`` over ``_run(function, ids, position)``; subclasses supply the model call.

    Args:
        path: the model (for messages).
        tokenizer_dir: directory with tokenizer.json (and config.json for end-of-generation ids).
        context: cache slots the model was built with.
        chunk: the prefill function's width.
        vocab_size: logits width.
        n_ctx: the context the runtime asks for; more than ``context`` is refused with the fix.
    """

    def __init__(self, path: Path, *, tokenizer_dir: Path, context: int, chunk: int, vocab_size: int,
                 n_ctx: int | None = None) -> None:
        self.path = Path(path)
        if n_ctx is not None and n_ctx > context:
            raise OndeviceError(
                f"{self.path}: converted with a {context}-token context, n_ctx={n_ctx} asked; pass n_ctx ≤ {context} "
                f"(--n-ctx) or reconvert with --context {n_ctx}"
            )
        self.context, self.chunk, self.vocab_size = int(context), int(chunk), int(vocab_size)
        self.n_ctx = int(n_ctx or context)
        self._init_vocab(*load_tokenizer(Path(tokenizer_dir)))
        self._pos = 0

    @property
    def n_past(self) -> int:
        return self._pos

    def _run(self, function: str, ids: np.ndarray, position: int) -> np.ndarray:
        """One call of ``function`` on int32 ids [S] at ``position`` → float32 logits [S, vocab]."""
        raise NotImplementedError

    def eval(self, tokens: Sequence[int], logits: Literal["all", "last"] = "all") -> np.ndarray:
        n = len(tokens)
        check_room(self._pos, n, self.n_ctx, self.path)
        ids = np.asarray(tokens, dtype=np.int32)
        rows = []
        for function, start, count in plan(self._pos, n, self.chunk, self.context):
            width = self.chunk if function == "prefill" else 1
            call = np.zeros(width, np.int32)  # padding: id 0, in slots past the new write position
            call[:count] = ids[start : start + count]
            out = self._run(function, call, self._pos)[:count]
            self._pos += count
            if logits == "all" or start + count == n:
                rows.append(out)
        res = np.concatenate(rows) if len(rows) > 1 else rows[0]
        return np.ascontiguousarray(res[-1:] if logits == "last" else res, dtype=np.float32)

    def rollback(self, n_past: int) -> None:
        if not 0 <= n_past <= self._pos:
            raise ValueError(f"cannot roll back to {n_past}: cache holds {self._pos} positions")
        self._pos = n_past  # stale slots ≥ n_past are overwritten before any query reads them

    def close(self) -> None:
        pass


class ReferenceBackend(StaticCacheBackend):
    """The numpy reference decoder (``ondevice.formats.decoder``) behind the same host code as Core ML.

    It runs anywhere, so the position bookkeeping, padding and rollback of the Core ML backend are tested
    on Linux inside the real speculative loop; it says nothing about Core ML's own numerics.
    """

    def __init__(self, path: str | Path, *, context: int = 512, chunk: int = 64, n_ctx: int | None = None) -> None:
        from ondevice.formats.decoder import ReferenceDecoder

        self.decoder = ReferenceDecoder.from_checkpoint(path, context)
        super().__init__(Path(path), tokenizer_dir=Path(path), context=context, chunk=min(chunk, context),
                         vocab_size=self.decoder.cfg.vocab_size, n_ctx=n_ctx)

    def _run(self, function: str, ids: np.ndarray, position: int) -> np.ndarray:
        return self.decoder.run(ids, position)
