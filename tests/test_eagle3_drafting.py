"""EAGLE-3 drafting: the target's layer features (llama.cpp's recording, the cb_eval route for qwen2), the
bindings, and chains / trees drafted by llama.cpp's eagle3 graph against the numpy forward of the source."""

from __future__ import annotations

import numpy as np
import pytest
from test_eagle3 import _draft, _target

from ondevice.errors import OndeviceError


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A 4-layer tiny llama target (hidden 256, vocabulary 512) as an f16 GGUF; returns (HF dir, GGUF)."""
    return _target(tmp_path_factory, "llama")


@pytest.fixture(scope="module")
def qwen3_target(tmp_path_factory):
    return _target(tmp_path_factory, "qwen3")


@pytest.fixture(scope="module")
def qwen2_target(tmp_path_factory):
    """Qwen2.5's architecture: its graph records no layer inputs."""
    return _target(tmp_path_factory, "qwen2")


def test_llama_target_records_the_layer_inputs(target):
    """After a target decode, layer 0's recorded input is the token embedding rows exactly, and a batch's rows
    equal those of the same tokens decoded one at a time (llama.cpp's own graph, via llama_ext)."""
    from converters.eagle3_check import target_embedding
    from ondevice.backends import llama_ext
    from ondevice.backends.llama import LlamaBackend

    b = LlamaBackend(target[1], n_ctx=256, n_batch=32)
    try:
        ids, h = [0, 1, 3], 256
        with pytest.raises(OndeviceError, match="layer 0's input is not recorded"):
            llama_ext.layer_inputs(b._ctx, ids, 1, h)  # llama.cpp itself would abort the process
        llama_ext.record_layer_inputs(b._ctx, b._model, ids)
        toks = [5, 77, 300, 12, 9, 410]
        b.eval(toks, "all")
        feats = llama_ext.layer_inputs(b._ctx, ids, len(toks), h)
        assert np.array_equal(feats[:, :h], target_embedding(target[1])[toks])
        b.rollback(0)
        one = []
        for t in toks:
            b.eval([t], "all")
            one.append(llama_ext.layer_inputs(b._ctx, ids, 1, h)[0])
        assert np.abs(feats - np.array(one)).max() <= 1e-3 * np.abs(feats).max()
        assert np.abs(feats[:, 2 * h:] - feats[:, :h]).max() > 0.1  # layer 3 is not the embedding
    finally:
        b.close()


def test_qwen2_target_refused_before_llama_cpp_would_abort(qwen2_target):
    """qwen2's graph in this llama.cpp records no layer inputs; asking would abort the process (GGML_ASSERT),
    so the request is refused in one line naming the architecture."""
    from ondevice.backends import llama_ext
    from ondevice.backends.llama import LlamaBackend

    b = LlamaBackend(qwen2_target[1], n_ctx=128, n_batch=16)
    try:
        with pytest.raises(OndeviceError, match="architecture 'qwen2' does not expose its layer inputs"):
            llama_ext.record_layer_inputs(b._ctx, b._model, [1])
    finally:
        b.close()


def test_bindings_resolve_mangled_names():
    from ondevice.backends import llama_ext

    assert llama_ext.mangled("llama_get_embeddings_layer_inp") == "_Z30llama_get_embeddings_layer_inpP13llama_contextj"
    for name in llama_ext._SIGNATURES:
        assert llama_ext.fn(name) is not None


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_chain_drafting_matches_the_reference_over_two_rounds(request, tmp_path, arch):
    """Greedy chains drafted from a real target's layer features (the draft embedding with the target's table
    through ctx_other) equal the numpy forward's, after a prefill and after a verify pass that kept one draft."""
    target = request.getfixturevalue("target" if arch == "llama" else "qwen3_target")
    from converters.eagle3 import convert_eagle3, open_eagle3
    from converters.eagle3_check import encode, reference, target_embedding
    from ondevice.backends import llama_ext
    from ondevice.backends.eagle3 import Eagle3Graph, draft_chain
    from ondevice.backends.llama import LlamaBackend

    src_dir = _draft(tmp_path, own_embeddings=False, dtype="float32", draft_vocab=256, layer_ids=[0, 2, 3])
    convert_eagle3(src_dir, target=target[1], out=tmp_path / "out", dtype="f32")
    src, emb = open_eagle3(src_dir), target_embedding(target[1])
    b = LlamaBackend(target[1], n_ctx=256, n_batch=32)
    g = Eagle3Graph(tmp_path / "out" / "model.gguf", b._ctx, b._model, n_ctx=256, exact=True)
    try:
        ids = g.layer_ids
        llama_ext.record_layer_inputs(b._ctx, b._model, ids)
        prompt = [5, 77, 300, 12, 9, 410]
        x = int(np.argmax(b.eval(prompt, "all")[-1]))
        f1 = llama_ext.layer_inputs(b._ctx, ids, len(prompt), 256)
        d1, q1 = draft_chain(g, f1, prompt, 0, x, 3)

        def ref_chain(T, G, k):
            T, G, out = list(T), list(G), []
            for _ in range(k):
                logits, pre = reference(src, np.array(G), T, emb, 512)
                out.append(int(np.argmax(logits[-1])))
                T.append(out[-1])
                G.append(pre[-1])
            return out

        T, G = prompt[1:] + [x], list(encode(src, f1))
        assert d1 == ref_chain(T, G, 3)
        assert q1.shape == (3, 512) and np.array_equal(q1.argmax(-1), d1)
        # verify pass over [x, d1...]; the target keeps d1[0] and then chooses y
        rows = b.eval([x, *d1], "all")
        f2 = llama_ext.layer_inputs(b._ctx, ids, 4, 256)
        y = int(np.argmax(rows[1]))
        b.rollback(len(prompt) + 2)
        d2, _ = draft_chain(g, f2[:2], [x, d1[0]], len(prompt), y, 3)
        assert d2 == ref_chain(T + [d1[0], y], G + list(encode(src, f2[:2])), 3)
        # the same rows from a fresh draft cache (nothing left over from the rejected drafts)
        assert draft_chain(g, np.concatenate([f1, f2[:2]]), [*prompt, x, d1[0]], 0, y, 3)[0] == d2
    finally:
        g.close()
        b.close()


def _raw_context(path, tap=None, n_ubatch=64):
    """(model, context) through llama-cpp-python's low-level API, with ``tap.callback`` as cb_eval."""
    import llama_cpp

    from ondevice.backends.llama import init_llama

    init_llama()
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), llama_cpp.llama_model_default_params())
    cp = llama_cpp.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch = 256, 64, n_ubatch
    if tap is not None:
        cp.cb_eval, cp.cb_eval_user_data = tap.callback, None
    return model, llama_cpp.llama_init_from_model(model, cp)


def _decode(ctx, toks):
    import llama_cpp

    arr = (llama_cpp.llama_token * len(toks))(*toks)
    assert llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(arr, len(toks))) == 0


def _free(model, ctx):
    import llama_cpp

    llama_cpp.llama_free(ctx)
    llama_cpp.llama_model_free(model)


def test_cb_eval_tap_reads_what_llama_cpp_records(target):
    """The public cb_eval route gives exactly llama.cpp's own recorded layer inputs on a llama target (here over
    a decode split into ubatches of 4), so it can stand in for it on architectures that record none."""
    from ondevice.backends import llama_ext

    ids, toks = [1, 3, 1], [5, 77, 300, 12, 9, 410, 33, 2, 100, 101]
    tap = llama_ext.EvalTap(ids, 256, 4)
    m1, c1 = _raw_context(target[1], tap, n_ubatch=4)
    m2, c2 = _raw_context(target[1])
    try:
        llama_ext.record_layer_inputs(c2, m2, ids)
        _decode(c1, toks)
        _decode(c2, toks)
        got = tap.read()
        assert got.shape == (len(toks), 3 * 256)
        assert np.abs(got - llama_ext.layer_inputs(c2, ids, len(toks), 256)).max() <= 1e-5 * np.abs(got).max()
        with pytest.raises(OndeviceError, match="not seen by cb_eval"):
            tap.read()
    finally:
        _free(m1, c1)
        _free(m2, c2)


def test_cb_eval_tap_on_qwen2(qwen2_target):
    """qwen2 records nothing itself; through cb_eval its layer inputs come out, the same for a batch as for the
    tokens one at a time."""
    from ondevice.backends import llama_ext

    ids, toks = [1, 3], [5, 77, 300, 12, 9]
    tap = llama_ext.EvalTap(ids, 256, 4)
    m, c = _raw_context(qwen2_target[1], tap)
    try:
        _decode(c, toks)
        batch = tap.read()
        import llama_cpp

        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(c), False)
        one = []
        for t in toks:
            _decode(c, [t])
            one.append(tap.read()[0])
        assert np.abs(batch - np.array(one)).max() <= 1e-3 * np.abs(batch).max()
        assert np.abs(batch[:, :256] - batch[:, 256:]).max() > 0.1
    finally:
        _free(m, c)
    with pytest.raises(OndeviceError, match="layer 0"):
        llama_ext.EvalTap([0, 1, 2], 256, 4)
    with pytest.raises(OndeviceError, match="has 4 layers"):
        llama_ext.EvalTap([1, 2, 4], 256, 4)


def test_chain_drafting_on_qwen2_through_cb_eval(qwen2_target, tmp_path):
    """A qwen2 target drafts with EAGLE-3 through the cb_eval route: the chain equals the numpy forward's."""
    import llama_cpp

    from converters.eagle3 import convert_eagle3, open_eagle3
    from converters.eagle3_check import encode, reference, target_embedding
    from ondevice.backends import llama_ext
    from ondevice.backends.eagle3 import Eagle3Graph, draft_chain

    src_dir = _draft(tmp_path, own_embeddings=False, dtype="float32", layer_ids=[1, 2, 3])
    convert_eagle3(src_dir, target=qwen2_target[1], out=tmp_path / "out", dtype="f32")
    src, emb = open_eagle3(src_dir), target_embedding(qwen2_target[1])
    tap = llama_ext.EvalTap([1, 2, 3], 256, 4)
    m, c = _raw_context(qwen2_target[1], tap)
    g = Eagle3Graph(tmp_path / "out" / "model.gguf", c, m, n_ctx=256, exact=True)
    try:
        with pytest.raises(OndeviceError, match="'qwen2' does not expose"):
            llama_ext.record_layer_inputs(c, m, g.layer_ids)
        prompt = [5, 77, 300, 12, 9, 410]
        _decode(c, prompt)
        x = int(np.argmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(c, -1), shape=(512,))))
        feats = tap.read()
        drafted, _ = draft_chain(g, feats, prompt, 0, x, 3)
        T, G, want = prompt[1:] + [x], list(encode(src, feats)), []
        for _ in range(3):
            logits, pre = reference(src, np.array(G), T, emb, 512)
            want.append(int(np.argmax(logits[-1])))
            T.append(want[-1])
            G.append(pre[-1])
        assert drafted == want
    finally:
        g.close()
        _free(m, c)


def test_sampled_chain_q_is_the_processed_draft_distribution(target, tmp_path):
    """With a sampling pick (the request's processing via ondevice.sampling), each q row is the draft's processed
    distribution: it sums to 1, lives on d2t's target ids only, and equals probs() of the draft's logits row
    (recomputed by feeding the drawn tokens back through the graph); draws follow it."""
    from converters.eagle3 import convert_eagle3, open_eagle3
    from ondevice.backends.eagle3 import Eagle3Graph, draft_chain
    from ondevice.sampling import SamplingParams, probs, probs_sparse, sample_sparse

    src_dir = _draft(tmp_path, own_embeddings=True, dtype="float32")
    convert_eagle3(src_dir, target=target[1], out=tmp_path / "out", dtype="f32")
    d2t = open_eagle3(src_dir).d2t
    params = SamplingParams(temperature=0.8, top_k=0, top_p=1.0, min_p=0.0)
    rng = np.random.default_rng(0)

    def pick(row):
        ids, pr = probs_sparse(row, params, [])
        q = np.zeros(row.shape[-1])
        q[ids] = pr
        return sample_sparse(ids, pr, rng), q

    g = Eagle3Graph(tmp_path / "out" / "model.gguf", None, None, n_ctx=128, exact=True)
    try:
        feats = np.random.default_rng(1).normal(size=(4, 768)).astype(np.float32)
        toks, q = draft_chain(g, feats, [5, 6, 7, 8], 0, 9, 4, pick=pick)
        assert len(toks) == 4 and q.shape == (4, 512)
        assert np.allclose(q.sum(-1), 1.0) and not q[:, np.setdiff1d(np.arange(512), d2t)].any()
        assert all(q[i, t] > 0 for i, t in enumerate(toks))
        assert (q > 1e-6).sum(-1).min() > 10  # a real distribution, not one-hot
        # depths 1 and 2 again, from the graph directly: the same processed distributions
        g.rollback(0)
        logits, pre = g.decode([6, 7, 8, 9], g.encode(feats), 0, "last")
        assert np.allclose(probs(logits[0], params), q[0])
        logits, _ = g.decode([toks[0]], pre, 4)
        assert np.allclose(probs(logits[0], params), q[1])
    finally:
        g.close()


def test_tree_drafting_matches_the_reference(target, tmp_path):
    """A top-3 × depth-3 tree: its first level is the draft's 3 most likely tokens, each branch the greedy
    continuation the numpy forward gives; it forms a valid ondevice.tree.Tree with path scores."""
    from converters.eagle3 import convert_eagle3, open_eagle3
    from converters.eagle3_check import encode, reference
    from ondevice.backends.eagle3 import Eagle3Graph, draft_tree
    from ondevice.tree import Tree

    src_dir = _draft(tmp_path, dtype="float32", draft_vocab=256)
    convert_eagle3(src_dir, target=target[1], out=tmp_path / "out", dtype="f32")
    src = open_eagle3(src_dir)
    emb = src.float32("embed_tokens.weight")
    g = Eagle3Graph(tmp_path / "out" / "model.gguf", None, None, n_ctx=128, exact=True)
    try:
        feats = np.random.default_rng(2).normal(size=(5, 768)).astype(np.float32)
        prompt, x = [5, 6, 7, 8, 9], 10
        toks, parents, scores = draft_tree(g, feats, prompt, 0, x, 3, 3)
        tree = Tree([x, *toks], [-1, *parents], scores=[1.0, *scores])
        assert len(toks) == 9 and tree.children[0] == [1, 4, 7]
        T0, G0 = prompt[1:] + [x], list(encode(src, feats))
        logits, pre = reference(src, np.array(G0), T0, emb, 512)
        assert [toks[i - 1] for i in tree.children[0]] == list(np.argsort(-logits[-1], kind="stable")[:3])
        for b, first in enumerate(tree.children[0]):
            T, G, path = T0 + [toks[first - 1]], G0 + [pre[-1]], []
            for _ in range(2):
                lg, pr = reference(src, np.array(G), T, emb, 512)
                path.append(int(np.argmax(lg[-1])))
                T.append(path[-1])
                G.append(pr[-1])
            assert toks[first:first + 2] == path, b
        assert all(scores[i] <= scores[parents[i] - 1] for i in range(len(toks)) if parents[i])
    finally:
        g.close()
