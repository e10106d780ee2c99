"""The heads file as untrusted input and as shown to the user: a missing, truncated, foreign or corrupt file is
one line naming the file and the fix, `info` shows MLX models' heads, and the shortlist is exact and survives
the file."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import ondevice
from ondevice.errors import OndeviceError
from ondevice.heads import store


@pytest.fixture
def target(heads_trained):
    """The tiny llama target copied outside the test cache (its heads go to <home>/heads)."""
    return heads_trained[0]


@pytest.fixture
def clean(heads_trained):
    """(home, summary) of one uninterrupted small run."""
    return heads_trained[1:]


def test_models_and_info_show_a_foreign_heads_file_as_unusable(clean, tiny_gguf, tmp_path, monkeypatch):
    home, r = clean
    monkeypatch.setenv("ONDEVICE_HOME", str(home))
    other = tmp_path / "other.gguf"
    shutil.copy(tiny_gguf("llama_draft"), other)  # same shapes, other weights
    shutil.copy(r["path"], store.default_path(other))
    try:
        s = store.summary(other)
        assert "heads made for another model (tiny.gguf)" in s["error"] and f"train-heads {other}" in s["error"]
    finally:
        store.default_path(other).unlink()


def test_info_shows_the_heads_of_an_mlx_model(target, clean, tiny_mlx, monkeypatch):
    """Heads train and draft for MLX model directories; `ondevice info DIR` showed them only for GGUF files."""
    from typer.testing import CliRunner

    from ondevice.cli.main import app

    monkeypatch.setenv("ONDEVICE_HOME", str(clean[0]))
    d = tiny_mlx("llama")
    heads, meta = store.load(clean[1]["path"], target)
    dest = store.save(store.default_path(d), heads, {**meta, "target_sha256": store.target_sha256(d), "target_file": d.name})
    try:
        r = CliRunner().invoke(app, ["info", str(d)])
        assert r.exit_code == 0, r.output
        line = next(x for x in r.output.splitlines() if x.strip().startswith("heads:"))
        assert "K=3" in line and str(dest) in line
    finally:
        dest.unlink()


def test_a_missing_heads_file_and_draft_heads_with_ngram_are_one_line(target, tmp_path):
    """A --draft path to a heads file that is not there is named as missing (it said 'not a readable heads
    file ... delete it'); --draft heads with --ngram said 'BadParameter: ... (rerun with --debug for the
    traceback)'."""
    from typer.testing import CliRunner

    from ondevice.cli.main import app

    gone = tmp_path / "gone.heads.safetensors"
    with pytest.raises(OndeviceError, match="no such heads file; pass a .heads.safetensors file") as e:
        ondevice.load(target, draft=gone, threads=1)
    assert str(gone) in str(e.value) and "delete" not in str(e.value)
    r = CliRunner().invoke(app, ["generate", str(target), "-p", "x", "--draft", "heads", "--ngram"])
    assert r.exit_code == 2 and r.output.strip().splitlines() == ["error: use only one of --draft (a model, auto or heads), --ngram, --no-spec"]


def test_the_fix_names_the_model_as_a_path_that_works_from_anywhere(target, tmp_path, monkeypatch):
    """'run `ondevice train-heads tiny.gguf` first' named the file alone, which fails from another folder."""
    monkeypatch.setenv("ONDEVICE_HOME", str(tmp_path))
    monkeypatch.chdir(target.parent)
    with pytest.raises(OndeviceError, match=f"run `ondevice train-heads {target}` first"):
        ondevice.load(target.name, draft="heads", threads=1)


def test_a_truncated_heads_file_is_one_line_naming_the_model_to_train_again(heads_home, tmp_path):
    """A heads file cut short (a copy or download that stopped), stored beside the model or passed as --draft:
    `ondevice generate` prints one line naming the file and the command that writes it again for this model
    (it said `ondevice train-heads MODEL`), `ondevice info` shows the same line as the heads' status, and
    `--draft auto` drafts without them and says so (it passed over them without a word)."""
    import shlex

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
        out = subprocess.run([sys.executable, "-P", "-m", "ondevice", "generate", str(target), "--draft", draft, "-p", "hi",
                              "--max-tokens", "4", "--threads", "1"], capture_output=True, text=True, env=env, timeout=120)
        assert out.returncode == 2 and out.stdout == "", out.stderr
        assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr, out.stderr
        assert str(stored) in out.stderr and "not a readable heads file" in out.stderr and fix in out.stderr, out.stderr
    info = subprocess.run([sys.executable, "-P", "-m", "ondevice", "info", str(target), "--json"], capture_output=True, text=True,
                          env=env, timeout=120)
    assert info.returncode == 0 and fix in info.stdout, info.stdout + info.stderr
    auto = subprocess.run([sys.executable, "-P", "-m", "ondevice", "generate", str(target), "--draft", "auto", "-p", "hi",
                           "--max-tokens", "4", "--threads", "1"], capture_output=True, text=True, env=env, timeout=120)
    said = [ln for ln in auto.stderr.splitlines() if ln.startswith("draft:")]
    assert auto.returncode == 0 and len(said) == 1, auto.stderr  # auto drafts without them, and says why
    assert "heads stored for this model were not used" in said[0] and str(stored) in said[0], said
    assert stored.read_bytes() == good.read_bytes()[:5000]  # nothing written over it


def test_shortlist_scores_its_rows_exactly_and_survives_the_file(tmp_path, monkeypatch):
    """draft_logits: exact logits on the shortlist the low-rank factors pick, −inf elsewhere; the argmax of a
    row lies in it when one row dominates; the factors are kept by the heads file; a heads set too small
    to gain keeps every row exact (no factors)."""
    from ondevice.heads.model import Heads

    rng = np.random.default_rng(0)
    Vd, d = 1024, 256
    out = rng.standard_normal((Vd, d)).astype(np.float32)
    hs = Heads.init(np.arange(Vd), out, out, K=2, rank=16, s_h=1.0, s_e=1.0, seed=0).with_shortlist(rank=32, size=64)
    assert hs.short_a.shape == (Vd, 32) and hs.short_b.shape == (32, d)
    h = rng.standard_normal((5, d)).astype(np.float32)
    h[0] = 3 * out[7]  # row 7 dominates
    lg, full = hs.draft_logits(h), hs.logits(h)
    kept = np.isfinite(lg)
    assert (kept.sum(1) == 64).all() and np.allclose(lg[kept], full[kept], rtol=1e-4, atol=1e-3)
    assert lg[0].argmax() == full[0].argmax() == 7 and hs.draft_logits(h[0]).shape == (Vd,)
    small = Heads.init(np.arange(64), out[:64, :16], out[:64, :16], K=1, rank=4, s_h=1.0, s_e=1.0, seed=0).with_shortlist()
    assert small.short_a is None and np.array_equal(small.draft_logits(h[:, :16]), small.logits(h[:, :16]))
    monkeypatch.setattr(store, "target_sha256", lambda model: "0" * 64)
    p = store.save(tmp_path / "x.heads.safetensors", hs, {"target_sha256": "0" * 64})
    back, _ = store.load(p, tmp_path / "model.gguf", 2048)
    assert back.shortlist == 64 and np.array_equal(back.short_a, hs.short_a)
    # out is stored in float16: the same shortlist, scored on the stored rows
    assert np.array_equal(np.isfinite(back.draft_logits(h)), kept)


def test_shortlist_of_many_rows_gathers_in_bounded_memory():
    """``chain_hits`` scores 2,048 rows at once: the shortlist's gathered rows of ``out`` ([N, shortlist, d]:
    3.2 GB for Qwen 1.5B's heads) are taken a few rows at a time, with the same logits as one row alone."""
    import tracemalloc

    from ondevice.heads.model import Heads

    rng = np.random.default_rng(0)
    Vd, d, N = 1024, 256, 2048
    out = rng.standard_normal((Vd, d)).astype(np.float32)
    hs = Heads.init(np.arange(Vd), out, out, K=1, rank=8, s_h=1.0, s_e=1.0, seed=0).with_shortlist(rank=32, size=64)
    h = rng.standard_normal((N, d)).astype(np.float32)
    tracemalloc.start()
    try:
        lg = hs.draft_logits(h)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 80e6, peak  # one gather of every row would hold N·64·d floats: 134 MB
    for i in (0, 1, N - 1):
        assert np.array_equal(lg[i], hs.draft_logits(h[i]))


def _saved_heads(tmp_path, monkeypatch, hs, **meta) -> tuple:
    """``hs`` saved as a heads file for a stand-in model: (path, its header JSON, its tensors)."""
    import json as _json

    from safetensors import safe_open
    from safetensors.numpy import load_file

    monkeypatch.setattr(store, "target_sha256", lambda model: "0" * 64)
    good = store.save(tmp_path / "g.heads.safetensors", hs, {"target_sha256": "0" * 64, **meta})
    with safe_open(str(good), "np") as f:
        header = _json.loads(f.metadata()["ondevice.heads"])
    return good, header, load_file(str(good))


def _assert_each_refused_in_one_line(tmp_path, cases, vocab_size=None) -> None:
    """Each (tensors, header) written as a heads file is refused by ``store.load`` in one line naming the file and
    the fix, with no warning printed on the way."""
    import json as _json
    import warnings

    from safetensors.numpy import save_file

    for i, (tensors, header) in enumerate(cases):
        p = tmp_path / f"bad{i}.heads.safetensors"
        save_file(tensors, str(p), metadata={"ondevice.heads": _json.dumps(header)})
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(OndeviceError) as e:
                store.load(p, tmp_path / "model.gguf", vocab_size)
        assert str(p) in str(e.value) and "\n" not in str(e.value) and "train-heads" in str(e.value)


def _heads_with_input_only_rows():
    """Tiny heads: 64 draft ids, then 32 input-only ids (100..131); and the embedding rows they were given."""
    from ondevice.heads.model import Heads

    rng = np.random.default_rng(2)
    out = rng.standard_normal((64, 16)).astype(np.float32)
    emb = rng.standard_normal((96, 16)).astype(np.float32)
    return Heads.init(np.arange(64), out, emb, K=1, rank=4, s_h=1.0, s_e=1.0, seed=0, extra=np.arange(100, 132)), emb


def test_a_corrupt_shortlist_in_a_heads_file_is_one_line(tmp_path, monkeypatch):
    """Shortlist factors of the wrong shape, with a NaN, or a shortlist size that is not a positive count up to
    the draft vocabulary: refused in one line naming the file (the heads file is untrusted input)."""
    from ondevice.heads.model import Heads

    rng = np.random.default_rng(1)
    out = rng.standard_normal((1024, 256)).astype(np.float32)
    hs = Heads.init(np.arange(1024), out, out, K=1, rank=8, s_h=1.0, s_e=1.0, seed=0).with_shortlist(rank=32, size=64)
    _, meta, t = _saved_heads(tmp_path, monkeypatch, hs)
    bad_b = dict(t, short_b=t["short_b"][:, :10])
    nan_a = dict(t, short_a=np.where(np.arange(t["short_a"].size).reshape(t["short_a"].shape) == 5, np.nan, t["short_a"]).astype(np.float32))
    _assert_each_refused_in_one_line(tmp_path, [(bad_b, meta), (nan_a, meta), (t, {**meta, "shortlist": -1}),
                                                (t, {**meta, "shortlist": 5000}), (t, {**meta, "shortlist": "many"})], 2048)


def test_a_corrupt_input_vocabulary_in_a_heads_file_is_one_line(tmp_path, monkeypatch):
    """Input-only ids that repeat a draft id, lie outside the target's vocabulary, or do not match the embedding
    rows: refused in one line naming the file; a good file with them loads and maps each id to its row."""
    hs, emb = _heads_with_input_only_rows()
    good, meta, t = _saved_heads(tmp_path, monkeypatch, hs)
    back, header = store.load(good, tmp_path / "model.gguf", 200)
    assert header["input_vocab_size"] == 96 and back.index(200)[120] == 84 and back.index(200)[80] == -1
    assert np.array_equal(back.embed(np.array([84])), emb[84:85].astype(np.float16).astype(np.float32))
    cases = [dict(t, extra=np.arange(60, 92)), dict(t, extra=np.arange(300, 332)), dict(t, extra=np.arange(100, 120)),
             dict(t, extra=t["extra"].reshape(4, 8))]
    _assert_each_refused_in_one_line(tmp_path, [(c, meta) for c in cases], 200)


def test_a_corrupt_extra_dtype_or_emb_range_in_a_heads_file_is_one_line_without_warnings(tmp_path, monkeypatch):
    """Non-integer input-only ids (not silently truncated), an emb beyond float16 (no numpy cast warning on the
    way to the refusal), and a huge id with no vocab_size given (the header's target_vocab_size bounds it, rather
    than ``Heads.index`` allocating terabytes): each refused in one line."""
    hs, _ = _heads_with_input_only_rows()
    _, meta, t = _saved_heads(tmp_path, monkeypatch, hs, target_vocab_size=200)
    big = t["emb"].astype(np.float32)
    big[3, 2] = 1e6
    cases = [dict(t, extra=t["extra"] + 0.5), dict(t, extra=np.full(32, np.nan)), dict(t, emb=big),
             dict(t, extra=t["extra"] + 2**40)]
    _assert_each_refused_in_one_line(tmp_path, [(c, meta) for c in cases])
