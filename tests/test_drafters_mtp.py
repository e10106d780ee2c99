"""A model's own MTP heads through the runtime (``draft="mtp"``): greedy speculation equals plain decoding token
for token, and the sampled law is the target's (chi-square at T = 0.8, with planted-bug controls that must fail),
on tiny glm4moe and qwen35 targets whose MTP block partly agrees with their trunk."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import chisquare, plant_no_residual, plant_wrong_q, sampled_counts

import ondevice
from ondevice import sampling
from ondevice.errors import OndeviceError

PROMPTS = [[5, 77, 301, 12, 9, 140], [400, 18, 71, 222, 33], [260, 33, 5, 5, 12, 301, 140, 9]]
LAW = dict(temperature=0.8, top_k=6, top_p=1.0, min_p=0.0)


def _agreeing(make, trunk=0.3, noise=0.5):
    """Wrap a tensor builder of ``ondevice.testing.mtp``: the trunk's blocks add ``trunk`` × their random output to
    the residual stream (so the next token depends mostly, not only, on the current one) and the MTP block passes
    its input projection through, ``eh_proj = [I, noise × random]`` on [embedding ; hidden]: the head guesses the
    trunk's next token from the current one, often but not always right (drafts are kept and rejected)."""

    def build(s, rng, dtype):
        t = make(s, rng, dtype)
        for name, w in t.items():
            if name.endswith(("attn_output.weight", "ffn_down.weight", "ffn_down_exps.weight", "ffn_down_shexp.weight",
                              "ssm_out.weight")):
                t[name] = (w * (0.0 if int(name.split(".")[1]) >= s.n_layer else trunk)).astype(w.dtype)
            elif name.endswith("nextn.eh_proj.weight"):
                h = s.n_embd
                eye = np.eye(h, dtype=np.float32)
                r = rng.standard_normal((h, h), dtype=np.float32) * noise / np.sqrt(h)
                t[name] = np.concatenate([eye, r], axis=1).astype(w.dtype)
        return t

    return build


def _law(path, ids, params, depth=3):
    """The target's exact law of the next ``depth`` tokens, each prefix evaluated from an empty cache (a recurrent
    state, qwen35's, cannot roll back across passes: ``helpers.exact_law``'s walk would be refused)."""
    from ondevice.backends.llama import LlamaBackend

    b = LlamaBackend(path, n_ctx=128, threads=1)
    law = {}

    def walk(prefix, mass):
        ctx = ids + list(prefix)
        b.rollback(0)
        p = sampling.probs(b.eval(ctx, "last")[-1], params, ctx)
        for t in np.flatnonzero(p):
            if len(prefix) + 1 == depth:
                law[(*prefix, int(t))] = mass * p[t]
            else:
                walk((*prefix, int(t)), mass * p[t])

    try:
        walk((), 1.0)
    finally:
        b.close()
    return law


@pytest.fixture(scope="module", params=["glm4moe", "qwen35"])
def target(request, tmp_path_factory):
    from ondevice.testing import mtp

    arch = request.param
    with pytest.MonkeyPatch.context() as mp:
        name = "_qwen35_tensors" if arch == "qwen35" else "_glm4moe_tensors"
        mp.setattr(mtp, name, _agreeing(getattr(mtp, name)))
        return mtp.make_tiny_mtp_gguf(tmp_path_factory.mktemp("mtp") / f"{arch}.gguf", arch, seed=3)


def test_draft_mtp_greedy_equals_plain(target):
    """``draft="mtp"`` drafts with the model's own head; greedy speculation with a fixed γ (1, 3, and 5: deeper
    than the one trained block) emits plain decoding's tokens, with drafts both kept and rejected."""
    with ondevice.load(target, draft="mtp", threads=1) as spec, ondevice.load(target, drafter="none", threads=1) as plain:
        assert spec.drafter.name == "mtp"
        drafted = accepted = 0
        for ids in PROMPTS:
            ref = plain.generate(ids, max_tokens=40, temperature=0, gamma=0)
            for gamma in (1, 3, 5):
                res = spec.generate(ids, max_tokens=40, temperature=0, gamma=gamma)
                assert res.tokens == ref.tokens, (ids, gamma)
                drafted, accepted = drafted + res.stats.drafted, accepted + res.stats.accepted
        assert 0 < accepted < drafted, (accepted, drafted)


def test_sampled_law_is_the_targets(target, monkeypatch):
    """Joint law of 3 tokens at T = 0.8, top-k 6 against the exact target law (γ = 3; q = the head's processed
    distribution); two planted controls must fail the same test: a residual that does not subtract q, and q rows
    that are not the law the drafts were drawn from (uniform over their support)."""
    from ondevice.drafters.mtp import MtpDrafter

    ids, n = PROMPTS[0], 3000
    law = _law(target, ids, sampling.SamplingParams(**LAW))
    with ondevice.load(target, drafter="mtp", threads=1) as rt:
        runs = [rt.generate(ids, max_tokens=3, seed=s, gamma=3, **LAW).stats for s in range(40)]
        accepted, drafted = sum(r.accepted for r in runs), sum(r.drafted for r in runs)
        assert 0 < accepted < drafted, (accepted, drafted)  # both outcomes occur, so the controls can fail
        assert chisquare(sampled_counts(rt, ids, n, 0.8, 6, 3), law, n) > 1e-3
        with monkeypatch.context() as m:
            plant_no_residual(m)  # planted bug 1
            assert chisquare(sampled_counts(rt, ids, n, 0.8, 6, 3), law, n) < 1e-4
        plant_wrong_q(monkeypatch, MtpDrafter)  # planted bug 2
        assert chisquare(sampled_counts(rt, ids, n, 0.8, 6, 3), law, n) < 1e-4


def test_a_recurrent_state_rolls_back_only_into_its_last_pass(target):
    """qwen35's gated delta net: llama.cpp restores a state from its snapshots inside the last decode only (and
    reports success elsewhere, with a wrong state), so a rollback elsewhere is refused; inside, the logits equal
    a fresh evaluation's."""
    from ondevice.backends.llama import LlamaBackend

    ids = PROMPTS[0]
    b = LlamaBackend(target, n_ctx=128, threads=1)
    try:
        ref = b.eval([*ids, 33])[-1]
        b.rollback(0)
        b.eval(ids[:-1])
        b.eval([ids[-1], 2, 3, 4])  # a verify pass that keeps one token
        b.rollback(len(ids))
        assert np.abs(b.eval([33])[-1] - ref).max() < 1e-4
        if b._recurrent:
            b.eval([7])
            with pytest.raises(OndeviceError, match="cannot roll back"):
                b.rollback(len(ids))  # back across two passes
    finally:
        b.close()


def test_a_model_without_mtp_layers_is_refused_in_one_line(tiny_gguf):
    with pytest.raises(OndeviceError, match="carries no MTP") as e:
        ondevice.load(tiny_gguf("llama"), draft="mtp", threads=1)
    assert "\n" not in str(e.value)


def test_auto_prefers_the_models_own_heads_and_info_shows_them(target):
    """``draft="auto"`` drafts with the model's own MTP heads (no local draft model is timed); ``ondevice info``
    lists the MTP layers."""
    import json
    import subprocess
    import sys

    with ondevice.load(target, draft="auto", threads=1) as rt:
        assert rt.drafter.name == "mtp" and "MTP heads" in rt.draft_choice["reason"]
        assert rt.drafter.seconds_per_token() > 0  # what the adaptive policy charges per drafted token
    out = subprocess.run([sys.executable, "-m", "ondevice", "info", str(target), "--json"], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["mtp_layers"] == 1
