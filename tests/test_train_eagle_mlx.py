"""``ondevice train-heads MODEL`` (the EAGLE-style drafter) for an MLX target: one model in memory records the
answers, hands out its layer inputs (``mlx_layers``; the 4-layer target's default ids name layer 2 twice) and
checks the written GGUF in MLX (``mlx_eagle3``) against the trained weights; ``draft="heads"`` then drafts with it
on the MLX target, greedy equal to plain decoding token for token, drafts both kept and rejected.

Target: a tiny random-weight llama written by our converter to MLX (float16: mlx-lm's 8-bit layers cost ~20× more
per pass on this CPU). Everything runs on MLX's CPU device here."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from helpers import greedy_equal, use_trees

import ondevice
from ondevice.errors import OndeviceError

pytest.importorskip("mlx.core", reason="MLX is not installed (pip install 'ondevice[mlx]')")
pytest.importorskip("jax")
from converters.eagle3 import convert_eagle3  # noqa: E402  (the conversion step train_eagle is handed)

SMALL = dict(convert=convert_eagle3, tokens=1500, epochs=12, vocab=256, depths=3, batch_tokens=256, lr=3e-3, max_new=64,
             threads=1, n_ctx=512, quiet=True)
PROMPTS = ["def add(a, b):", "The model draft and the target verify"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(MLX target, home, summary, a copy of the trained checkpoint the GGUF was written from)."""
    from converters import convert
    from ondevice.heads import eagle_store
    from ondevice.heads.eagle_train import train_eagle
    from ondevice.testing import make_tiny_hf

    base = tmp_path_factory.mktemp("mlx-train")
    convert(make_tiny_hf(base / "hf", arch="llama", n_layers=4), to="mlx", out=base / "mlx", bits=16, progress=False)
    home, kept = base / "home", base / "checkpoint"
    real = eagle_store.save_checkpoint

    def keep(folder, *a, **k):
        out = real(folder, *a, **k)
        shutil.copytree(out, kept)
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ONDEVICE_HOME", str(home))
        mp.setattr(eagle_store, "save_checkpoint", keep)
        r = train_eagle(base / "mlx", **SMALL)
    return base / "mlx", home, r, kept


@pytest.fixture(autouse=True)
def _home(trained, monkeypatch) -> None:
    """Every test here reads the drafter stored under the trained run's ONDEVICE_HOME."""
    monkeypatch.setenv("ONDEVICE_HOME", str(trained[1]))


def test_the_stored_drafter_was_checked_in_mlx(trained):
    from ondevice.heads import eagle_store, store

    target, _, r, _ = trained
    path = Path(r["path"])
    assert path == eagle_store.find(target) and r["target_layers"] == [2, 2, 1]
    assert eagle_store.read_meta(path)["target_sha256"] == store.target_sha256(target)
    v = r["verify"]
    assert v["runtime"] == "MLX" and v["ok"] and v["logit_rel"] < 1e-2  # f16: argmax may differ at near ties
    assert r["log"][-1]["loss"] < r["log"][0]["loss"] and r["tau_heldout"]["tau_chain3"] >= 1.0


def test_the_check_refuses_a_file_that_is_not_the_trained_weights(trained, tmp_path):
    """The converter's MLX check (``verify_eagle3(mlx_target=…)``) compares the file with the checkpoint: the same
    file against weights changed after the conversion is refused in one line (the check can fail)."""
    from safetensors.numpy import load_file, save_file

    from converters.eagle3_check import verify_eagle3
    from converters.eagle3_source import open_eagle3, target_info
    from ondevice.backends.mlx import MLXBackend

    target, _, r, kept = trained
    b = MLXBackend(target, n_ctx=256, device="cpu")
    try:
        b.enable_layer_inputs(r["target_layers"])
        tgt = target_info(target)
        assert verify_eagle3(open_eagle3(kept), Path(r["path"]), tgt, mlx_target=b)["ok"]
        other = tmp_path / "changed"
        shutil.copytree(kept, other)
        t = load_file(other / "model.safetensors")
        t["midlayer.mlp.down_proj.weight"] = t["midlayer.mlp.down_proj.weight"] * 3 + 0.05
        save_file(t, other / "model.safetensors")
        with pytest.raises(OndeviceError, match="MLX's logits differ") as e:
            verify_eagle3(open_eagle3(other), Path(r["path"]), tgt, mlx_target=b)
        assert "\n" not in str(e.value)
    finally:
        b.close()


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_greedy_with_the_trained_drafter_on_mlx_equals_plain(trained, shape):
    target = trained[0]
    with ondevice.load(target, draft="heads", device="cpu") as spec, \
            ondevice.load(target, drafter="none", device="cpu") as plain:
        assert spec.drafter.name == "eagle3" and type(spec.drafter.graph).__name__ == "Eagle3MLX"
        use_trees(spec.drafter, shape == "tree")
        drafted, accepted = greedy_equal(spec, plain, PROMPTS, (1, 3))
        assert 0 < accepted < drafted, (drafted, accepted)


def test_auto_weighs_the_trained_drafter_on_mlx(trained):
    """``draft="auto"`` (``autodraft.heads_row``) on the MLX target judges the drafter ``train-heads`` stored, timed
    in MLX: a verdict with its expected speedup (it read llama.cpp's ``target._ctx``: an AttributeError)."""
    from ondevice import autodraft
    from ondevice.backends.mlx import MLXBackend

    b = MLXBackend(trained[0], n_ctx=256, device="cpu")
    try:
        row = autodraft.heads_row(b)
    finally:
        b.close()
    assert row["format"] == "eagle" and row["ok"], row
    assert "trained EAGLE drafter" in row["reason"] and row["expected_speedup"] > 0


def test_the_converter_reads_a_quantized_mlx_target(tmp_path):
    """``train-heads`` on a 4-bit MLX target (``ondevice convert --to mlx``'s default) hands the converter that
    directory as the target: ``target_info`` reads its config and tokenizer as the float one's (it refused the
    ``quantization`` key as a checkpoint to convert, after the recording, features and fit)."""
    from converters import convert
    from converters.eagle3_source import target_info
    from ondevice.testing import make_tiny_hf

    hf = make_tiny_hf(tmp_path / "hf", arch="qwen2", n_layers=4)
    convert(hf, to="mlx", out=tmp_path / "q4", bits=4, progress=False)
    got, want = target_info(tmp_path / "q4"), target_info(hf)
    assert (got.arch, got.hidden, got.n_layers) == (want.arch, want.hidden, want.n_layers)
    assert got.vocab.tokens == want.vocab.tokens


def test_a_qwen2_mlx_target_hands_out_its_layer_inputs(tmp_path):
    """mlx-lm's qwen2 runs a fresh slice of its layer list each pass (``PipelineMixin.pipeline_layers``): the taps
    go in the list it slices, so a qwen2 MLX target hands out the real inputs of its layers (it was refused in
    one line, "saw [None, None, None]": no EAGLE drafter could train or draft on Qwen MLX targets)."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.base import create_attention_mask

    from converters import convert
    from ondevice.backends.mlx import MLXBackend
    from ondevice.testing import make_tiny_hf

    convert(make_tiny_hf(tmp_path / "hf", arch="qwen2", n_layers=4), to="mlx", out=tmp_path / "mlx", bits=16,
            progress=False)
    b = MLXBackend(tmp_path / "mlx", n_ctx=64, device="cpu")
    try:
        ids = b.tokenize(PROMPTS[0])
        plain = b.eval(ids)
        b.rollback(0)
        d = b.enable_layer_inputs([2, 2, 1]) // 3
        np.testing.assert_array_equal(b.eval(ids), plain)
        rows = np.stack([b.feature("layer_inputs", p) for p in range(len(ids))])
        h, cache, seen = b.model.model.embed_tokens(mx.array([ids])), b._new_cache(), []
        mask = create_attention_mask(h, cache[0])
        for i, layer in enumerate(b.model.model.layers):
            seen.append(np.array(h[0].astype(mx.float32)))
            h = layer(h, mask, cache[i])
        np.testing.assert_allclose(rows, np.concatenate([seen[2], seen[2], seen[1]], axis=-1), rtol=1e-3, atol=1e-3)
        assert rows.shape == (len(ids), 3 * d)
    finally:
        b.close()
