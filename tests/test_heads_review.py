"""Review of train-heads / --draft heads as a user drives them: batched recording equal to one answer at a
time."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

import ondevice
from ondevice.backends.llama import LlamaBackend
from ondevice.heads import batch, data


@pytest.fixture(scope="module")
def target(tiny_gguf, tmp_path_factory):
    """The tiny llama target copied outside the test cache (its heads go to <home>/heads)."""
    p = tmp_path_factory.mktemp("models") / "tiny.gguf"
    shutil.copy(tiny_gguf("llama"), p)
    return p


def test_batched_answers_equal_answers_decoded_alone(target):
    """Chat prompts recorded 8 at a time (one KV buffer per sequence, each prompt prefilled on its own) are
    the answers and hidden rows one decode alone gives, bit for bit. A prefill batch mixing prompts, or one
    shared KV buffer, flipped most greedy answers of the tiny model."""
    with ondevice.load(target, drafter="none", threads=1, n_ctx=1024) as rt:
        prompts = [rt.render_chat([{"role": "user", "content": t}]) for _, t in data.train_prompts()[:12]]
    b = LlamaBackend(target, n_ctx=8 * 448, threads=1, n_seq_max=8, kv_unified=False)
    one = LlamaBackend(target, n_ctx=512, threads=1)
    try:
        assert b.n_ctx_seq >= 448 and b.tree_unsupported()
        b.enable_hidden()
        one.enable_hidden()
        got: dict[int, data.Record] = {}
        batch.generate_many(b, prompts, max_new=96, on_done=lambda i, r: got.__setitem__(i, r))
        for i, p in enumerate(prompts):
            alone = data.record_answer(one, p, 96)
            assert got[i].tokens.tolist() == alone.tokens.tolist(), i
            assert np.array_equal(got[i].hidden, alone.hidden), i
    finally:
        b.close()
        one.close()
