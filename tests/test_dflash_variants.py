"""DFlash2 (block convolutions + candidate selector) and DSpark (Markov head) drafts through the runtime
(``draft=x.gguf`` of arch dflash): greedy speculation equals plain decoding token for token, and the sampled law is
the target's (chi-square at T = 0.8, top-k 6) with planted-bug controls that must fail — among them a q taken
from the row the graph conditioned on (DSpark: the argmax of the row before; DFlash2: another predecessor's
scores) while the token was drawn from the row given the token actually drafted before it. A tiny qwen3 target,
random-weight drafts whose d2t vocabulary and a logit bias favour the target's tokens (both kept and rejected)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import (
    DRAFT_PROMPTS,
    favoured_tokens,
    greedy_equal,
    law_after,
    plant_no_residual,
    sampled_law_broken,
    sampled_law_kept,
    tiny_gguf_target,
)

import ondevice
from ondevice.drafters.dflash import DFlashDrafter
from ondevice.sampling import probs_sparse

VARIANTS = {"dspark": dict(variant="dspark", markov_gain=1.0, repeat=4.0),  # rows depend on the token before
            "dspark-bonus": dict(variant="dspark", markov_gain=1.0, repeat=4.0, sample_from_anchor=False),
            "dflash2": dict(variant="dflash2", selector_gain=1.0, repeat=4.0)}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """(target GGUF, its exact law after the law prompt, the prompt ids, favourites by law mass, by greedy use)."""
    base = tmp_path_factory.mktemp("dfv")
    path = tiny_gguf_target(base, "qwen3")
    law, ids = law_after(path)
    by_mass, by_seen = favoured_tokens(path, law)
    return path, law, ids, by_mass, by_seen


@pytest.fixture(scope="module", params=list(VARIANTS))
def pair(request, target, tmp_path_factory):
    """(variant, greedy draft, law draft) for the target."""
    from ondevice.testing.dflash import make_tiny_dflash_gguf
    from ondevice.testing.mtp import MtpShape

    base, (_, _, _, by_mass, by_seen) = tmp_path_factory.mktemp(f"dfv-{request.param}"), target

    def draft(name, favourites):
        return make_tiny_dflash_gguf(base / name, target=MtpShape(n_layer=4, vocab_size=512), target_layers=(0, 2),
                                     block_size=5, favourites=list(dict.fromkeys(favourites)), preference=6.0, seed=1,
                                     **VARIANTS[request.param])

    return request.param, draft("greedy.gguf", by_seen[:8] + by_mass[:6]), draft("law.gguf", by_mass[:8] + by_seen[:4])


def plant_unconditioned_q(mp) -> None:
    """Planted control: tokens drawn from the rows given the token drafted before them, but q of positions ≥ 1
    taken from the row given another previous token (DSpark: the graph's own argmax-conditioned row, what its
    reference driver reads; DFlash2: the scores after the first candidate)."""
    real = DFlashDrafter.propose

    def wrong(self, context, gamma, params, rng, *a, **kw):
        tokens, q = real(self, context, gamma, params, rng, *a, **kw)
        blk = self.last_block
        if q is not None:
            for j in range(1, len(tokens)):
                other = blk.assumed(j) if blk.markov is not None else int(blk.candidates(j - 1)[0])
                ids, pr = probs_sparse(blk.row(j, other), params, [*context, *tokens[:j]])
                q[j] = 0.0
                q[j, ids] = pr
        return tokens, q

    mp.setattr(DFlashDrafter, "propose", wrong)


def test_greedy_equals_plain_with_drafts_kept_and_rejected(target, pair):
    """Greedy speculation emits plain decoding's tokens at γ 1, 4 and 7 (capped by the block: 5 drafts for an
    anchor-first DSpark, 4 otherwise), drafts both accepted and rejected."""
    variant, draft = pair[:2]
    cap = 5 if variant == "dspark" else 4
    with ondevice.load(target[0], draft=str(draft), threads=1) as spec, \
            ondevice.load(target[0], drafter="none", threads=1) as plain:
        assert spec.drafter.name == "dflash" and spec.drafter.graph.variant == variant.split("-")[0]
        assert spec.drafter.graph.max_draft == cap
        drafted, accepted = greedy_equal(spec, plain, DRAFT_PROMPTS, (1, 4, 7), cap=cap)
        assert 0 < accepted < drafted, (accepted, drafted)


def test_sampled_law_is_the_targets(target, pair, monkeypatch):
    """Joint law of 3 tokens at T = 0.8, top-k 6 (γ = 3, one block, each row given the token drafted before it);
    both planted controls — a residual that does not subtract q, and q from the row given another previous token
    — must fail."""
    path, law, ids = target[:3]
    with ondevice.load(path, draft=str(pair[2]), threads=1) as rt:
        sampled_law_kept(rt, ids, law)
        with monkeypatch.context() as mp:
            plant_unconditioned_q(mp)
            sampled_law_broken(rt, ids, law)
        plant_no_residual(monkeypatch)
        sampled_law_broken(rt, ids, law)


def test_rows_follow_the_drafted_token(target, pair):
    """A block's row j given a previous token other than the graph's assumption differs from the graph's row
    (the Markov bias / the selector's transition scores do enter), and given the graph's assumption equals it."""
    path = target[0]
    with ondevice.load(path, draft=str(pair[2]), threads=1) as rt:
        d = rt.drafter
        rt.generate(DRAFT_PROMPTS[0], max_tokens=4, temperature=0, gamma=3)
        blk = d.last_block
        assert blk is not None and len(blk) >= 2
        if blk.markov is not None:
            assert np.array_equal(blk.row(1, blk.assumed(1)), blk.logits[1])
            other = next(t for t in np.argsort(-blk.logits[0]) if t != blk.assumed(1))
            assert not np.allclose(blk.row(1, int(other)), blk.logits[1])
        else:
            c = blk.candidates(0)
            assert not np.allclose(blk.row(1, int(c[0])), blk.row(1, int(c[1])))
