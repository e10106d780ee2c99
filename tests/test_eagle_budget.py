"""train-heads (EAGLE) sizes its epochs to a time budget when none are given (``eagle_train._budget_epochs``): the
fit step's own time per row × an epoch's rows against what is left of ``hours``; kept for a resumed run."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from ondevice.heads import eagle_data, eagle_train

PER_ROW = 2e-4  # seconds the fake step takes per padded row


def _data(n_seqs: int = 12, V: int = 50, h: int = 8):
    """Sequences of 90 and 200 tokens: windows padded to 128 and 256 rows."""
    rng = np.random.default_rng(0)
    seqs = [eagle_data.Seq(tokens=rng.integers(0, V, n), feats=rng.standard_normal((n, 3 * h)).astype(np.float16),
                           t_ids=rng.integers(0, V, (n, eagle_data.TOP)).astype(np.int32),
                           t_pr=np.full((n, eagle_data.TOP), 1.0 / eagle_data.TOP, np.float32), n_prompt=10)
            for n in [90, 200] * (n_seqs // 2)]
    inv = np.arange(V, dtype=np.int32)
    table = rng.standard_normal((V, h)).astype(np.float32)
    return seqs, inv, table


def _fake_step(calls: list):
    def step(params, opt, batch, t):
        B, L = batch["emb"].shape[:2]
        calls.append((B, L))
        time.sleep(PER_ROW * B * L * L / 128)  # a longer window costs more per row (attention)
        return params, opt, np.float32(0.0), np.zeros((1, 2))
    return step


def _size(tmp_path, seconds_left: float, calls: list, T: int = 256, batch_tokens: int = 512) -> dict:
    seqs, inv, table = _data()
    plan = eagle_data.batches(seqs, eagle_data.windows(seqs, T), T, batch_tokens, np.random.default_rng(0))
    return eagle_train._budget_epochs(tmp_path / "epochs.json", _fake_step(calls), {"w": np.zeros(3)}, seqs, plan,
                                      inv, table, seconds_left=seconds_left)


def test_epochs_fill_what_is_left_of_the_budget(tmp_path):
    seqs, _, _ = _data()
    plan = eagle_data.batches(seqs, eagle_data.windows(seqs, 256), 256, 512, np.random.default_rng(0))
    assert {L for L, _, _ in plan} == {128, 256}
    epoch = PER_ROW * sum(L * B * L / 128 for L, B, _ in plan)  # what one epoch of the fake step costs
    calls = []
    got = _size(tmp_path, seconds_left=4.5 * epoch, calls=calls)
    assert sorted(set(calls), key=lambda c: c[1]) == [calls[0], calls[2]] and calls[0] == calls[1] \
        and calls[2] == calls[3] and len(calls) == 4  # per window length: compiled, then timed
    assert got["epoch_seconds"] == pytest.approx(epoch, rel=0.25)  # timing only the longest: ~1.6x
    assert 3 <= got["epochs"] <= 5  # 4 with an exact clock; sleep() overshoots a little
    assert json.loads((tmp_path / "epochs.json").read_text()) == got


def test_the_decision_is_kept_for_a_resumed_run_and_a_damaged_one_measured_again(tmp_path):
    calls = []
    first = _size(tmp_path, seconds_left=1e9, calls=calls)
    assert first["epochs"] == eagle_train.DEFAULTS["epochs"]  # capped
    again = _size(tmp_path, seconds_left=0.0, calls=calls)  # a resumed run: less time left, same schedule
    assert again == first and len(calls) == 4
    (tmp_path / "epochs.json").write_text("{not json")
    assert _size(tmp_path, seconds_left=-5.0, calls=calls)["epochs"] == 1  # over budget already: one epoch
    assert len(calls) == 8


def test_hours_is_checked_before_any_work(tmp_path):
    from converters.eagle3 import convert_eagle3
    from ondevice.errors import OndeviceError

    for bad in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(OndeviceError, match="hours="):
            eagle_train.train_eagle(tmp_path / "no-such.gguf", hours=bad, convert=convert_eagle3)


def test_train_heads_without_epochs_fits_the_budget(tiny_gguf, tmp_path, monkeypatch):
    """No epochs given: the run sizes them (one here: the budget is spent before the fit) and says so."""
    from test_train_eagle import SMALL

    monkeypatch.setenv("ONDEVICE_HOME", str(tmp_path / "home"))
    r = eagle_train.train_eagle(tiny_gguf("llama"), out=tmp_path / "out", **{**SMALL, "epochs": None, "hours": 1e-6})
    assert r["epochs"] == 1 and len(r["log"]) == 1
    assert r["epochs_sized"]["epochs"] == 1 and r["epochs_sized"]["seconds_per_row"] \
        and all(v > 0 for v in r["epochs_sized"]["seconds_per_row"].values())  # by window length
    assert list((tmp_path / "home" / "heads" / "work").glob("*/eagle-epochs-*.json"))
