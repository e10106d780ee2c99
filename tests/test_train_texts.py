"""``train-heads --text PATH``: text already on the machine as extra, teacher-forced training data — which files
are read (and which skipped), how a budget is spread over files, and that the pieces' features are cached."""

from __future__ import annotations

import numpy as np
import pytest

from ondevice.errors import OndeviceError
from ondevice.heads import eagle_data, texts


def _tree(root):
    (root / "pkg" / "__pycache__").mkdir(parents=True)
    (root / ".git").mkdir()
    (root / "pkg" / "a.py").write_text("def a():\n    return 1\n")
    (root / "pkg" / "b.md").write_text("# Notes\n\nSome prose.\n")
    (root / "pkg" / "__pycache__" / "a.py").write_text("cached = True\n")
    (root / ".git" / "c.py").write_text("hidden = True\n")
    (root / "pkg" / "nul.txt").write_bytes(b"text\0with a nul byte")
    (root / "pkg" / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (root / "pkg" / "empty.txt").write_text("")
    (root / "pkg" / "big.txt").write_text("x" * (texts.MAX_FILE + 1))
    (root / "pkg" / "data.bin").write_text("not a text suffix\n")
    (root / "named.weird").write_text("taken because it is named\n")


def test_which_files_are_read(tmp_path):
    _tree(tmp_path)
    got = list(texts.read_texts([tmp_path / "pkg", tmp_path / "named.weird"], seed=0))
    assert sorted(got) == sorted(["def a():\n    return 1\n", "# Notes\n\nSome prose.\n", "taken because it is named\n"])
    assert got == list(texts.read_texts([tmp_path / "pkg", tmp_path / "named.weird"], seed=0))  # seeded order
    orders = {tuple(texts.read_texts([tmp_path / "pkg", tmp_path / "named.weird"], seed=s)) for s in range(12)}
    assert len(orders) > 1  # the seed shuffles the files: a budget does not exhaust the first folder


def test_bad_paths_are_refused_in_one_line(tmp_path):
    with pytest.raises(OndeviceError, match="no such file or folder") as e:
        texts.text_files([tmp_path / "missing"])
    assert "\n" not in str(e.value) and "missing" in str(e.value)
    (tmp_path / "only.bin").write_bytes(b"\1\2")
    with pytest.raises(OndeviceError, match="no text files found"):
        texts.text_files([tmp_path])


class _Backend:
    """What ``collect_text`` reads: a tokenizer (one id per character) and ``features_of``'s prefill."""

    n_ctx = 512

    def __init__(self):
        self.evals = []

    def tokenize(self, text, add_bos=False):
        return [ord(c) % 50 + 1 for c in text]

    def rollback(self, n):
        pass

    def eval(self, tokens, logits="all"):
        self.evals.append(list(tokens))
        return np.random.default_rng(len(tokens)).normal(size=(len(tokens), 60)).astype(np.float32)

    def feature(self, name, i):
        return np.full(6, i, np.float32)

    def release_features(self, n):
        pass


def test_pieces_budget_and_cache(tmp_path):
    """At most ``PER_TEXT`` pieces of ``chunk`` tokens per text, no piece under 16 tokens, the budget kept; the
    pieces have no prompt (every row trains); a second call reads them back, a changed text is read again."""
    docs = ["a" * 300, "b" * 40, "c" * 10, "d" * 500]
    be = _Backend()
    seqs = eagle_data.collect_text(be, iter(docs), tmp_path, budget=10_000, chunk=64)
    assert [len(s.tokens) for s in seqs] == [64, 64, 40, 64, 64]  # "c" * 10 is too short; two pieces per text
    assert all(s.n_prompt == 0 for s in seqs) and len(be.evals) == 5
    assert [s.tokens.tolist() for s in seqs] == [be.tokenize(t)[:64] for t in ("a" * 64, "a" * 64, "b" * 40, "d" * 64, "d" * 64)]
    again = eagle_data.collect_text(be, iter(docs), tmp_path, budget=10_000, chunk=64)
    assert len(be.evals) == 5 and all(np.array_equal(a.feats, b.feats) for a, b in zip(seqs, again, strict=True))
    cut = eagle_data.collect_text(be, iter(docs), tmp_path, budget=150, chunk=64)
    assert sum(len(s.tokens) for s in cut) <= 150 and [len(s.tokens) for s in cut] == [64, 64, 22]
    assert len(be.evals) == 6  # only the shortened third piece is new
    other = eagle_data.collect_text(be, iter(["z" * 64]), tmp_path, budget=64, chunk=64)
    assert len(be.evals) == 7 and other[0].tokens.tolist() == be.tokenize("z" * 64)


def test_the_medusa_kind_reads_the_same_text(tmp_path, monkeypatch):
    """``--kind medusa --text PATH``: the heads' trainer is handed the files' contents (``texts=``) and a budget
    (``--text-tokens``, default ``--tokens``); a missing path is refused before any recording."""
    from typer.testing import CliRunner

    from ondevice.cli.main import app
    from ondevice.heads import train

    _tree(tmp_path)
    calls = []
    monkeypatch.setattr(train, "train_heads", lambda model, **kw: calls.append(kw) or {
        "path": "h", "training_tokens": 1, "wall_seconds": 1.0, "tau_heldout_greedy_chain": {"tau": 1.0}})
    out = CliRunner().invoke(app, ["train-heads", "m.gguf", "--kind", "medusa", "--tokens", "500", "--text", str(tmp_path / "pkg")])
    assert out.exit_code == 0, out.output
    assert calls[0]["text_tokens"] == 500 and len(list(calls[0]["texts"])) == 2
    out = CliRunner().invoke(app, ["train-heads", "m.gguf", "--kind", "medusa", "--text", str(tmp_path / "gone")])
    assert out.exit_code != 0 and "no such file or folder" in out.output and len(calls) == 1


class _HiddenBackend(_Backend):
    """What the heads' ``data.collect_text`` reads: ``_Backend`` with hidden rows (``record_text``)."""

    def enable_hidden(self):
        pass

    def hidden(self, i):
        return np.full(4, i, np.float32)


def test_the_medusa_kinds_pieces_of_a_changed_text_are_read_again(tmp_path):
    """``--kind medusa --text``: a piece cached by an earlier run is served only while its text is unchanged; a
    text edited between two runs is read again (the cache was keyed by the piece's number alone: the heads trained
    on the old text's tokens and rows)."""
    from types import SimpleNamespace

    from ondevice.heads import data

    be = _HiddenBackend()
    rt = SimpleNamespace(target=be, reset=lambda: None)
    first = data.collect_text(rt, iter(["a" * 100]), tmp_path, budget=1000, chunk=64)
    assert [r.tokens.tolist() for r in first] == [be.tokenize("a" * 64), be.tokenize("a" * 36)]
    again = data.collect_text(rt, iter(["a" * 100]), tmp_path, budget=1000, chunk=64)
    assert len(be.evals) == 2 and [r.tokens.tolist() for r in again] == [r.tokens.tolist() for r in first]
    edited = data.collect_text(rt, iter(["b" * 100]), tmp_path, budget=1000, chunk=64)
    assert [r.tokens.tolist() for r in edited] == [be.tokenize("b" * 64), be.tokenize("b" * 36)]
    assert len(be.evals) == 4


def test_the_medusa_kind_fits_again_on_edited_text_and_refuses_none(heads_trained, tmp_path, monkeypatch):
    """``train_heads(texts=...)`` edited between two runs, to as many tokens, fits again on the new text instead of
    resuming the first run's finished fit (its key counted the text's tokens, not which: the old heads came back);
    text that gives no piece (only skipped files) is refused in one line instead of training without it."""
    import shutil

    from helpers import SMALL_HEADS

    from ondevice.heads import train

    target, home, _ = heads_trained
    shutil.copytree(home, tmp_path / "home")  # its recorded answers: only the text and the fit are new
    monkeypatch.setenv("ONDEVICE_HOME", str(tmp_path / "home"))
    runs = [train.train_heads(target, **SMALL_HEADS, texts=iter([" alpha beta gamma" * 60]), text_tokens=300),
            train.train_heads(target, **SMALL_HEADS, texts=iter([" gamma beta alpha" * 60]), text_tokens=300)]
    a, b = runs
    assert a["teacher_forced_text_tokens"] == b["teacher_forced_text_tokens"] > 0
    assert a["log"] != b["log"]
    with pytest.raises(OndeviceError, match="no text of 17 tokens or more") as e:
        train.train_heads(target, **SMALL_HEADS, texts=iter(["too short"]), text_tokens=300)
    assert "\n" not in str(e.value)


def test_the_folders_named_are_walked_once(tmp_path, monkeypatch):
    """``--kind medusa --text FOLDER``: the folder is walked once (the check of the paths hands its files on), not
    once more when the text is read: ``--text ~`` walks a whole home folder before the recording starts."""
    import os

    from typer.testing import CliRunner

    from ondevice.cli.main import app
    from ondevice.heads import train

    _tree(tmp_path)
    walks, real = [], os.walk
    monkeypatch.setattr(texts.os, "walk", lambda top, *a, **k: walks.append(top) or real(top, *a, **k))
    got = []
    monkeypatch.setattr(train, "train_heads", lambda model, **kw: got.append(list(kw["texts"])) or {
        "path": "h", "training_tokens": 1, "wall_seconds": 1.0, "tau_heldout_greedy_chain": {"tau": 1.0}})
    out = CliRunner().invoke(app, ["train-heads", "m.gguf", "--kind", "medusa", "--text", str(tmp_path / "pkg")])
    assert out.exit_code == 0, out.output
    assert len(got[0]) == 2 and len(walks) == 1


def test_the_medusa_kinds_text_keeps_its_budget(tmp_path):
    """``--kind medusa --text-tokens N``: at most N teacher-forced rows, the last piece cut to fit (a whole piece
    was taken whenever any budget was left: up to ``chunk`` − 1 rows over), and no piece under 16 rows."""
    from types import SimpleNamespace

    from ondevice.heads import data

    be = _HiddenBackend()
    rt = SimpleNamespace(target=be, reset=lambda: None)
    got = data.collect_text(rt, iter(["a" * 300, "b" * 300]), tmp_path / "a", budget=100, chunk=64)
    assert [len(r.hidden) for r in got] == [63, 37]
    got = data.collect_text(rt, iter(["a" * 300, "b" * 300]), tmp_path / "b", budget=70, chunk=64)
    assert [len(r.hidden) for r in got] == [63]  # 7 rows left: too few for a piece


def test_a_text_budget_under_a_piece_is_refused_up_front(tmp_path):
    """``train_eagle(text_tokens=N)`` with N under 16 (the CLI's minimum, a piece's least length) is refused before
    any work: it read and tokenized every file named, found no piece to take, and said there was no text."""
    from ondevice.heads.eagle_train import train_eagle

    _tree(tmp_path)
    with pytest.raises(OndeviceError, match=r"text_tokens=5: must be 16 tokens or more") as e:
        train_eagle(tmp_path / "no-model.gguf", text=[tmp_path / "pkg"], text_tokens=5, convert=lambda *a, **k: None)
    assert "\n" not in str(e.value)
