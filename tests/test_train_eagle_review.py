"""Review of ``train-heads`` (EAGLE kind) as a user drives it: damaged work files, bad arguments, a damaged
drafter beside the model. Fast: no training run here (``test_train_eagle`` trains)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from converters.eagle3 import convert_eagle3
from ondevice.errors import OndeviceError

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


@pytest.mark.parametrize("bad", [dict(epochs=0), dict(draft_dtype="q4_k"), dict(lr=0.0), dict(lr=-1e-3), dict(lr=float("nan")), dict(noise=-0.1),
                                 dict(batch_tokens=0), dict(depths=0), dict(vocab=0)])
def test_bad_settings_are_refused_before_any_work(tmp_path, monkeypatch, bad):
    """epochs=0 used to store an untrained drafter; the others failed (or trained nothing) after the recording."""
    from ondevice.heads import eagle_train

    monkeypatch.setenv("ONDEVICE_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(eagle_train.train, "record_answers", lambda *a, **k: pytest.fail("recorded"))
    name = next(iter(bad))
    with pytest.raises(OndeviceError, match=rf"^{name}=") as e:
        eagle_train.train_eagle(tmp_path / "no-such.gguf", tokens=1500, convert=convert_eagle3, **bad)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "home").exists()


def test_draft_dtype_is_read_as_llama_cpp_spells_it(tmp_path, monkeypatch):
    """``--draft-dtype Q4_0`` (llama.cpp's and file names' spelling) is q4_0: the run goes on to the model."""
    from ondevice.heads import eagle_train

    monkeypatch.setenv("ONDEVICE_HOME", str(tmp_path / "home"))
    with pytest.raises(OndeviceError) as e:
        eagle_train.train_eagle(tmp_path / "no-such.gguf", tokens=1500, convert=convert_eagle3, draft_dtype="Q4_0")
    assert "no-such.gguf: no such file" in str(e.value)  # the check passed; the model is what is missing


def test_a_target_without_layer_inputs_is_refused_with_the_way_out(tiny_gguf, tmp_path, monkeypatch):
    """A target whose graph does not hand out its layer inputs (the backend's one-line refusal): one line, before
    any recording, naming what does work for that model (the Medusa heads)."""
    from ondevice.backends.llama import LlamaBackend
    from ondevice.heads import eagle_train

    def refuse(self, ids):
        raise OndeviceError(f"{self.path.name}: architecture 'x' does not expose its layer inputs in this llama.cpp")

    monkeypatch.setenv("ONDEVICE_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(LlamaBackend, "enable_layer_inputs", refuse)
    with pytest.raises(OndeviceError, match="layer inputs") as e:
        eagle_train.train_eagle(tiny_gguf("llama"), tokens=1500, threads=1, quiet=True, convert=convert_eagle3)
    assert "\n" not in str(e.value) and "--kind medusa" in str(e.value)
    assert not (tmp_path / "home" / "heads" / "work").exists()


def test_a_target_the_converter_refuses_is_refused_before_any_work(tiny_gguf, tmp_path, monkeypatch):
    """The converter reads the target (vocabulary, hidden size, layers) only after the fit; ``target_info`` asks it
    first, so its refusal comes before the recording, not hours later."""
    from ondevice.heads import eagle_train

    seen = []

    def refuse(path):
        seen.append(Path(path).name)
        raise OndeviceError(f"{Path(path).name}: tokenizer 'x' is not supported")

    monkeypatch.setenv("ONDEVICE_HOME", str(tmp_path / "home"))
    with pytest.raises(OndeviceError, match="tokenizer 'x'"):
        eagle_train.train_eagle(tiny_gguf("llama"), tokens=1500, threads=1, quiet=True, convert=convert_eagle3,
                                target_info=refuse)
    assert seen == ["model.gguf"] and not (tmp_path / "home" / "heads" / "work").exists()


@pytest.mark.parametrize("layers", [[1, 2], [1, 2, 99], [0, 1, 2], [1.0, 1, 1], [1.5, 1, 1], "111", 1, [True, 1, 1]])
def test_bad_fused_layers_are_refused_before_any_work(tiny_gguf, tmp_path, monkeypatch, layers):
    """``layers`` (the 3 target layers fed to fc) outside 1 .. L−1, not 3 of them, or not integers (a float was
    truncated, a string read digit by digit): one line naming the range."""
    from ondevice.heads import eagle_train

    monkeypatch.setenv("ONDEVICE_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(eagle_train.train, "record_answers", lambda *a, **k: pytest.fail("recorded"))
    with pytest.raises(OndeviceError, match=r"^layers=.*between 1 and") as e:
        eagle_train.train_eagle(tiny_gguf("llama"), tokens=1500, threads=1, quiet=True, convert=convert_eagle3,
                                layers=layers)
    assert "\n" not in str(e.value) and not (tmp_path / "home" / "heads" / "work").exists()


def test_fused_layers_are_distinct_and_ascending():
    """fc_top puts the identity on the last block, the "highest" fused layer only when the list ascends (and EAGLE-3
    runtimes concatenate the aux layers in forward order); a repeated layer fuses the same feature twice. Both are
    refused in one line; numpy ints and tuples are taken as ints; a target of < 4 layers has fewer than 3 to pick."""
    from ondevice.heads import eagle

    assert eagle.fused_layers(None, 28) == [2, 14, 25]
    got = eagle.fused_layers(np.array([2, 14, 27]), 28)
    assert got == [2, 14, 27] and all(type(i) is int for i in got)
    assert eagle.fused_layers((2, 14, 27), 28) == [2, 14, 27]
    assert eagle.fused_layers([1, 1, 1], 2) == eagle.fused_layers(None, 2) == [1, 1, 1]
    for bad in ([14, 14, 14], [25, 14, 2], [2, 14, 14], [2, 25, 14]):
        with pytest.raises(OndeviceError, match=r"^layers=\[.*ascending") as e:
            eagle.fused_layers(bad, 28, "m.gguf")
        assert "\n" not in str(e.value) and "m.gguf has 28 layers" in str(e.value)


def test_a_budget_of_one_answer_is_refused_not_measured_on_its_training_data(tiny_gguf, tmp_path, monkeypatch):
    """One answer leaves none to hold out: τ labelled held-out would be measured on the training answer itself."""
    import shutil

    from ondevice.heads import eagle_train

    target = tmp_path / "tiny.gguf"
    shutil.copy(tiny_gguf("llama"), target)
    monkeypatch.setenv("ONDEVICE_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(eagle_train.eagle, "make_step", lambda *a, **k: pytest.fail("fitted on one answer"))
    with pytest.raises(OndeviceError, match="at least 2") as e:
        eagle_train.train_eagle(target, tokens=5, vocab=256, depths=3, max_new=64, threads=1, n_ctx=512, quiet=True,
                                convert=convert_eagle3)
    assert "\n" not in str(e.value) and "tokens=5" in str(e.value)


def _untrained_drafter(target: Path, meta: dict) -> Path:
    """An EAGLE-style drafter for ``target`` at its initial weights, stored where ``train-heads`` puts it, with
    ``meta`` (no training: conversion only)."""
    from ondevice.formats.gguf import GGUFFile
    from ondevice.heads import eagle, eagle_store, store, train
    from ondevice.heads.eagle_train import _norm_row, shape_for

    cfg = GGUFFile(target).config()
    V = int(cfg["vocab_size"])
    ids = np.arange(min(64, V))
    shape = shape_for(cfg, len(ids))
    params = eagle.init(shape, train.target_rows(target, ids)[0], _norm_row(target), 0)
    dest = eagle_store.default_path(target)
    dest.parent.mkdir(parents=True, exist_ok=True)
    ckpt = eagle_store.save_checkpoint(target.parent / "ckpt", params, shape.config(V, [1, 1, 0]), ids)
    eagle_store.write_gguf(ckpt, target, dest, {"target_sha256": store.target_sha256(target), **meta}, convert_eagle3)
    return dest


@pytest.mark.parametrize("depths,gamma", [(4, 4), (2, 2), (5, 5), (8, 5)])
def test_auto_reads_the_tau_of_a_drafter_trained_for_any_depth(tiny_gguf, tmp_path, monkeypatch, depths, gamma):
    """τ is stored for chains of 3 and 5, each replayed with at most ``depths`` drafts: a drafter trained for 4
    (or 2) depths has a τ for ``draft="auto"`` (it read tau_chain4, absent, and said none was recorded)."""
    import shutil

    import ondevice
    from ondevice import autodraft

    target = tmp_path / "tiny.gguf"
    shutil.copy(tiny_gguf("llama"), target)
    monkeypatch.setenv("ONDEVICE_HOME", str(tmp_path / "home"))
    path = _untrained_drafter(target, {"depths": depths, "tau_heldout": {"tau_chain3": 1.5, "tau_chain5": 1.7}})
    with ondevice.load(target, drafter="none", threads=1, n_ctx=256) as rt:
        row = autodraft._eagle_row(rt.target, path)
    assert row["ok"], row
    assert f"at γ {gamma} " in row["reason"] and row["best_gamma"] <= gamma
    tau = 1.5 if depths < 4 else 1.7
    assert row["assumed_acceptance"] == round(autodraft.alpha_from_tau(tau, gamma), 3)


@pytest.mark.parametrize("meta", [{"depths": "five", "tau_heldout": {"tau_chain3": 1.5}},
                                  {"depths": 3, "tau_heldout": {"tau_chain3": "fast"}},
                                  {"depths": 3, "tau_heldout": ["tau_chain3", 1.5]},
                                  {"depths": -2, "tau_heldout": {"tau_chain3": 1.5}}])
def test_auto_turns_a_drafter_with_malformed_metadata_into_a_verdict(tiny_gguf, tmp_path, monkeypatch, meta):
    """The drafter file is untrusted input: odd values in its metadata make its row unusable, not a traceback."""
    import shutil

    import ondevice
    from ondevice import autodraft

    target = tmp_path / "tiny.gguf"
    shutil.copy(tiny_gguf("llama"), target)
    monkeypatch.setenv("ONDEVICE_HOME", str(tmp_path / "home"))
    path = _untrained_drafter(target, meta)
    with ondevice.load(target, drafter="none", threads=1, n_ctx=256) as rt:
        row = autodraft._eagle_row(rt.target, path)
    assert not row["ok"] and "drafter file" in row["reason"] and "\n" not in row["reason"]


def test_info_shows_a_drafter_with_malformed_metadata(tiny_gguf, tmp_path, monkeypatch):
    """``ondevice info`` / ``models`` (``eagle_store.stored`` + ``describe``) on odd metadata: a line, no traceback."""
    import shutil

    from ondevice.heads import eagle_store

    target = tmp_path / "tiny.gguf"
    shutil.copy(tiny_gguf("llama"), target)
    monkeypatch.setenv("ONDEVICE_HOME", str(tmp_path / "home"))
    path = _untrained_drafter(target, {"depths": 3, "tau_heldout": ["tau_chain5", 2.0]})
    shown = eagle_store.stored(target)
    assert shown["kind"] == "eagle" and str(path) in eagle_store.describe(shown)
    assert (shown.get("tau_heldout") or {}).get("tau_chain5") is None  # what the `models` table reads


def test_features_of_an_answer_longer_than_the_context_are_read_back(tmp_path):
    """An answer cut at the features' context (n_ctx) is read back on a rerun, not computed again every time."""
    from ondevice.heads import eagle_data
    from ondevice.heads.data import Record

    recs = [Record(np.arange(5, 80), np.zeros((75, 4), np.float32), np.arange(1, 6), "code")]  # 79 > n_ctx 64
    be = _FakeBackend()
    first = eagle_data.collect(be, recs, tmp_path)
    again = eagle_data.collect(be, recs, tmp_path)
    assert be.evals == 1 and len(again[0].tokens) == len(first[0].feats) == be.n_ctx


def test_heads_on_a_target_without_layer_inputs_is_the_medusa_kind(tiny_gguf, tmp_path, monkeypatch):
    """``draft="heads"`` reads the EAGLE-style file only on a target that declares layer inputs (its
    ``Backend.features``); elsewhere (MLX, Core ML) it is the Medusa heads' verdict, whatever file lies there (every
    Backend has ``enable_layer_inputs``, which raises: asking ``hasattr`` picked the EAGLE file everywhere)."""
    import shutil

    from ondevice.backends.base import Backend
    from ondevice.drafters.registry import Build, _heads

    target = tmp_path / "tiny.gguf"
    shutil.copy(tiny_gguf("llama"), target)
    monkeypatch.setenv("ONDEVICE_HOME", str(tmp_path / "home"))
    _untrained_drafter(target, {"depths": 3})

    class NoLayerInputs(Backend):
        features = frozenset({"hidden"})

        def __init__(self, path):
            self.path = path

    with pytest.raises(OndeviceError, match="no heads trained for this model"):
        _heads(Build(target=NoLayerInputs(target)))


def test_a_quantized_drafter_for_an_mlx_target_is_refused_before_any_work(tiny_mlx, tmp_path, monkeypatch):
    """An MLX target runs its drafter from the f16 GGUF (``mlx_eagle3``): q4_0 is refused before the recording."""
    from ondevice.heads import eagle_train

    monkeypatch.setenv("ONDEVICE_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(eagle_train.train, "record_answers", lambda *a, **k: pytest.fail("recorded"))
    with pytest.raises(OndeviceError, match=r"an MLX target runs its drafter from an f16 GGUF; use f16 \(--draft-dtype f16"):
        eagle_train.train_eagle(tiny_mlx("llama"), tokens=1500, convert=convert_eagle3, draft_dtype="q4_0")
