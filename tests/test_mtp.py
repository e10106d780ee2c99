"""A model's own MTP (NextN) head run through llama.cpp's MTP graph (ondevice.backends.llama_mtp) on tiny
random-weight targets written by ondevice.testing.mtp: they load with their MTP layers, the head's logits
match a numpy reference of the block on the same weights (chained deeper than the trained depth), and the
head's cache follows the target through observe / draft / rollback exactly as a fresh run would."""

from __future__ import annotations

import numpy as np
import pytest

from ondevice.errors import OndeviceError
from ondevice.testing.mtp import (
    MTP_ARCHS,
    MtpShape,
    glm4moe_mtp_reference,
    make_tiny_mtp_gguf,
    qwen35_mtp_reference,
)

PROMPT = [5, 77, 301, 12, 9, 140, 260, 33, 400, 18, 71, 222]


@pytest.fixture(scope="module")
def mtp_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("mtp")
    return {arch: make_tiny_mtp_gguf(d / f"{arch}.gguf", arch, seed=3) for arch in MTP_ARCHS}


def _target(path, **kw):
    from ondevice.backends.llama_mtp_target import MtpTarget

    return MtpTarget(path, n_ctx=256, threads=2, n_batch=64, **kw)


def _greedy(logits, depth):
    return int(np.argmax(logits))


@pytest.mark.parametrize("arch", MTP_ARCHS)
def test_tiny_target_loads_with_its_mtp_layers(mtp_files, arch):
    from ondevice.backends.llama_mtp import n_layer_nextn

    t = _target(mtp_files[arch])
    try:
        assert n_layer_nextn(t._model) == 1 and t.head.depth == 1
        logits = t.eval(PROMPT)
        assert logits.shape == (len(PROMPT), 512) and np.isfinite(logits).all()
        assert t.head.n_past == t.n_past == len(PROMPT)
        toks, q = t.head.draft(int(np.argmax(logits[-1])), 4, _greedy)  # deeper than the one trained block
        assert len(toks) == 4 and q.shape == (4, 512) and np.isfinite(q).all()
        assert toks == [int(np.argmax(r)) for r in q]
        assert t.head.n_past == len(PROMPT)  # the draft's positions left the head's cache
    finally:
        t.close()


REFERENCE = {"qwen35": qwen35_mtp_reference, "glm4moe": glm4moe_mtp_reference}


@pytest.mark.parametrize("arch", MTP_ARCHS)
def test_mtp_logits_match_numpy_reference_chained(mtp_files, arch):
    """Depth 1 reads the target's h rows (pair (x_p, h_{p-1})); depths 2..4 feed the head its own output."""
    path, reference = mtp_files[arch], REFERENCE[arch]
    t = _target(path)
    try:
        logits = t.eval(PROMPT)
        first, rows = t.head.rows
        assert first == 0 and rows.shape == (len(PROMPT), 256)
        bonus = int(np.argmax(logits[-1]))
        toks, q = t.head.draft(bonus, 4, _greedy)
    finally:
        t.close()
    n = len(PROMPT)
    seq = [*PROMPT, bonus]
    h = np.concatenate([np.zeros((1, 256)), rows])  # h_{-1} = 0 pairs with the first token
    for d in range(4):
        ref, h_out = reference(path, seq, h, 0, MtpShape())
        np.testing.assert_allclose(q[d], ref[n + d], rtol=2e-3, atol=2e-3 * np.abs(ref[n + d]).max())
        assert int(np.argmax(ref[n + d])) == toks[d]
        seq.append(toks[d])
        h = np.concatenate([h, h_out[-1:]])
    # the reference can fail: pairing x_p with h_p instead of h_{p-1} gives other logits
    shifted, _ = reference(path, seq[: n + 1], np.concatenate([rows, rows[-1:]]), 0, MtpShape())
    assert np.abs(shifted[n] - q[0]).max() > 0.1 * np.abs(q[0]).max()


@pytest.mark.parametrize("arch", MTP_ARCHS)
def test_head_cache_follows_verify_and_rollback_like_a_fresh_run(mtp_files, arch):
    """Draft, verify the draft on the target, accept a prefix, roll back, draft again: the second draft's
    logits equal those of a fresh target that decoded the accepted text in one go."""
    path = mtp_files[arch]
    t = _target(path)
    try:
        logits = t.eval(PROMPT)
        bonus = int(np.argmax(logits[-1]))
        toks, _ = t.head.draft(bonus, 3, _greedy)
        # a made-up verdict: keep the bonus token and the first drafted token, then the target's next token
        verify = t.eval([bonus, *toks])
        t.rollback(len(PROMPT) + 2)
        nxt = int(np.argmax(verify[1]))
        again, q_again = t.head.draft(nxt, 3, _greedy)
    finally:
        t.close()
    fresh = _target(path)
    try:
        fl = fresh.eval([*PROMPT, bonus, toks[0]])
        assert int(np.argmax(fl[-1])) == nxt
        want, q_want = fresh.head.draft(nxt, 3, _greedy)
    finally:
        fresh.close()
    assert again == want
    np.testing.assert_allclose(q_again, q_want, rtol=1e-4, atol=1e-4 * np.abs(q_want).max())


def test_rollback_outside_the_observed_rows_is_refused(mtp_files):
    t = _target(mtp_files["glm4moe"])
    try:
        t.eval(PROMPT)
        t.eval([1, 2, 3])
        with pytest.raises(OndeviceError, match="no target row for position"):
            t.head.rollback(len(PROMPT) - 2)
    finally:
        t.close()


def test_a_model_without_mtp_layers_is_refused_in_one_line(tmp_path, mtp_files):
    from ondevice.backends.llama_mtp import file_mtp_layers

    path = make_tiny_mtp_gguf(tmp_path / "plain.gguf", "qwen35", shape=MtpShape(n_nextn=0))
    assert [file_mtp_layers(mtp_files[a]) for a in MTP_ARCHS] == [1, 1] and file_mtp_layers(path) == 0
    with pytest.raises(OndeviceError, match="carries no MTP"):
        file_mtp_layers(path, strict=True)
    with pytest.raises(OndeviceError, match="no MTP") as e:
        _target(path)
    assert "\n" not in str(e.value)
    plain = _target(path, nextn=False)  # the same file is a plain target
    try:
        assert plain.eval(PROMPT).shape == (len(PROMPT), 512)
    finally:
        plain.close()


def test_writer_refuses_unknown_arch_and_leaves_nothing(tmp_path):
    with pytest.raises(ValueError, match="unsupported MTP arch"):
        make_tiny_mtp_gguf(tmp_path / "x.gguf", "llama")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("arch", MTP_ARCHS)
def test_greedy_rounds_with_varied_acceptance_keep_head_and_trunk_exact(mtp_files, arch):
    """A greedy speculative loop over the head (its chooser replaced by the plain answer 60 % of the time, so
    rounds accept 0..k tokens, all of them included): the output equals plain greedy decoding, and the
    head's next draft equals a fresh run's over the same text (its cache and h rows followed every round)."""
    path, k, n_new = mtp_files[arch], 3, 18
    plain = _target(path, nextn=False)
    try:
        want = [int(np.argmax(plain.eval(PROMPT)[-1]))]
        while len(want) < n_new + k + 2:
            want.append(int(np.argmax(plain.eval(want[-1:])[-1])))
    finally:
        plain.close()
    rng = np.random.default_rng(0)
    t = _target(path)
    accepted = []
    try:
        out = [int(np.argmax(t.eval(PROMPT)[-1]))]
        while len(out) < n_new:
            j = len(out)
            toks, _ = t.head.draft(out[-1], k, lambda q, d, j=j: want[j + d] if rng.random() < 0.6 else int(np.argmax(q)))
            verify = t.eval([out[-1], *toks])
            a = 0
            while a < k and toks[a] == int(np.argmax(verify[a])):
                a += 1
            accepted.append(a)
            t.rollback(len(PROMPT) + j + a)
            out += toks[:a] + [int(np.argmax(verify[a]))]
            assert t.head.n_past == t.n_past == len(PROMPT) + len(out) - 1
        assert out == want[: len(out)]
        assert {0, k} <= set(accepted) and len(set(accepted)) >= 3
        got, q_got = t.head.draft(out[-1], k, _greedy)
    finally:
        t.close()
    fresh = _target(path)
    try:
        fresh.eval([*PROMPT, *out[:-1]])
        exp, q_exp = fresh.head.draft(out[-1], k, _greedy)
    finally:
        fresh.close()
    assert got == exp
    np.testing.assert_allclose(q_got, q_exp, rtol=1e-4, atol=1e-4 * np.abs(q_exp).max())
