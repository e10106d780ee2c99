"""Heads on MLX targets: hidden states from the same forward (logits unchanged), training on an MLX
directory end to end, greedy chains and trees equal to plain decoding, heads of another model refused."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import numpy as np
import pytest
from helpers import batch_invariant, heads_greedy_equals_plain

import ondevice
from ondevice.errors import OndeviceError

mx = pytest.importorskip("mlx.core", reason="MLX is not installed (pip install 'ondevice[mlx]')")

PROMPTS = ["def add(a, b):", "The model draft and the target verify", "class Cache:\n    def __init__(self, n):"]


def _open(path):
    from ondevice.backends.mlx import MLXBackend

    return MLXBackend(path, n_ctx=256, device="cpu")


@pytest.fixture(scope="module")
def trained(tiny_mlx, tmp_path_factory):
    """(MLX directory, heads file, summary, store home): heads trained once for the tiny MLX llama."""
    from ondevice.heads.train import train_heads

    home = tmp_path_factory.mktemp("home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ONDEVICE_HOME", str(home))
        target = tiny_mlx("llama")
        r = train_heads(target, tokens=1200, epochs=6, K=3, rank=64, vocab=512, max_new=64, threads=1, n_ctx=512, quiet=True)
        yield target, Path(r["path"]), r, home


@pytest.fixture
def home(trained, monkeypatch):
    monkeypatch.setenv("ONDEVICE_HOME", str(trained[3]))
    return trained[3]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # tied embeddings / a separate lm_head, both 8-bit quantized
def test_hidden_rows_are_the_lm_heads_input_and_logits_do_not_change(tiny_mlx, arch):
    b = _open(tiny_mlx(arch))
    try:
        ids = b.tokenize(PROMPTS[1])
        plain = b.eval(ids)
        plain_step = b.eval([5])
        b.rollback(0)
        plain_last = b.eval(ids, logits="last")
        b.rollback(0)
        d = b.enable_hidden()
        on = b.eval(ids)
        np.testing.assert_array_equal(on, plain)  # bit for bit
        H = np.stack([b.hidden(i) for i in range(len(ids))])
        assert H.shape == (len(ids), d) and b.hidden(len(ids)) is None
        # the rows are the inner model's output (after the final norm), computed on a fresh cache
        ref = b.model.model(mx.array([ids]), cache=b._new_cache())[0]
        np.testing.assert_array_equal(H, np.array(ref.astype(mx.float32)))
        # ... and the output layer's rows (dequantized by mx.dequantize) turn them into the logits
        out, emb, name = b.output_rows(np.arange(b.vocab_size))
        assert name == arch and out.shape == emb.shape == (b.vocab_size, d)
        np.testing.assert_allclose(H @ out.T, plain, atol=0.05 * np.abs(plain).max())
        assert np.mean((H @ out.T).argmax(1) == plain.argmax(1)) == 1.0
        np.testing.assert_array_equal(emb[:7], np.array(b.model.model.embed_tokens(mx.arange(7)).astype(mx.float32)))
        np.testing.assert_array_equal(b.eval([5]), plain_step)
        assert b.hidden(len(ids)) is not None and b.hidden(len(ids) - 1) is None  # only the last eval's rows
        b.rollback(0)
        last = b.eval(ids, logits="last")  # the prefix fills the cache; only the last row comes back
        np.testing.assert_array_equal(last, plain_last)
        np.testing.assert_array_equal(b.hidden(len(ids) - 1), H[-1])
        assert b.hidden(len(ids) - 2) is None
        b.rollback(3)
        assert b.hidden(len(ids) - 1) is None  # no longer cached
    finally:
        b.close()


def test_tree_pass_keeps_the_kept_paths_hidden_rows(tiny_mlx):
    path = tiny_mlx("qwen2")
    exact = batch_invariant(path, kind="mlx")
    b = _open(path)
    try:
        ids = b.tokenize(PROMPTS[0])
        tokens, parents = [ids[-1], 11, 12, 13, 14], [-1, 0, 0, 1, 3]
        b.eval(ids[:-1])
        base = b.n_past
        off = b.eval_tree(tokens, parents)
        b.keep_path([])
        d = b.enable_hidden()
        np.testing.assert_array_equal(b.eval_tree(tokens, parents), off)  # logits unchanged
        assert b.hidden(base) is None  # nothing is kept until keep_path
        b.keep_path([0, 1, 3, 4])
        got = np.stack([b.hidden(base + i) for i in range(4)])
        assert got.shape == (4, d) and b.hidden(base + 4) is None
        b.rollback(base)
        b.eval([tokens[i] for i in (0, 1, 3, 4)])
        chain = np.stack([b.hidden(base + i) for i in range(4)])
        if exact:
            np.testing.assert_array_equal(got, chain)
        else:
            np.testing.assert_allclose(got, chain, atol=1e-2)
        b.eval_tree(tokens, parents)
        b.keep_path([0, 2])  # another branch: its own rows
        assert not np.array_equal(b.hidden(base + 1), chain[1])
    finally:
        b.close()


def test_an_architecture_with_logit_soft_capping_is_refused_in_one_line(tiny_mlx):
    b = _open(tiny_mlx("llama"))
    try:
        cls = type(b.model)

        def capped(self, inputs, cache=None, input_embeddings=None):
            return mx.tanh(cls.__call__(self, inputs, cache) / 30.0) * 30.0

        b.model.__class__ = type("Capped", (cls,), {"__call__": capped, "__module__": __name__})
        with pytest.raises(OndeviceError, match=r"heads cannot use it") as e:
            b.enable_hidden()
        assert "\n" not in str(e.value) and Path(__file__).name in str(e.value)
        assert b.hidden(0) is None
    finally:
        b.close()


def test_one_sequence_records_as_record_answer(tiny_mlx, tmp_path):
    """The single-sequence stand-in for the batched recorder gives the answer ``record_answer`` gives."""
    from ondevice.heads import batch, data

    b = _open(tiny_mlx("llama"))
    try:
        b.enable_hidden()
        prompts = [b.tokenize(p) for p in PROMPTS[:2]]
        recs = batch.collect_many(data.OneSequence(b), [("code", p) for p in prompts], tmp_path, budget=10**6, max_new=12)
        for p, rec in zip(prompts, recs, strict=True):
            ref = data.record_answer(b, p, 12)
            assert rec.tokens.tolist() == ref.tokens.tolist() and rec.prompt.tolist() == p
            np.testing.assert_allclose(rec.hidden, ref.hidden, atol=2e-3)  # stored as float16
    finally:
        b.close()


def test_model_directory_sha256_is_its_weights(tiny_mlx, tiny_gguf, tmp_path):
    from ondevice.heads import store

    src = tiny_mlx("llama")
    copy = tmp_path / "moved"
    shutil.copytree(src, copy)
    (copy / "config.json").write_text((copy / "config.json").read_text() + "\n")
    sha = store.target_sha256(src)
    assert store.target_sha256(copy) == sha  # the same weights anywhere
    assert store.target_sha256(tiny_mlx("qwen2")) != sha
    with open(copy / "model.safetensors", "r+b") as f:  # one byte of the weights changes it
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 1]))
    assert store.target_sha256(copy) != sha
    gguf = tiny_gguf("llama")  # a GGUF file: its own sha256, as before
    assert store.target_sha256(gguf) == hashlib.sha256(gguf.read_bytes()).hexdigest()


def test_train_heads_on_an_mlx_directory(trained, home):
    from ondevice.heads import store

    target, path, r, _ = trained
    assert path == store.default_path(target) and path.parent == home / "heads"
    assert path.name.startswith(f"{target.name}-") and store.find(target) == path
    meta = store.read_meta(path)
    assert meta["target_sha256"] == store.target_sha256(target) and meta["architecture"] == "llama"
    assert meta["target_file"] == target.name and meta["K"] == 3 and meta["hidden_size"] == 256
    assert meta["training_tokens"] > 500 and meta["tau_heldout_greedy_chain"]["tau"] >= 1.0
    assert store.summary(target)["K"] == 3


@pytest.mark.parametrize("shape,gamma", [("chain", 3), ("tree", 3), ("tree", 8)])
def test_greedy_with_heads_equals_plain_on_mlx(trained, home, shape, gamma):
    """Greedy speculation with heads on an MLX target — a chain, or best-first trees verified in one pass —
    emits plain decoding's tokens (the tiny 8-bit MLX model is batch-invariant on this backend)."""
    target = trained[0]
    if not batch_invariant(target, kind="mlx"):
        pytest.skip("MLX logits depend on batch size here; greedy equality is not asserted")
    with ondevice.load(target, draft="heads", device="cpu") as spec, ondevice.load(target, drafter="none", device="cpu") as plain:
        assert spec.drafter.name == "heads"
        assert heads_greedy_equals_plain(spec, plain, PROMPTS, shape, gamma)[1] > 0


def test_heads_of_the_gguf_model_are_refused_on_the_mlx_model(trained, home, tiny_gguf):
    """The MLX directory converted from the GGUF holds the same weights, but heads name the file they were
    made for: each format's heads are refused on the other in one line (no silent reuse)."""
    from ondevice.heads import store
    from ondevice.heads.model import Heads
    from ondevice.heads.train import target_rows

    mlx_dir, mlx_heads = trained[0], trained[1]
    gguf = tiny_gguf("llama")
    ids = np.arange(64)
    out, emb, arch = target_rows(gguf, ids)
    heads = Heads.init(ids, out, emb, 3, 16, 1.0, 1.0, 0)
    gguf_heads = store.save(home / "gguf-llama.heads.safetensors", heads,
                            {"target_sha256": store.target_sha256(gguf), "target_file": gguf.name, "architecture": arch})
    with pytest.raises(OndeviceError, match=r"heads made for another model \(model.gguf") as e:
        ondevice.load(mlx_dir, draft=str(gguf_heads), device="cpu")
    assert "\n" not in str(e.value)
    with pytest.raises(OndeviceError, match=rf"heads made for another model \({mlx_dir.name}") as e:
        ondevice.load(gguf, draft=str(mlx_heads), threads=1)
    assert "\n" not in str(e.value)
