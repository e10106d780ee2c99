"""``parallel="auto"`` / ``serve --parallel auto``: the slot count comes from the machine's measured batch curve
(``ondevice.batch_curve``), cached per model file, threads and build; a bad ``parallel`` fails in one line."""

from __future__ import annotations

import json

import pytest

import ondevice
from ondevice import batch_curve
from ondevice.batch_load import parallel_option
from ondevice.batching import BatchEngine
from ondevice.errors import OndeviceError


def test_parallel_option_takes_a_count_or_auto():
    assert [parallel_option(v) for v in (1, 4, "8", " auto ", "AUTO")] == [1, 4, 8, "auto", "auto"]
    for bad in (0, 65, "x", "2.5", 2.5, True, "-1", None):
        with pytest.raises(OndeviceError, match=r"parallel=.*whole number of slots from 1 to 64, or auto"):
            parallel_option(bad)
    with pytest.raises(OndeviceError, match=r"^--parallel 0: give a whole number"):
        parallel_option("0", "--parallel")


def test_choose_slots_takes_the_fewest_near_the_best_gain():
    # gains 1, 1.9, 1.82: 2 slots are near the best; 4 add memory and slower steps for nothing
    assert batch_curve.choose_slots({1: 1.0, 2: 1.05, 4: 2.2}) == 2
    # gains 1, 1.67, 2.0: the best
    assert batch_curve.choose_slots({1: 1.0, 2: 1.2, 4: 2.0}) == 4
    # gains 1, 1.05, 1.1: batching does not pay: one slot (which keeps speculation)
    assert batch_curve.choose_slots({1: 1.0, 2: 1.9, 4: 3.64}) == 1
    assert batch_curve.plausible({1: 1.0, 2: 1.2, 4: 2.0})
    assert not batch_curve.plausible({1: 1.0, 2: 0.1, 4: 2.0})  # a stalled probe
    assert not batch_curve.plausible({1: 1.0, 2: 1.2, 4: 40.0})


def test_measure_times_every_count_and_empties_the_sequences(tiny_gguf):
    from ondevice.backends.llama import LlamaBackend

    b = LlamaBackend(tiny_gguf("llama"), n_ctx=128 * 4, threads=1, n_seq_max=4, kv_unified=False)
    try:
        curve = batch_curve.measure(b, reps=2, attempts=1)
        assert set(curve) == set(batch_curve.BATCH_KS) and all(t > 0 for t in curve.values())
        assert all(b.seq_len(s) == 0 for s in range(4))
    finally:
        b.close()


def test_auto_loads_the_chosen_slots_and_caches_the_curve(tiny_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("ONDEVICE_HOME", str(tmp_path))
    path = tiny_gguf("llama")
    calls = []

    def planted(target, **kw):
        calls.append(target.n_seq_max)
        return {1: 1.0, 2: 1.2, 4: 2.0}  # 4 slots

    monkeypatch.setattr(batch_curve, "measure", planted)
    with ondevice.load(path, drafter="none", n_ctx=256, threads=1, parallel="auto") as rt:
        assert rt.parallel == 4 and rt.target.n_seq_max == 4 and not rt.target.kv_unified
        assert rt.batch_curve == {1: 1.0, 2: 1.2, 4: 2.0}
        want = BatchEngine(rt).generate_many(["one two", "three four"], max_tokens=6, temperature=0)
    assert calls == [4]
    cache = json.loads((tmp_path / "batch_costs.json").read_text())
    assert list(cache.values()) == [{"1": 1.0, "2": 1.2, "4": 2.0}]
    monkeypatch.setattr(batch_curve, "measure", lambda *a, **k: pytest.fail("measured again"))
    with ondevice.load(path, drafter="none", n_ctx=256, threads=1, parallel="auto") as rt:  # read from the cache
        assert rt.parallel == 4
        assert [r.tokens for r in BatchEngine(rt).generate_many(["one two", "three four"], max_tokens=6,
                                                                 temperature=0)] == [r.tokens for r in want]
    monkeypatch.setattr(batch_curve, "measure", planted)
    with ondevice.load(path, drafter="none", n_ctx=256, threads=2, parallel="auto") as rt:  # another key: measured
        assert rt.parallel == 4
    assert calls == [4, 4] and len(json.loads((tmp_path / "batch_costs.json").read_text())) == 2


def test_auto_serves_one_at_a_time_where_batching_does_not_pay(tiny_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("ONDEVICE_HOME", str(tmp_path))
    monkeypatch.setattr(batch_curve, "measure", lambda target, **kw: {1: 1.0, 2: 1.9, 4: 3.64})
    with ondevice.load(tiny_gguf("llama"), drafter="none", n_ctx=256, threads=1, parallel="auto") as rt:
        assert rt.parallel == 1 and rt.target.kv_unified  # the usual one-sequence runtime
        with pytest.raises(OndeviceError, match="not loaded for parallel slots"):
            BatchEngine(rt)
