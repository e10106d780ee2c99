"""Layer inputs of a qwen2 target (whose llama.cpp graph records none) through ``LlamaBackend``'s cb_eval tap:
``enable_layer_inputs`` then ``feature("layer_inputs", pos)`` after ``eval`` give the numpy reference forward's
residual stream, over prefills split into many decodes, after rollbacks and tree passes; on a llama target the
tap gives exactly what llama.cpp records itself."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ondevice.errors import OndeviceError

IDS = [1, 2, 3]
TOKENS = [int(t) for t in np.random.default_rng(3).integers(3, 500, size=40)]


def _build(base, arch):
    from converters import convert
    from ondevice.testing import make_tiny_hf

    hf = make_tiny_hf(base / "hf", arch=arch, n_layers=4)
    convert(hf, to="gguf", quant="f16", out=base / "gguf", progress=False)
    return hf, base / "gguf" / "model.gguf"


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    return _build(tmp_path_factory.mktemp("tap-qwen2"), "qwen2")


def _reference_layer_inputs(hf, tokens) -> np.ndarray:
    """[n_layers + 1, len(tokens), hidden]: the residual stream entering each layer (and leaving the last), from
    the numpy float32 forward on the source weights (``ondevice.formats.decoder``)."""
    from safetensors.numpy import load_file

    from ondevice.formats.decoder import DecoderConfig, NumpyOps, forward, load_weights

    cfg = DecoderConfig.from_hf(json.loads((hf / "config.json").read_text()), archs=("qwen2", "llama"))
    w = load_weights(load_file(hf / "model.safetensors").items())
    stream = []

    class Recording(NumpyOps):
        def embed(self, table, ids):
            x = super().embed(table, ids)
            stream.append(x)
            return x

        def add(self, a, b):
            out = super().add(a, b)
            if out.shape[-1] == cfg.hidden:  # a residual add (rms_norm's adds are [S, 1])
                stream.append(out)
            return out

    forward(Recording(cfg, len(tokens)), cfg, w, tokens, 0)
    return np.array(stream[::2])  # embedding, then after each layer's attention and MLP adds: keep every other


def _rows(b, lo, hi):
    return np.array([b.feature("layer_inputs", p) for p in range(lo, hi)])


def test_qwen2_layer_inputs_equal_the_reference_forward(qwen2):
    """Rows of a 40-token prefill split into decodes of 16 (3 decodes) are the reference's inputs of layers 1..3,
    concatenated in the order asked; each layer's block is nearer its own layer than any other (the control)."""
    from ondevice.backends.llama import LlamaBackend

    hf, gguf = qwen2
    ref = _reference_layer_inputs(hf, TOKENS)
    b = LlamaBackend(gguf, n_ctx=256, threads=1, n_batch=16)
    try:
        order = [3, 1, 2]
        assert b.enable_layer_inputs(order) == 3 * 256
        b.eval(TOKENS, "all")
        got = _rows(b, 0, len(TOKENS))
        assert got.shape == (len(TOKENS), 3 * 256)
        for k, il in enumerate(order):
            block = got[:, k * 256:(k + 1) * 256]
            err = [np.abs(block - ref[j]).max() / np.abs(ref[j]).max() for j in range(len(ref))]
            assert err[il] < 2e-2, (il, err)
            assert min(e for j, e in enumerate(err) if j != il) > 10 * err[il], (il, err)
    finally:
        b.close()


def test_qwen2_rows_follow_rollbacks_and_logits_are_unchanged(qwen2):
    """After rollback and re-evaluation (``"last"`` logits, single tokens) the rows of every cached position are
    those of the first pass; positions past the cache have none; the tap changes no logit."""
    from ondevice.backends.llama import LlamaBackend

    gguf = qwen2[1]
    plain = LlamaBackend(gguf, n_ctx=256, threads=1, n_batch=16)
    b = LlamaBackend(gguf, n_ctx=256, threads=1, n_batch=16)
    try:
        b.eval(TOKENS[:3], "last")  # a context with something in it: enabling the tap empties it (documented)
        b.enable_layer_inputs(IDS)
        assert b.n_past == 0
        want = plain.eval(TOKENS, "all")
        assert np.array_equal(b.eval(TOKENS, "all"), want)
        first = _rows(b, 0, 40)
        b.rollback(21)
        plain.rollback(21)
        assert b.feature("layer_inputs", 21) is None and b.feature("layer_inputs", 20) is not None
        assert np.array_equal(b.eval(TOKENS[21:30], "last"), plain.eval(TOKENS[21:30], "last"))
        assert np.array_equal(b.eval([TOKENS[30]], "all"), plain.eval([TOKENS[30]], "all"))
        assert np.abs(_rows(b, 0, 31) - first[:31]).max() <= 1e-3 * np.abs(first).max()  # batch-shape rounding
    finally:
        b.close()
        plain.close()


def test_qwen2_rows_follow_the_kept_tree_path(qwen2):
    """After a tree pass (``eval_tree``) and ``keep_path`` of a branch other than the first, the rows of the kept
    positions are those a chain pass of that path gives; a later chain pass continues them."""
    from ondevice.backends.llama import LlamaBackend

    gguf = qwen2[1]
    tree, chain = (LlamaBackend(gguf, n_ctx=256, threads=1) for _ in range(2))
    try:
        for b in (tree, chain):
            b.enable_layer_inputs(IDS)
            b.eval(TOKENS[:20], "last")
        # root 20 → a (1), b (2); a → c (3); b → d (4), e (5); keep root, b, e
        toks, parents = [TOKENS[20], 7, 8, 9, 10, 11], [-1, 0, 0, 1, 2, 2]
        tree.eval_tree(toks, parents)
        other = tree._tree_rows[1]  # node a's row, at the position b's row will take
        tree.keep_path([0, 2, 5])
        chain.eval([TOKENS[20], 8, 11], "all")
        tree.eval([12], "all")
        chain.eval([12], "all")
        want = _rows(chain, 0, 24)
        assert tree.feature("layer_inputs", 24) is None
        assert np.abs(_rows(tree, 0, 24) - want).max() <= 1e-3 * np.abs(want).max()
        assert np.abs(tree.feature("layer_inputs", 21) - other).max() > 0.1  # the control: the other branch's row
    finally:
        tree.close()
        chain.close()


def test_tap_reads_what_llama_cpp_records_on_a_llama_target(tmp_path, monkeypatch):
    """Forced onto a llama target (as if its graph recorded nothing), the tap gives llama.cpp's own recorded
    layer inputs bit for bit, over a prefill of several decodes and a later single-token pass."""
    from ondevice.backends import llama_ext
    from ondevice.backends.llama import LlamaBackend

    gguf = _build(tmp_path, "llama")[1]
    rec = LlamaBackend(gguf, n_ctx=256, threads=1, n_batch=16)
    rec.enable_layer_inputs(IDS)
    monkeypatch.setattr(llama_ext, "LAYER_INP_ARCHS", llama_ext.LAYER_INP_ARCHS - {"llama"})
    tap = LlamaBackend(gguf, n_ctx=256, threads=1, n_batch=16)
    try:
        tap.enable_layer_inputs(IDS)
        assert tap._tap is not None and rec._tap is None
        for b in (rec, tap):
            b.eval(TOKENS[:37], "last")
            b.eval(TOKENS[37:38], "all")
        assert np.array_equal(_rows(rec, 0, 38), _rows(tap, 0, 38))
    finally:
        tap.close()
        rec.close()


def test_refusals(qwen2):
    """Layer 0 (no named tensor) and a layer past the last are refused in one line naming the architecture."""
    from ondevice.backends.llama import LlamaBackend

    b = LlamaBackend(qwen2[1], n_ctx=256, threads=1)
    try:
        for ids, what in (([0, 2], "layer 0's input"), ([1, 4], "has 4 layers")):
            with pytest.raises(OndeviceError, match=what) as e:
                b.enable_layer_inputs(ids)
            assert "'qwen2'" in str(e.value) and "\n" not in str(e.value)
        assert b.enable_layer_inputs([2]) == 256  # still usable
        b.eval(TOKENS[:4], "all")
        assert b.feature("layer_inputs", 3).shape == (256,)
    finally:
        b.close()


def test_a_failing_tap_never_cuts_the_pass_short(qwen2):
    """What goes wrong inside the callback (here: rows of another width than the tap was told) is raised by
    ``read``, and the pass is computed whole: a False from the callback would make llama.cpp skip the rest of the
    graph and leave wrong logits."""
    from ondevice.backends import llama_ext
    from ondevice.backends.llama import LlamaBackend

    gguf = qwen2[1]
    plain = LlamaBackend(gguf, n_ctx=256, threads=1)
    b = LlamaBackend(gguf, n_ctx=256, threads=1)
    try:
        tap = llama_ext.EvalTap([1], 255, 4)  # the target's rows are 256 wide
        b._lib.llama_free(b._ctx)
        b._open_context(tap.callback)
        assert np.array_equal(b.eval(TOKENS[:9], "all"), plain.eval(TOKENS[:9], "all"))
        with pytest.raises(OndeviceError, match="not float32 rows of width 255"):
            tap.read()
    finally:
        b.close()
        plain.close()
