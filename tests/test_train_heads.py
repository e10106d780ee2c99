"""`ondevice train-heads` as a user drives it: batched recording equal to one answer at a time, Ctrl-C during
recording, fitting or prompt writing then a rerun gives the same heads (and says how to resume), --out and a
second run refused up front in one line, too few tokens, rounds of the target's own prompts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import SMALL_HEADS as SMALL

import ondevice
from ondevice.backends.llama import LlamaBackend
from ondevice.errors import OndeviceError
from ondevice.heads import batch, data, selfprompts, store, train


def _heads(path) -> dict:
    from safetensors.numpy import load_file

    return load_file(str(path))


@pytest.fixture
def target(heads_trained):
    """The tiny llama target copied outside the test cache (its heads go to <home>/heads)."""
    return heads_trained[0]


@pytest.fixture
def clean(heads_trained):
    """(home, summary) of one uninterrupted small run."""
    return heads_trained[1:]


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


def test_ctrl_c_in_recording_and_in_fitting_then_rerun_gives_the_same_heads(target, clean, tmp_path, monkeypatch):
    """A run stopped (KeyboardInterrupt) after a few recorded answers, rerun and stopped mid-fit, then rerun
    to the end, stores the heads the uninterrupted run stored: records are trained on as they are read back
    (float16 rows), every epoch draws its own seeded generator, and nothing half-written is left."""
    monkeypatch.setenv("ONDEVICE_HOME", str(tmp_path))
    real_save, real_ckpt = batch._save, train._ckpt_save
    calls = [0]

    def save_then_stop(path, rec):
        out = real_save(path, rec)
        calls[0] += 1
        if calls[0] == 5:
            raise KeyboardInterrupt
        return out

    monkeypatch.setattr(batch, "_save", save_then_stop)
    with pytest.raises(KeyboardInterrupt):
        train.train_heads(target, **SMALL)
    monkeypatch.setattr(batch, "_save", real_save)
    work = next((tmp_path / "heads" / "work").iterdir())
    assert len(list((work / "records").glob("rec-*.npz"))) == 5 and not list(tmp_path.rglob("*.tmp"))

    ckpts = [0]

    def ckpt_then_stop(path, arrays, info):
        real_ckpt(path, arrays, info)
        ckpts[0] += 1
        if ckpts[0] == 5:  # head 2, epoch 1 (head 1 took 3 epochs and its final save)
            raise KeyboardInterrupt

    monkeypatch.setattr(train, "_ckpt_save", ckpt_then_stop)
    with pytest.raises(KeyboardInterrupt):
        train.train_heads(target, **SMALL)
    monkeypatch.setattr(train, "_ckpt_save", real_ckpt)
    assert not list((tmp_path / "heads").glob("*.heads.safetensors"))  # no heads file before the fit ends
    r = train.train_heads(target, **SMALL)
    home, want = clean
    assert r["training_tokens"] == want["training_tokens"] and r["log"] == want["log"]
    assert r["tau_heldout_greedy_chain"] == want["tau_heldout_greedy_chain"]
    a, b = _heads(r["path"]), _heads(want["path"])
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    assert not list(tmp_path.rglob("*.tmp"))


def test_out_that_cannot_hold_the_file_is_refused_before_any_work(target, tmp_path, monkeypatch):
    monkeypatch.setenv("ONDEVICE_HOME", str(tmp_path / "home"))
    f = tmp_path / "notes.txt"
    f.write_text("x")
    for out in (f, f / "sub"):
        with pytest.raises(OndeviceError, match="is a file, not a folder; pass --out FOLDER") as e:
            train.train_heads(target, out=out, **SMALL)
        assert str(f) in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "home" / "heads" / "work").exists()  # nothing recorded
    monkeypatch.setattr(train.tempfile, "TemporaryFile", lambda dir: (_ for _ in ()).throw(PermissionError(13, "Permission denied")))
    with pytest.raises(OndeviceError, match="cannot write the heads file there .*Permission denied.*--out FOLDER") as e:
        train.train_heads(target, out=tmp_path / "ro", **SMALL)
    assert "\n" not in str(e.value) and not (tmp_path / "home" / "heads" / "work").exists()


def test_a_second_train_heads_on_the_same_model_is_refused(target, tmp_path, monkeypatch):
    monkeypatch.setenv("ONDEVICE_HOME", str(tmp_path))
    work = tmp_path / "heads" / "work" / store.target_sha256(target)[:16]
    with train._exclusive(work, target):  # another run holds the model
        with pytest.raises(OndeviceError, match="another `ondevice train-heads` is training heads for this model") as e:
            train.train_heads(target, **SMALL)
        assert "tiny.gguf" in str(e.value) and "\n" not in str(e.value)
    assert not work.exists()  # nothing was recorded: the lock's folder is gone
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(target.read_bytes()[:50000])  # a GGUF llama.cpp cannot load
    with pytest.raises(OndeviceError, match="could not load"):
        train.train_heads(bad, **SMALL)
    assert not list((tmp_path / "heads" / "work").iterdir())


def test_self_written_prompts_progress_counts_finished_requests(target, monkeypatch):
    """The 'writing prompts' bar counts requests answered, so it ends at its total (it counted the kept ones)."""
    monkeypatch.setattr(selfprompts, "load_prompts", lambda: {"heldout": {"code": ["zzz"]},
                                                              "topics": {"code": ["lists"], "chat": ["tea"]}})
    seen = []
    with ondevice.load(target, drafter="none", threads=1, n_ctx=512) as rt:
        b = LlamaBackend(target, n_ctx=1024, threads=1, n_seq_max=4)
        try:
            got = selfprompts.write_prompts(rt, b, per_topic=3, max_new=24, on_progress=lambda d, t: seen.append((d, t)))
        finally:
            b.close()
    assert seen[-1] == (6, 6) and [d for d, _ in seen] == list(range(1, 7))
    assert len(got) < 6  # the tiny model drops some (so counting kept requests would not have reached 6)


def test_cli_out_names_the_file_to_pass_to_draft_and_refuses_a_file(target, tmp_path, monkeypatch):
    """`train-heads --out DIR` stores the heads where `--draft heads` does not look: it says how to use them;
    `--out FILE` is one line (the CLI's error exit code, 2), before any work."""
    from typer.testing import CliRunner

    from ondevice.cli.main import app

    monkeypatch.setenv("ONDEVICE_HOME", str(tmp_path / "home"))
    r = CliRunner().invoke(app, ["train-heads", str(target), "--kind", "medusa", "--tokens", "100", "--threads", "1",
                                  "--out", str(tmp_path / "o")])
    assert r.exit_code == 0, r.output
    path = next((tmp_path / "o").glob("*.heads.safetensors"))
    assert f"use them with --draft {path}" in r.output
    (tmp_path / "f").write_text("x")
    r = CliRunner().invoke(app, ["train-heads", str(target), "--tokens", "100", "--out", str(tmp_path / "f")])
    assert r.exit_code == 2 and r.output.strip().splitlines() == [f"error: {tmp_path / 'f'}: is a file, not a folder; "
                                                                  "pass --out FOLDER (a folder for the heads file, created if missing)"]


def test_too_few_tokens(target, tmp_path, monkeypatch):
    """tokens <= 0 is one line before any work; a budget one answer fills has no held-out answer, and says so
    (it reported the training answer used for early stopping as held-out tokens)."""
    monkeypatch.setenv("ONDEVICE_HOME", str(tmp_path))
    for bad in (0, -5):
        with pytest.raises(OndeviceError, match=f"tokens={bad}: train-heads needs a positive number"):
            train.train_heads(target, **{**SMALL, "tokens": bad})
    assert not (tmp_path / "heads").exists()
    r = train.train_heads(target, **{**SMALL, "tokens": 1})
    assert r["training_tokens"] > 0 and r["heldout_tokens"] == 0 and r["tau_heldout_greedy_chain"] is None


def test_recorded_answers_to_other_prompts_are_recorded_again(target, tmp_path):
    """Answer i is a file named by its index: answers to other prompts at that index (the target's own prompts
    of another --seed come after the shipped ones) or cut at another max_new are recorded again, not reused."""
    b = LlamaBackend(target, n_ctx=4 * 256, threads=1, n_seq_max=4, kv_unified=False)
    try:
        b.enable_hidden()
        texts = ["def add(a, b):", "class Cache:", "import os\n"]
        first = [("code", b.tokenize(t)) for t in texts]
        batch.collect_many(b, first, tmp_path, budget=10**6, max_new=16)
        other = [first[0], first[1], ("code", b.tokenize("SELECT * FROM"))]
        recs = batch.collect_many(b, other, tmp_path, budget=10**6, max_new=16)
        assert [r.prompt.tolist() for r in recs] == [p for _, p in other]
        one = LlamaBackend(target, n_ctx=256, threads=1)
        try:
            one.enable_hidden()
            assert recs[2].tokens.tolist() == data.record_answer(one, other[2][1], 16).tokens.tolist()
            longer = batch.collect_many(b, other, tmp_path, budget=10**6, max_new=24)
            assert [r.tokens.tolist() for r in longer] == [data.record_answer(one, p, 24).tokens.tolist() for _, p in other]
        finally:
            one.close()
    finally:
        b.close()


def test_train_heads_on_a_core_ml_model_is_one_line(tmp_path, monkeypatch):
    """A Core ML model directory fell through to '<dir>/model.gguf' and a FileNotFoundError."""
    monkeypatch.setenv("ONDEVICE_HOME", str(tmp_path / "home"))
    d = tmp_path / "cm"
    (d / "model.mlpackage").mkdir(parents=True)
    with pytest.raises(OndeviceError, match="heads train on a GGUF file or an MLX model directory, not a coreml model") as e:
        train.train_heads(d, **SMALL)
    assert str(d) in str(e.value) and "\n" not in str(e.value) and not (tmp_path / "home").exists()


def test_ctrl_c_while_the_target_writes_its_prompts_resumes(target, tmp_path, monkeypatch):
    """The target's own prompts were kept only when all were written: Ctrl-C lost them all (minutes of a 1.5B
    model). Each request answered is now logged as it finishes and has its own seeded generator, so a rerun
    asks only the rest and writes what an uninterrupted run writes (also with another batch width; the tiny
    model's requests are mostly dropped, so the answers themselves are compared in the next test)."""
    monkeypatch.setattr(selfprompts, "load_prompts", lambda: {"heldout": {"code": ["zzz"]},
                                                              "topics": {"code": ["lists", "files"], "chat": ["tea", "rain"]}})

    class Bar:
        def add_task(self, *a, **k):
            return 0

        def update(self, *a, **k):
            pass

    with ondevice.load(target, drafter="none", threads=1, n_ctx=512) as rt:
        def backend(slots):
            return LlamaBackend(target, n_ctx=slots * 256, threads=1, n_seq_max=slots, kv_unified=False)

        b1, b4 = backend(1), backend(4)
        try:
            want = selfprompts.write_prompts(rt, b1, seed=7)
            real, asked = selfprompts.write_prompts, []

            def stop_after_3(*a, on_answer, **k):
                def log(i, text):
                    on_answer(i, text)
                    asked.append(i)
                    if len(asked) == 3:
                        raise KeyboardInterrupt
                return real(*a, on_answer=log, **k)

            monkeypatch.setattr(selfprompts, "write_prompts", stop_after_3)
            cache = tmp_path / "selfprompts-7.json"
            with pytest.raises(KeyboardInterrupt):
                train._self_prompts(rt, b4, cache, 7, Bar())
            assert not cache.exists() and len((tmp_path / "selfprompts-7.json.partial").read_text().splitlines()) == 3
            got = train._self_prompts(rt, b4, cache, 7, Bar())
            assert len(asked) == 8 and sorted(asked) == list(range(8))  # 3 before, the other 5 after
            assert [tuple(x) for x in got] == [tuple(x) for x in want] and not (tmp_path / "selfprompts-7.json.partial").exists()
        finally:
            b1.close()
            b4.close()


def test_sampled_answers_do_not_depend_on_what_is_decoded_with_them(target):
    """Sampled batched answers (the target writing its prompts) drew from one generator shared by every slot,
    so an answer depended on the batch width and on which other prompts were still to write; each answer now
    has its own generator (seed, key)."""
    from ondevice.sampling import SamplingParams

    texts = ["def add(a, b):", "class Cache:", "import os\n", "Once upon a time", "SELECT * FROM", "x = [1, 2, 3]"]
    params = SamplingParams(temperature=1.0, top_p=0.95)
    runs = []
    for slots, keys in ((1, range(6)), (4, range(6)), (4, [1, 3, 5])):
        b = LlamaBackend(target, n_ctx=slots * 256, threads=1, n_seq_max=slots, kv_unified=False)
        try:
            prompts = [b.tokenize(texts[k]) for k in keys]
            got = {}
            batch.generate_many(b, prompts, max_new=24, params=params, seed=3, hidden=False, keys=list(keys),
                                on_done=lambda j, r, keys=list(keys), got=got: got.__setitem__(keys[j], r.tokens.tolist()))
            runs.append(got)
        finally:
            b.close()
    assert runs[0] == runs[1] and all(runs[0][k] == v for k, v in runs[2].items())
    assert len({tuple(v) for v in runs[0].values()}) == 6


def test_rounds_of_own_prompts_append_in_order_and_free_the_last_rounds_records(target, tmp_path, monkeypatch):
    """Below the budget, train-heads writes further rounds of prompts: round r's are appended after round
    r − 1's (answer i stays file rec-i), each round avoids every earlier round's prompts, rounds stop at the
    budget, and a round's records are let go before the next round reads them all again (not twice held)."""
    import gc
    import weakref

    monkeypatch.setenv("ONDEVICE_HOME", str(tmp_path))
    rounds, calls, held = [], [], []

    def fake_self_prompts(rt, backend, cache, seed, bar, round=0, avoid=None):
        rounds.append((round, list(avoid or ()), cache.name))
        return [("chat", f"round {round} prompt {j}") for j in range(2)]

    def fake_collect(backend, prompts, work, *, budget, max_new, slots=None, on_record=None):
        gc.collect()
        assert all(w() is None for w in held), "the last round's records are still held"
        calls.append([p for p in prompts])
        recs = [data.Record(np.zeros(2, np.int64), np.zeros((1, 4), np.float32), np.zeros(1, np.int64), c)
                for c, _ in prompts]
        held[:] = [weakref.ref(r) for r in recs]
        return recs

    class Stop(Exception):
        pass

    def stop(*a, **k):
        raise Stop

    monkeypatch.setattr(train, "_self_prompts", fake_self_prompts)
    monkeypatch.setattr(batch, "collect_many", fake_collect)
    monkeypatch.setattr(train, "choose_vocab", stop)
    n0 = len(data.train_prompts())
    with pytest.raises(Stop):
        train.train_heads(target, **{**SMALL, "tokens": n0 + 5, "max_new": 2})  # 2 own prompts a round: 3 rounds
    assert [r for r, _, _ in rounds] == [0, 1, 2] and len(calls) == 3
    assert [c for _, _, c in rounds] == ["selfprompts-0.json", "selfprompts-0-style1.json", "selfprompts-0-style2.json"]
    assert rounds[2][1] == ["round 0 prompt 0", "round 0 prompt 1", "round 1 prompt 0", "round 1 prompt 1"]
    assert all(calls[i + 1][: len(calls[i])] == calls[i] and len(calls[i + 1]) == len(calls[i]) + 2 for i in range(2))


def test_later_rounds_of_own_prompts_ask_the_other_styles(monkeypatch):
    """Round 0 asks each topic twice in the first style (as earlier versions did, so their caches still hold);
    round r ≥ 1 asks each topic once in every other style of its class, with generator keys of its own."""
    from ondevice.heads import selfprompts

    asked: dict[int, tuple[list[str], list[int]]] = {}

    class Rt:
        def render_chat(self, messages):
            texts.append(messages[0]["content"])
            return [len(texts)]

    def fake_generate(backend, prompts, *, keys, **kw):
        asked[rnd] = (list(texts), list(keys))

    monkeypatch.setattr(selfprompts, "generate_many", fake_generate)
    topics = selfprompts.load_prompts()["topics"]
    for rnd in (0, 1, 2):
        texts: list[str] = []
        assert selfprompts.write_prompts(Rt(), None, round=rnd) == []  # nothing answered: nothing kept
    want0 = [selfprompts.ASK[c][0].format(topic=t) for _ in range(2) for c in sorted(topics) for t in topics[c]]
    assert asked[0][0] == want0
    styles = {c: set(v[1:]) for c, v in selfprompts.ASK.items()}
    n1 = sum(len(styles[c]) * len(topics[c]) for c in topics)
    assert len(asked[1][0]) == n1 and asked[1][0] == asked[2][0] and len(set(asked[1][0])) == n1
    assert not set(asked[1][0]) & set(want0)
    for c in topics:
        for s in styles[c]:
            assert all(s.format(topic=t) in asked[1][0] for t in topics[c])
    keys = [k for r in (0, 1, 2) for k in asked[r][1]]
    assert len(set(keys)) == len(keys)  # every request of every round draws from a generator of its own


def test_rounds_of_own_prompts_stop_at_the_first_round_that_keeps_none(tiny_gguf, tmp_path, monkeypatch):
    """A target that writes no usable request (the tiny one writes noise) is asked one round in the other styles,
    not MAX_ROUNDS of them (each round asks hundreds of requests: minutes spent keeping nothing)."""
    rounds: list[int] = []

    def none_kept(rt, backend, cache, seed, bar, round=0, avoid=None):
        rounds.append(round)
        return []

    monkeypatch.setenv("ONDEVICE_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(train, "_self_prompts", none_kept)
    r = train.train_heads(tiny_gguf("llama"), tokens=10**6, max_new=8, rank=16, epochs=1, vocab=128, threads=1,
                          n_ctx=512, slots=8, quiet=True)
    assert rounds == [0, 1] and 0 < r["training_tokens"] < 10**6


def test_ctrl_c_in_train_heads_says_how_to_resume(tiny_gguf, tmp_path, sigint_default):
    """SIGINT while `ondevice train-heads` records: exit 130, one line saying what is kept and how to resume
    (it exited without a word), no traceback."""

    env = {**os.environ, "ONDEVICE_HOME": str(tmp_path / "home"), "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    proc = subprocess.Popen([sys.executable, "-P", "-m", "ondevice", "train-heads", str(tiny_gguf("llama")), "--tokens", "1000000",
                             "--threads", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    records = tmp_path / "home" / "heads" / "work"
    try:
        t0 = time.monotonic()
        while not list(records.glob("*/.lock")) and time.monotonic() - t0 < 120:  # the run has begun
            time.sleep(0.2)
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:  # a failed wait leaves no training of a million tokens behind
        proc.kill()
        proc.wait()
    lines = [ln for ln in err.splitlines() if ln.strip() and "━" not in ln and "recording" not in ln]
    assert proc.returncode == 130 and "Traceback" not in err, err
    assert lines and lines[-1].startswith("stopped:") and "resume" in lines[-1], err
