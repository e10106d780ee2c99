"""Review of ``train-heads`` (EAGLE kind) as a user drives it: damaged work files, bad arguments, a damaged
drafter beside the model. Fast: no training run here (``test_train_eagle`` trains)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("jax")


class _FakeBackend:
    """What ``eagle_data.features_of`` reads: a prefill's logits and one layer-input row per token."""

    n_ctx = 64

    def __init__(self):
        self.evals = 0

    def rollback(self, n):
        pass

    def eval(self, tokens, logits="all"):
        self.evals += 1
        return np.random.default_rng(len(tokens)).normal(size=(len(tokens), 20)).astype(np.float32)

    def feature(self, name, i):
        return np.full(6, i, np.float32)

    def release_features(self, n):
        pass


def _damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "empty":
        path.write_bytes(b"")
    else:  # a flipped byte inside an array: the zip's CRC check fails on reading
        b = bytearray(data)
        b[len(b) // 3] ^= 0xFF
        path.write_bytes(bytes(b))


@pytest.mark.parametrize("how", ["truncated", "empty", "flipped"])
def test_a_damaged_feature_file_is_computed_again(tmp_path, how):
    """A feature file damaged outside the run (disk full, a copy cut short) is recomputed, not a traceback."""
    from ondevice.heads import eagle_data
    from ondevice.heads.data import Record

    recs = [Record(np.arange(5, 12), np.zeros((7, 4), np.float32), np.arange(1, 6), "code")]
    be = _FakeBackend()
    first = eagle_data.collect(be, recs, tmp_path)
    path = tmp_path / "seq-00000.npz"
    _damage(path, how)
    again = eagle_data.collect(be, recs, tmp_path)
    assert be.evals == 2 and np.array_equal(again[0].feats, first[0].feats)
    assert eagle_data.load(path) is not None  # written back whole


@pytest.mark.parametrize("how", ["truncated", "empty", "flipped"])
def test_a_damaged_fit_checkpoint_starts_the_fit_over(tmp_path, how):
    from ondevice.heads import eagle
    from ondevice.heads.eagle_train import _load_state, _save_state

    params = {"a": np.ones((64, 64), np.float32), "b": np.zeros(64, np.float32)}
    path = tmp_path / "eagle-fit-x.npz"
    _save_state(path, params, eagle.zeros_like(params), {"epoch": 2, "log": [], "best": 1.5})
    assert _load_state(path, params)[2]["epoch"] == 2
    _damage(path, how)
    assert _load_state(path, params) is None
