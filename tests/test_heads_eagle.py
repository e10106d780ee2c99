"""The trained EAGLE-style drafter's maths (``ondevice.heads.eagle``): its unrolled training forward is, depth by
depth, the draft's forward on the KV cache it has while drafting (``converters.eagle3_check.reference``, numpy,
written independently from the EAGLE-3 layout), and training lowers the loss on data it can learn."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("jax")

SHAPE = dict(hidden=32, n_heads=4, n_kv_heads=2, head_dim=8, ffn=48, draft_vocab=24)
V = 40


def _setup(tmp_path, seed=0, noisy=True):
    from converters.eagle3_source import open_eagle3
    from ondevice.heads import eagle
    from ondevice.heads.eagle_store import save_checkpoint

    rng = np.random.default_rng(seed)
    shape = eagle.Shape(**SHAPE)
    vocab = np.sort(rng.choice(V, SHAPE["draft_vocab"], replace=False))
    params = eagle.init(shape, rng.normal(size=(len(vocab), shape.hidden)), 1 + 0.1 * rng.normal(size=shape.hidden), seed)
    if noisy:  # norms and output projections away from their initial values, so every term matters
        for k in params:
            params[k] = params[k] + (0.1 * rng.normal(size=params[k].shape)).astype(np.float32)
    src = open_eagle3(save_checkpoint(tmp_path / "ckpt", params, shape.config(V, [1, 2, 3]), vocab))
    return eagle, shape, params, src, vocab, rng


def test_each_unrolled_depth_is_the_drafts_forward_on_its_own_cache(tmp_path):
    from converters.eagle3_check import encode, reference

    eagle, shape, params, src, vocab, rng = _setup(tmp_path)
    T, depths = 10, 4
    feats = rng.normal(size=(1, T, 3 * shape.hidden)).astype(np.float32)
    table = rng.normal(size=(V, shape.hidden)).astype(np.float32)
    toks = rng.integers(0, V, size=T + depths + 1)
    emb = table[toks[1:T + 1]][None]  # x_{p+1} at p
    cos, sin = eagle.rope_tables(shape, T)
    logits, pre = eagle.unrolled(params, shape, feats, emb, cos, sin, depths)
    logits, pre = [np.asarray(x[0]) for x in logits], [np.asarray(x[0]) for x in pre]
    g_true = encode(src, feats[0])
    for base in (0, 3, T - depths):
        g_rows, tokens = list(g_true[: base + 1]), list(toks[1: base + 2])
        for j in range(depths):
            ref_logits, ref_pre = reference(src, np.asarray(g_rows), tokens, table, V)
            p = base + j
            np.testing.assert_allclose(pre[j][p], ref_pre[-1], rtol=2e-3, atol=2e-3)
            np.testing.assert_allclose(logits[j][p], ref_logits[-1][vocab], rtol=2e-3, atol=2e-3)
            g_rows.append(ref_pre[-1])  # depth j + 1: its own output, and the next token (the target's)
            tokens.append(toks[p + 2])


def test_a_wrong_mask_is_caught(tmp_path, monkeypatch):
    """The comparison above has power: depth 1 fed depth 0's output of its own position (not the one before) differs."""
    from converters.eagle3_check import encode, reference

    eagle, shape, params, src, vocab, rng = _setup(tmp_path, seed=1)
    T, depths = 8, 2
    feats = rng.normal(size=(1, T, 3 * shape.hidden)).astype(np.float32)
    table = rng.normal(size=(V, shape.hidden)).astype(np.float32)
    toks = rng.integers(0, V, size=T + depths + 1)
    cos, sin = eagle.rope_tables(shape, T)
    real_shift = eagle._shift
    monkeypatch.setattr(eagle, "_shift", lambda x, n: x if n == 1 and x.ndim == 3 else real_shift(x, n))
    logits, pre = eagle.unrolled(params, shape, feats, table[toks[1:T + 1]][None], cos, sin, depths)
    base = 4
    g_rows = list(encode(src, feats[0])[: base + 1])
    tokens = list(toks[1: base + 2])
    _, ref_pre = reference(src, np.asarray(g_rows), tokens, table, V)
    g_rows.append(ref_pre[-1])
    tokens.append(toks[base + 2])
    _, ref_pre = reference(src, np.asarray(g_rows), tokens, table, V)
    assert not np.allclose(np.asarray(pre[1][0, base + 1]), ref_pre[-1], rtol=2e-3, atol=2e-3)


def test_training_learns_a_learnable_map(tmp_path):
    """Labels that are a fixed function of the features: loss and top-1 error fall at every depth."""
    import jax.numpy as jnp

    eagle, shape, params, _, vocab, rng = _setup(tmp_path, seed=2, noisy=False)
    B, T, depths, steps = 4, 12, 3, 120
    proj = rng.normal(size=(3 * shape.hidden, SHAPE["draft_vocab"]))
    feats = rng.normal(size=(B, T, 3 * shape.hidden)).astype(np.float32)
    label = np.argmax(feats @ proj, axis=-1)  # the label of row p + 1 sits at p
    t_idx = np.full((B, T, 1), -1, np.int32)
    t_idx[:, :-1, 0] = label[:, 1:]
    batch = {"feats": feats, "emb": rng.normal(size=(B, T, shape.hidden)).astype(np.float32), "t_idx": t_idx,
             "t_pr": np.ones((B, T, 1), np.float32), "valid": t_idx[..., 0] >= 0}
    batch = {k: jnp.asarray(v) for k, v in batch.items()}
    step = eagle.make_step(shape, depths, T, lr=3e-3, warmup=10, total=steps)
    opt = eagle.zeros_like(params)
    first = None
    for t in range(steps):
        params, opt, loss, hits = step(params, opt, batch, t)
        first = float(loss) if first is None else first
        hits = np.asarray(hits)
    assert float(loss) < 0.3 * first
    assert hits[0, 0] / hits[0, 1] > 0.9  # depth 0 reads the features directly


def test_frozen_head_stays_and_the_feature_loss_pulls_pre_to_the_targets_hidden(tmp_path):
    """``make_step(frozen=..., feat_w=...)``: the frozen LM head and norm keep their values bit for bit while the
    feature loss (rms(pre)·norm_t against the target's hidden state at row p + 1) falls; unfrozen, they move."""
    import jax.numpy as jnp

    eagle, shape, params, _, vocab, rng = _setup(tmp_path, seed=3, noisy=False)
    B, T, depths, steps = 2, 8, 2, 60
    norm_t = (1 + 0.1 * rng.normal(size=shape.hidden)).astype(np.float32)
    batch = {"feats": rng.normal(size=(B, T, 3 * shape.hidden)).astype(np.float32),
             "emb": rng.normal(size=(B, T, shape.hidden)).astype(np.float32),
             "t_idx": np.zeros((B, T, 1), np.int32), "t_pr": np.ones((B, T, 1), np.float32),
             "valid": np.ones((B, T), bool), "hid": rng.normal(size=(B, T, shape.hidden)).astype(np.float32),
             "hid_ok": np.ones((B, T), bool)}
    batch = {k: jnp.asarray(v) for k, v in batch.items()}
    cos, sin = (jnp.asarray(a) for a in eagle.rope_tables(shape, T))

    def feat_loss(p):
        with_f = eagle.loss_fn(p, shape, batch, cos, sin, depths, 1.0, jnp.asarray(norm_t))[0]
        return float(with_f - eagle.loss_fn(p, shape, batch, cos, sin, depths)[0])

    frozen = ("lm_head.weight", "norm.weight")
    for freeze in (True, False):
        p, opt = dict(params), eagle.zeros_like(params)
        step = eagle.make_step(shape, depths, T, lr=3e-3, warmup=5, total=steps, feat_w=1.0, norm_t=norm_t,
                               frozen=frozen if freeze else ())
        before = feat_loss(p)
        for t in range(steps):
            p, opt, _, _ = step(p, opt, batch, t)
        assert feat_loss(p) < 0.7 * before
        same = [np.array_equal(np.asarray(p[k]), params[k]) for k in frozen]
        assert same == [freeze, freeze]
