"""``ondevice train-heads`` (default kind: the EAGLE-style drafter) end to end on a tiny llama target: the stored GGUF
is what ``draft="heads"`` loads, greedy speculation with it equals plain decoding token for token, the sampled law
is the target's (chi-square at T = 0.8 with planted-bug controls that must fail), a rerun resumes, and a file made
for another model is refused in one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
from helpers import (
    exact_law,
    greedy_equal,
    plant_no_residual,
    plant_wrong_q,
    sampled_law_broken,
    sampled_law_kept,
    use_trees,
)

import ondevice
from ondevice import sampling
from ondevice.errors import OndeviceError

pytest.importorskip("jax")

PROMPTS = ["def add(a, b):", "The model draft and the target verify", "class Cache:\n    def __init__(self, n):"]
from converters.eagle3 import convert_eagle3, target_info  # noqa: E402  (the conversion step train_eagle is handed)

SMALL = dict(convert=convert_eagle3, tokens=1500, epochs=12, vocab=256, depths=3, batch_tokens=256, lr=3e-3, max_new=64, threads=1, n_ctx=512,
             quiet=True)


def _chats(n: int = 3) -> list[list[dict]]:
    """The first shipped training prompts as chats: a drafter fitted to a random-weight target's answers for a few
    seconds guesses (only) what it was trained on, so drafts are both accepted and rejected there."""
    from ondevice.heads.data import train_prompts

    return [[{"role": "user", "content": text}] for _, text in train_prompts()[:n]]
LAW = dict(temperature=0.8, top_k=6, top_p=1.0, min_p=0.0)


@pytest.fixture(scope="module")
def trained(tiny_gguf, tmp_path_factory):
    """(target, home, summary): the tiny llama target copied out of the test cache and one small run stored under
    ``home`` (its ONDEVICE_HOME)."""
    from ondevice.heads.eagle_train import train_eagle

    target = tmp_path_factory.mktemp("models") / "tiny.gguf"
    shutil.copy(tiny_gguf("llama"), target)
    home = tmp_path_factory.mktemp("home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ONDEVICE_HOME", str(home))
        r = train_eagle(target, **SMALL)
    return target, home, r


@pytest.fixture
def home(trained, monkeypatch):
    monkeypatch.setenv("ONDEVICE_HOME", str(trained[1]))
    return trained[1]


def test_the_stored_drafter_is_an_eagle3_gguf_llama_cpp_runs(trained, home):
    from ondevice.drafters.eagle3 import is_eagle3_gguf
    from ondevice.heads import eagle_store, store

    target, _, r = trained
    path = Path(r["path"])
    assert path == eagle_store.find(target) and path.parent == home / "heads" and is_eagle3_gguf(str(path))
    meta = eagle_store.read_meta(path)
    assert meta["target_sha256"] == store.target_sha256(target) and meta["draft_vocab_size"] == 256
    assert meta["training_tokens"] > 1000 and set(meta["tau_heldout"]) >= {"tau_chain3", "tau_chain5", "accept_by_depth"}
    # llama.cpp's graph computes the trained weights: to f16's tolerance before the default quantization, then q4_0's
    assert r["verify"]["ok"] and r["verify"]["f16"]["logit_rel"] < 1e-2 and r["verify"]["logit_rel"] < 0.4
    assert meta["dtype"] == "q4_0" and {t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors} >= {"Q4_0"}
    assert len(r["log"]) == SMALL["epochs"] and r["log"][-1]["loss"] < r["log"][0]["loss"]
    assert not list((home / "heads").glob(".eagle-*"))  # no temp left beside it
    shown = eagle_store.stored(target)  # what `ondevice info` / `models` show
    assert shown["kind"] == "eagle" and "EAGLE" in eagle_store.describe(shown) and str(path) in eagle_store.describe(shown)


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_greedy_with_the_trained_drafter_equals_plain(trained, home, shape):
    target = trained[0]
    with ondevice.load(target, draft="heads", threads=1) as spec, ondevice.load(target, drafter="none", threads=1) as plain:
        assert spec.drafter.name == "eagle3"
        assert spec.drafter.copies.copy_min == 2  # train-heads' drafter drafts with copies (docs/eagle.md)
        use_trees(spec.drafter, shape == "tree")
        drafted, accepted = greedy_equal(spec, plain, [*PROMPTS, *_chats()], (1, 3, 5))
        assert drafted > 0 and accepted > 0, (drafted, accepted)


def test_sampled_law_is_the_targets_and_the_controls_fail(trained, home, monkeypatch):
    """Joint law of 3 tokens at T = 0.8, top-k 6 (γ = 3) against the exact target law; a residual that does not
    subtract q, and q rows that are not the law the drafts were drawn from, must each fail the same test."""
    from ondevice.backends.llama import LlamaBackend
    from ondevice.drafters.eagle3 import Eagle3Drafter

    target = trained[0]
    with ondevice.load(target, drafter="none", threads=1) as rt:
        ids = list(rt.render_chat(_chats(1)[0]))
    b = LlamaBackend(target, n_ctx=256, threads=1)
    try:
        law = exact_law(b, ids, sampling.SamplingParams(**LAW))
    finally:
        b.close()
    n = 3000
    with ondevice.load(target, draft="heads", threads=1) as rt:
        use_trees(rt.drafter, False)  # chains: the q rows the second control plants are a chain's
        sampled_law_kept(rt, ids, law, n=n)  # both outcomes occur, so the controls can fail
        with monkeypatch.context() as mp:
            plant_no_residual(mp)
            sampled_law_broken(rt, ids, law, n=n)
        with monkeypatch.context() as mp:
            plant_wrong_q(mp, Eagle3Drafter)
            sampled_law_broken(rt, ids, law, n=n)


def test_a_rerun_resumes_and_another_models_file_is_refused(trained, home, tmp_path):
    """The same arguments again: recording, features and the fit are all read back (seconds, same τ); the file
    copied beside another model is refused by ``draft="heads"`` in one line."""
    import time

    from ondevice.heads import eagle_store
    from ondevice.heads.eagle_train import train_eagle

    target, home, r = trained
    work = [p for p in (home / "heads" / "work").rglob("*.npz") if p.name.startswith(("rec-", "seq-"))]
    stamps = {p: p.stat().st_mtime_ns for p in work}
    t0 = time.perf_counter()
    again = train_eagle(target, **SMALL)
    assert again["tau_heldout"] == r["tau_heldout"] and again["record_seconds"] < 5
    assert again["log"] == r["log"] and again["fit_seconds"] < 2  # the fit read back (its timings too), not redone
    assert len(stamps) > 20 and {p: p.stat().st_mtime_ns for p in work} == stamps  # answers, features read back
    assert time.perf_counter() - t0 < 0.5 * r["wall_seconds"] + 30
    other = tmp_path / "other.gguf"
    data = bytearray(target.read_bytes())
    data[-1] ^= 1  # another model (sha256), same shapes
    other.write_bytes(bytes(data))
    shutil.copy(r["path"], eagle_store.default_path(other))
    with pytest.raises(OndeviceError, match="another model") as e:
        ondevice.load(other, draft="heads", threads=1)
    assert "\n" not in str(e.value) and "train-heads" in str(e.value)


def test_a_fit_stopped_mid_epoch_resumes_where_it_stopped(trained, tmp_path, monkeypatch):
    """Ctrl-C in the middle of an epoch, then the same command: the fit goes on from the step of its last
    mid-epoch checkpoint (not from the epoch's start: an epoch of a 1.5B target's fit is hours) and ends where the
    uninterrupted fit ended (same losses, same held-out τ: the epoch's batches and noise stream restored)."""
    from ondevice.heads import eagle, eagle_data, eagle_train

    target, home, r = trained
    work = tmp_path / "home" / "heads" / "work"  # the answers and features copied, not the fit
    shutil.copytree(home / "heads" / "work", work, ignore=shutil.ignore_patterns("eagle-fit-*", "eagle-best-*"))
    monkeypatch.setenv("ONDEVICE_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(eagle_train, "SAVE_SECONDS", 0.0)  # a checkpoint after every step
    kw = {**SMALL, "out": tmp_path / "out"}  # the fixture's drafter file left alone
    plans, calls, real_step = [], [], eagle.make_step
    stop = None

    def make_step(*a, **k):
        step = real_step(*a, **k)

        def counted(*b):
            calls.append(1)
            if len(calls) == stop:
                raise KeyboardInterrupt
            return step(*b)
        return counted

    class Planned(Exception):
        pass

    def plan_then_stop(*a, **k):
        plans.append(real(*a, **k))
        raise Planned

    real = eagle_data.batches
    with pytest.MonkeyPatch.context() as mp:  # the length of an epoch's plan first (every epoch has as many steps)
        mp.setattr(eagle_data, "batches", plan_then_stop)
        with pytest.raises(Planned):
            eagle_train.train_eagle(target, **kw)
    n = len(plans[0])
    assert n >= 2
    monkeypatch.setattr(eagle, "make_step", make_step)
    clock = iter(range(10**9))  # the fit's clock ticks a second a reading: its log's seconds are the same every run
    monkeypatch.setattr(eagle_train, "time", SimpleNamespace(perf_counter=lambda: float(next(clock))))
    stop = n + n // 2 + 1  # in epoch 2 after n // 2 of its steps
    with pytest.raises(KeyboardInterrupt):
        eagle_train.train_eagle(target, **kw)
    ckpt = next(work.rglob("eagle-fit-*.npz"))
    with np.load(ckpt) as z:
        info = json.loads(str(z["__info__"]))
    assert (info["epoch"], info["step"]) == (1, n // 2)
    calls.clear()
    stop = None
    again = eagle_train.train_eagle(target, **kw)
    assert len(calls) == len(r["log"]) * n - (n + n // 2)  # the steps left, none redone

    def plain(log):
        return [{k: v for k, v in e.items() if k != "seconds"} for e in log]

    assert plain(again["log"]) == plain(r["log"]) and again["tau_heldout"] == r["tau_heldout"]
    seconds = [e["seconds"] for e in again["log"]]  # the clock goes on across the stop (not from 0 again)
    assert seconds == sorted(set(seconds)), seconds  # increasing


@pytest.mark.parametrize("field,value", [(8, 1), (10, 99)])  # a member's "encrypted" flag; its compression method
def test_a_damaged_fit_checkpoint_is_started_over(tmp_path, field, value):
    """One damaged byte in the fit checkpoint's zip directory (zipfile then refuses the member as encrypted or
    compressed some unknown way): the checkpoint reads as missing and the fit starts over, not a crash; an
    answer's cached features so damaged are computed again."""
    from ondevice.heads import eagle_data, eagle_train

    params = {"w": np.ones((4, 4), np.float32)}
    path = tmp_path / "eagle-fit.npz"
    eagle_train._save_state(path, params, {g: {"w": np.zeros((4, 4), np.float32)} for g in ("m", "v")},
                            {"epoch": 1, "step": 2, "log": [], "best": None})
    assert eagle_train._load_state(path, params)[2]["step"] == 2
    data = bytearray(path.read_bytes())
    cd = data.index(b"PK\x01\x02")  # the first member's central-directory record
    data[cd + field] = value
    path.write_bytes(bytes(data))
    assert eagle_train._load_state(path, params) is None
    seq = tmp_path / "seq-0.npz"  # an answer's cached features: the same damage computes them again
    np.savez(seq, tokens=np.arange(5), feats=np.ones((5, 6), np.float16), t_ids=np.zeros((5, 8), np.int32),
             t_pr=np.zeros((5, 8), np.float16), n_prompt=np.int64(2))
    assert eagle_data.load(seq) is not None
    data = bytearray(seq.read_bytes())
    data[data.index(b"PK\x01\x02") + field] = value
    seq.write_bytes(bytes(data))
    assert eagle_data.load(seq) is None


def test_the_command(trained, home, monkeypatch):
    """``ondevice train-heads MODEL --json`` trains this kind by default (the stored summary printed as JSON);
    ``--kind`` refuses what it does not know before any work."""
    from typer.testing import CliRunner

    from ondevice.cli.main import app
    from ondevice.heads import eagle_train

    target, _, r = trained
    calls = []
    monkeypatch.setattr(eagle_train, "train_eagle", lambda model, **kw: calls.append((model, kw)) or r)
    out = CliRunner().invoke(app, ["train-heads", str(target), "--tokens", "1500", "--epochs", "6", "--json"])
    assert out.exit_code == 0, out.output
    assert calls == [(str(target), {"tokens": 1500, "out": None, "seed": 0, "threads": None, "quiet": True, "epochs": 6,
                                    "text": (), "text_tokens": None, "convert": convert_eagle3,
                                    "target_info": target_info})]
    assert json.loads(out.output)["kind"] == "eagle" and Path(json.loads(out.output)["path"]).is_file()
    bad = CliRunner().invoke(app, ["train-heads", str(target), "--kind", "hydra"])
    assert bad.exit_code == 2 and "eagle or medusa" in bad.output and len(calls) == 1
    out = CliRunner().invoke(app, ["train-heads", str(target), "--text", "src", "--text", "notes.md", "--text-tokens", "900"])
    assert out.exit_code == 0 and calls[-1][1]["text"] == ["src", "notes.md"] and calls[-1][1]["text_tokens"] == 900
    bad = CliRunner().invoke(app, ["train-heads", str(target), "--text-tokens", "900"])
    assert bad.exit_code == 2 and "--text PATH" in bad.output and len(calls) == 2
    out = CliRunner().invoke(app, ["train-heads", str(target), "--hours", "0.5"])  # epochs sized to a budget
    assert out.exit_code == 0 and calls[-1][1]["hours"] == 0.5 and "epochs" not in calls[-1][1]
    bad = CliRunner().invoke(app, ["train-heads", str(target), "--hours", "0.5", "--kind", "medusa"])
    assert bad.exit_code == 2 and "--hours" in bad.output and len(calls) == 3


def test_text_on_the_machine_trains_too(trained, home, tmp_path):
    """``text=``: pieces of the files named, teacher-forced, join the training rows (never the held-out answers,
    where τ is still measured); a missing path is refused before any work."""
    from ondevice.heads.eagle_train import train_eagle

    target, _, r = trained
    src = tmp_path / "src"
    src.mkdir()
    for i in range(6):
        (src / f"m{i}.py").write_text("".join(f"def f{i}_{j}(x):\n    return x * {j} + {i}\n\n" for j in range(30)))
    got = train_eagle(target, **{**SMALL, "epochs": 2}, text=[src], text_tokens=600, out=tmp_path / "out")
    assert 600 - 16 <= got["text_tokens"] <= 600
    assert got["training_tokens"] == r["training_tokens"] + got["text_tokens"]
    assert got["heldout_answers"] == r["heldout_answers"] and len(got["log"]) == 2  # its own fit, same judges
    assert Path(got["path"]).is_file() and Path(got["path"]).parent == tmp_path / "out"
    with pytest.raises(OndeviceError, match="no such file or folder"):
        train_eagle(target, **SMALL, text=[tmp_path / "nowhere"])


def test_changed_text_is_a_new_fit(trained, home, tmp_path):
    """``text=`` edited between two runs, to as many tokens: the second run fits on the new text instead of
    resuming the first run's finished fit (its checkpoint key counted the text's tokens, not which they were: the
    drafter of the old text came back, its log and τ the first run's)."""
    from ondevice.heads.eagle_train import train_eagle

    target = trained[0]
    runs = []
    for sign in "+-":
        src = tmp_path / f"src{sign}"
        src.mkdir()
        for i in range(3):
            (src / f"m{i}.py").write_text("".join(f"def g{i}_{j}(x):\n    return x {sign} {j * i}\n\n" for j in range(40)))
        runs.append(train_eagle(target, **{**SMALL, "epochs": 1}, text=[src], text_tokens=500, out=tmp_path / f"out{sign}"))
    a, b = runs
    assert a["text_tokens"] == b["text_tokens"] and a["training_tokens"] == b["training_tokens"]
    assert a["log"] != b["log"]


def test_the_text_folders_are_walked_once(trained, home, tmp_path, monkeypatch):
    """``text=[FOLDER]``: the folder is walked once (the up-front check hands its files on to the reading), not
    again when the pieces are read (``text=[Path.home()]`` walked the whole home folder twice)."""
    import os

    from ondevice.heads import eagle_data, texts
    from ondevice.heads.eagle_train import train_eagle

    src = tmp_path / "src"
    src.mkdir()
    (src / "a.py").write_text("def a(x):\n    return x + 1\n" * 20)
    walks, real = [], os.walk
    monkeypatch.setattr(texts.os, "walk", lambda top, *a, **k: walks.append(top) or real(top, *a, **k))

    class Read(Exception):
        pass

    def read_then_stop(backend, pieces, work, **kw):
        assert len(list(pieces)) == 1
        raise Read

    monkeypatch.setattr(eagle_data, "collect_text", read_then_stop)
    with pytest.raises(Read):
        train_eagle(trained[0], **SMALL, text=[src], out=tmp_path / "out")
    assert walks == [src]


def test_chain_replay_counts_passes():
    """``chain_tau`` replays the runtime's loop: a pass emits its accepted drafts and one token of its own."""
    from ondevice.heads.eagle_data import chain_tau

    n_prompt, n = 3, 12  # answer rows 3..11: 8 tokens after the first (which the prompt's pass emits)
    hits = np.ones((5, n), bool)
    assert chain_tau(hits, n_prompt, n, 5) == (8, 2)  # 5 drafts + 1, then the 2 left
    assert chain_tau(np.zeros((5, n), bool), n_prompt, n, 5) == (8, 8)
    hits = np.zeros((5, n), bool)
    hits[0, 2] = hits[1, 3] = True  # from base 2: depths 0 and 1 right, depth 2 wrong
    assert chain_tau(hits, n_prompt, n, 3)[1] == 1 + 5


def test_the_feature_losss_targets_are_the_hidden_states_of_the_teacher_rows(trained):
    """``eagle_data.hidden_rows``: the hidden state the feature loss regresses row p onto is the one whose logits
    are the teacher's at row p + 1 (the target's LM head on it picks the teacher's top-1); one position off, not."""
    from ondevice.heads import eagle_data, store, train
    from ondevice.heads.batch import load_record

    target, home, _ = trained
    work = home / "heads" / "work" / store.target_sha256(target)[:16]
    feats = sorted(work.glob("eagle-feats-*/seq-*.npz"))[:4]
    recs = [load_record(work / "records" / f"rec-{i:04d}.npz") for i in range(len(feats))]
    seqs = [eagle_data.load(f) for f in feats]
    with ondevice.load(target, drafter="none", threads=1) as rt:
        V = rt.target.vocab_size
    rows, table, _ = train.target_rows(target, np.arange(V), emb_ids=np.arange(V))
    wins = [(i, 0) for i in range(len(seqs))]

    def agreement(hidden):
        b = eagle_data.batch_arrays(seqs, wins, 512, np.arange(V, dtype=np.int32), table, hidden=hidden)
        ok = b["hid_ok"] & b["valid"]
        return ok.sum(), float(np.mean((b["hid"] @ rows.T).argmax(-1)[ok] == b["t_idx"][..., 0][ok]))

    n, right = agreement([eagle_data.hidden_rows(r) for r in recs])
    assert n > 50 and right > 0.97
    assert agreement([(first + 1, h) for first, h in map(eagle_data.hidden_rows, recs)])[1] < 0.5
