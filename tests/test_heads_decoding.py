"""Heads driven as a user drives them: Ctrl-C at odd moments of a generation, then the same model again."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import ondevice
from ondevice import tree
from ondevice.backends.llama import LlamaBackend
from ondevice.heads import train

PROMPTS = ("Once upon a time", "def f(x):")  # the tiny target writes 120 tokens after each (no early end)
GREEDY = dict(max_tokens=120, temperature=0.0)


@pytest.fixture(scope="module")
def heads_home(tiny_gguf, tmp_path_factory):
    """(target, home): the tiny llama target copied outside the test cache, with heads trained into ``home``."""
    home = tmp_path_factory.mktemp("home")
    target = tmp_path_factory.mktemp("models") / "tiny.gguf"
    shutil.copy(tiny_gguf("llama"), target)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ONDEVICE_HOME", str(home))
        train.train_heads(target, tokens=600, max_new=48, rank=32, epochs=3, vocab=256, threads=1, n_ctx=512,
                          slots=8, quiet=True)
    return target, home


def _stop_at(n: int, fn):
    """``fn`` that raises KeyboardInterrupt (as Ctrl-C would, between two bytecodes) on its ``n``-th call."""
    calls = [0]

    def wrapped(*a, **kw):
        calls[0] += 1
        if calls[0] == n:
            raise KeyboardInterrupt
        return fn(*a, **kw)

    return wrapped


class _LibStoppingAt:
    """llama_cpp with one function raising KeyboardInterrupt on its first call (Ctrl-C between two native calls)."""

    def __init__(self, lib, name: str) -> None:
        self._lib, self._name = lib, name

    def __getattr__(self, attr):
        fn = getattr(self._lib, attr)
        if attr == self._name:
            self._name = None
            return _stop_at(1, fn)
        return fn


@pytest.mark.parametrize("where", ["verify_tree", "keep_path"])
def test_ctrl_c_between_a_tree_pass_and_its_kept_path_then_greedy_equals_plain(heads_home, monkeypatch, where):
    """Ctrl-C after a tree was evaluated but before its path was kept (while the tree is verified, the moment the
    decode returns) left the other branches' cells in llama.cpp's cache: the next request's tokens went into
    other cells, and a greedy answer of the same loaded model then differed from plain decoding."""
    target, home = heads_home
    monkeypatch.setenv("ONDEVICE_HOME", str(home))
    with ondevice.load(target, drafter="none", threads=1, n_ctx=512) as plain:
        want = [plain.generate(p, **GREEDY).tokens for p in PROMPTS]
    with ondevice.load(target, draft="heads", threads=1, n_ctx=512) as rt:
        assert rt.drafter.name == "heads" and rt.target.tree_unsupported() is None
        if where == "verify_tree":
            monkeypatch.setattr(tree, "verify_tree", _stop_at(3, tree.verify_tree))
        else:
            monkeypatch.setattr(LlamaBackend, "keep_path", _stop_at(3, LlamaBackend.keep_path))
        with pytest.raises(KeyboardInterrupt):
            rt.generate(PROMPTS[0], gamma=3, **GREEDY)
        monkeypatch.undo()
        monkeypatch.setenv("ONDEVICE_HOME", str(home))
        assert [rt.generate(p, gamma=3, **GREEDY).tokens for p in PROMPTS] == want


@pytest.mark.parametrize("stop", [None, "llama_memory_seq_keep", "llama_state_seq_get_size"])
def test_rollback_after_an_unkept_tree_leaves_the_cache_a_chain_would(tiny_gguf, stop):
    """The backend alone: eval_tree, then keep_path never called (None) or interrupted between two of its native
    calls (a kept path off the first branch: moved to sequence 0, then re-laid in order), then a rollback into
    the context: the next tokens, a kept tree and more tokens score as in a context that never saw the tree.
    Before, the tree's other cells stayed taken, the next tokens went into cells after them and later ones
    filled the holes, out of position order (llama.cpp's CPU attention sums in cell order: ~0.4 apart)."""
    import numpy as np

    path = tiny_gguf("llama")
    a, b = LlamaBackend(path, n_ctx=512, threads=1), LlamaBackend(path, n_ctx=512, threads=1)
    try:
        ids = [1, *range(20, 60)]
        for be in (a, b):
            be.eval(ids[:13], logits="last")
        a.eval_tree([ids[13], 5, 6, 7, 8], [-1, 0, 0, 2, 3])
        if stop is not None:
            lib, a._lib = a._lib, _LibStoppingAt(a._lib, stop)
            with pytest.raises(KeyboardInterrupt):
                a.keep_path([0, 2, 3])
            a._lib = lib
        got = []
        for be in (a, b):
            be.rollback(11)
            rows = [be.eval([t]) for t in ids[11:14]]
            be.eval_tree([ids[14], ids[15], 9], [-1, 0, 0])
            be.keep_path([0, 1])
            rows += [be.eval([t]) for t in ids[16:40]]
            got.append(np.concatenate(rows))
        assert a.n_past == b.n_past == 40 and np.array_equal(got[0], got[1])
    finally:
        a.close()
        b.close()


def test_a_truncated_heads_file_is_one_line_naming_the_model_to_train_again(heads_home, tmp_path):
    """A heads file cut short (a copy or download that stopped), stored beside the model or passed as --draft:
    `ondevice generate` prints one line naming the file and the command that writes it again for this model
    (it said `ondevice train-heads MODEL`), `ondevice info` shows the same line as the heads' status, and
    `--draft auto` drafts without them and says so (it passed over them without a word)."""
    import os
    import shlex
    import subprocess
    import sys

    from ondevice.heads import store

    target, home = heads_home
    env = {**os.environ, "ONDEVICE_HOME": str(tmp_path / "home"), "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    good = next((home / "heads").glob("*.heads.safetensors"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ONDEVICE_HOME", env["ONDEVICE_HOME"])
        stored = store.default_path(target)
    stored.parent.mkdir(parents=True)
    stored.write_bytes(good.read_bytes()[:5000])
    fix = f"ondevice train-heads {shlex.quote(str(target.resolve()))}"
    for draft in ("heads", str(stored)):
        out = subprocess.run([sys.executable, "-m", "ondevice", "generate", str(target), "--draft", draft, "-p", "hi",
                              "--max-tokens", "4", "--threads", "1"], capture_output=True, text=True, env=env, timeout=120)
        assert out.returncode == 2 and out.stdout == "", out.stderr
        assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr, out.stderr
        assert str(stored) in out.stderr and "not a readable heads file" in out.stderr and fix in out.stderr, out.stderr
    info = subprocess.run([sys.executable, "-m", "ondevice", "info", str(target), "--json"], capture_output=True, text=True,
                          env=env, timeout=120)
    assert info.returncode == 0 and fix in info.stdout, info.stdout + info.stderr
    auto = subprocess.run([sys.executable, "-m", "ondevice", "generate", str(target), "--draft", "auto", "-p", "hi",
                           "--max-tokens", "4", "--threads", "1"], capture_output=True, text=True, env=env, timeout=120)
    said = [ln for ln in auto.stderr.splitlines() if ln.startswith("draft:")]
    assert auto.returncode == 0 and len(said) == 1, auto.stderr  # auto drafts without them, and says why
    assert "heads stored for this model were not used" in said[0] and str(stored) in said[0], said
    assert stored.read_bytes() == good.read_bytes()[:5000]  # nothing written over it


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


def test_ctrl_c_in_train_heads_says_how_to_resume(tiny_gguf, tmp_path):
    """SIGINT while `ondevice train-heads` records: exit 130, one line saying what is kept and how to resume
    (it exited without a word), no traceback."""
    import os
    import signal
    import subprocess
    import sys
    import time

    env = {**os.environ, "ONDEVICE_HOME": str(tmp_path / "home"), "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    proc = subprocess.Popen([sys.executable, "-m", "ondevice", "train-heads", str(tiny_gguf("llama")), "--tokens", "1000000",
                             "--threads", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    records = tmp_path / "home" / "heads" / "work"
    t0 = time.monotonic()
    while not list(records.glob("*/.lock")) and time.monotonic() - t0 < 120:  # the run has begun
        time.sleep(0.2)
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    lines = [ln for ln in err.splitlines() if ln.strip() and "━" not in ln and "recording" not in ln]
    assert proc.returncode == 130 and "Traceback" not in err, err
    assert lines and lines[-1].startswith("stopped:") and "resume" in lines[-1], err
