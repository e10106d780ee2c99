"""Sliding-window attention (Gemma 3 270M, 253 MB, marked slow): rollback across the window is exact."""

from __future__ import annotations

import numpy as np
import pytest

from ondevice.backends.llama import LlamaBackend
from ondevice.store import fetch

pytestmark = pytest.mark.slow


def test_rollback_across_the_sliding_window_is_exact():
    path = fetch.pull("gemma3-270m", quiet=True)
    b = LlamaBackend(path, n_ctx=2048)
    assert b.n_swa > 0
    w = b.n_swa
    ids = (b.tokenize("The quick brown fox jumps over the lazy dog. ", add_bos=False) * 400)[: w + 200]
    ids = [b.bos_id, *ids] if b.bos_id is not None else ids
    b.eval(ids[: w + 60], logits="last")
    b.eval(ids[w + 60 : w + 150])  # the window slides past positions 60..149
    b.rollback(w + 60)  # back: the next token attends to [60, w + 60) again
    after = b.eval(ids[w + 150 : w + 160])
    b.close()
    f = LlamaBackend(path, n_ctx=2048)
    f.eval(ids[: w + 60], logits="last")
    ref = f.eval(ids[w + 150 : w + 160])
    f.close()
    assert np.array_equal(after, ref)
