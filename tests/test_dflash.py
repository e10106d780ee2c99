"""Feasibility of DFlash block drafters through llama.cpp's own ``dflash`` graph (ondevice.backends.llama_dflash)
on a tiny random DFlash draft (ondevice.testing.dflash) beside a tiny qwen35 target (its graph records layer
inputs): a block drafts from the injected target features, and the draft cache follows verify / rollback
exactly as a fresh run would."""

from __future__ import annotations

import numpy as np
import pytest

from ondevice.errors import OndeviceError
from ondevice.testing.dflash import make_tiny_dflash_gguf
from ondevice.testing.mtp import MtpShape, make_tiny_mtp_gguf

PROMPT = [5, 77, 301, 12, 9, 140, 260, 33, 400, 18, 71, 222]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("dflash")
    return make_tiny_mtp_gguf(d / "target.gguf", "qwen35", seed=5), make_tiny_dflash_gguf(d / "draft.gguf", seed=6)


def _pair(files):
    from ondevice.backends.llama_dflash import DFlashDrafter
    from ondevice.backends.llama_mtp_target import MtpTarget

    t = MtpTarget(files[0], n_ctx=256, threads=2, n_batch=64, nextn=False)
    return t, DFlashDrafter(files[1], t._model, t._ctx, n_ctx=256, threads=2, n_batch=64)


def _eval(t, d, tokens):
    from ondevice.backends.llama_dflash import observe_target

    pos0 = t.n_past
    logits = t.eval(tokens)
    observe_target(d, tokens, pos0)
    return logits


def test_block_drafts_from_the_injected_target_features(files):
    t, d = _pair(files)
    try:
        assert d.layers == [0, 1] and d.block_size == 4 and d.mask_id == 511
        bonus = int(np.argmax(_eval(t, d, PROMPT)[-1]))
        q = d.draft(bonus, 3)
        assert q.shape == (3, 512) and np.isfinite(q).all() and d.n_past == len(PROMPT)
        np.testing.assert_array_equal(d.draft(bonus, 3), q)  # the block left nothing behind
        with pytest.raises(OndeviceError, match="drafts 1..3 tokens"):
            d.draft(bonus, 4)
        d.rollback(0)  # the features are what it reads: without them the block drafts otherwise
        assert np.abs(d.draft(bonus, 3) - q).max() > 1e-2
    finally:
        d.close()
        t.close()


def test_draft_cache_follows_verify_and_rollback_like_a_fresh_run(files):
    t, d = _pair(files)
    try:
        bonus = int(np.argmax(_eval(t, d, PROMPT)[-1]))
        drafted = [int(x) for x in np.argmax(d.draft(bonus, 3), axis=1)]
        verify = _eval(t, d, [bonus, *drafted])
        t.rollback(len(PROMPT) + 2)
        d.rollback(len(PROMPT) + 2)
        nxt = int(np.argmax(verify[1]))
        q_again = d.draft(nxt, 3)
    finally:
        d.close()
        t.close()
    t, d = _pair(files)
    try:
        _eval(t, d, [*PROMPT, bonus, drafted[0]])
        q_want = d.draft(nxt, 3)
    finally:
        d.close()
        t.close()
    np.testing.assert_allclose(q_again, q_want, rtol=1e-4, atol=1e-4 * np.abs(q_want).max())


def test_a_draft_for_another_vocabulary_is_refused_in_one_line(files, tmp_path):
    from ondevice.backends.llama_dflash import DFlashDrafter
    from ondevice.backends.llama_mtp_target import MtpTarget

    other = make_tiny_mtp_gguf(tmp_path / "other.gguf", "qwen35", shape=MtpShape(vocab_size=768))
    t = MtpTarget(other, n_ctx=256, threads=2, n_batch=64, nextn=False)
    try:
        with pytest.raises(OndeviceError, match="made for another target") as e:
            DFlashDrafter(files[1], t._model, t._ctx, n_ctx=256, threads=2)
        assert "\n" not in str(e.value)
    finally:
        t.close()


def test_a_draft_without_its_own_embeddings_reads_the_targets(files, tmp_path):
    """Published DFlash drafts ship no embeddings / LM head: llama.cpp reads the target's via ctx_other."""
    from ondevice.backends.llama_dflash import DFlashDrafter
    from ondevice.backends.llama_mtp_target import MtpTarget

    shared = make_tiny_dflash_gguf(tmp_path / "shared.gguf", seed=6, own_head=False)
    t = MtpTarget(files[0], n_ctx=256, threads=2, n_batch=64, nextn=False)
    d = DFlashDrafter(shared, t._model, t._ctx, n_ctx=256, threads=2, n_batch=64)
    try:
        bonus = int(np.argmax(_eval(t, d, PROMPT)[-1]))
        q = d.draft(bonus, 3)
        assert q.shape == (3, 512) and np.isfinite(q).all()
    finally:
        d.close()
        t.close()
    t, d = _pair(files)  # same layers and seed, its own head: other logits, so the target's head was read
    try:
        _eval(t, d, PROMPT)
        assert np.abs(d.draft(bonus, 3) - q).max() > 1e-2
    finally:
        d.close()
        t.close()
