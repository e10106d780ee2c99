"""The EAGLE-3 drafter through the runtime (``draft=DIR/x.gguf`` of arch eagle3, ``drafter="eagle3"``): greedy
speculation equals plain decoding token for token, and the sampled law is the target's (chi-square at T = 0.8,
with a planted-bug control that must fail), on tiny llama, qwen3 and qwen2 targets with random-weight drafts (qwen2's
graph records no layer inputs: the backend reads them through its cb_eval tap)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import (
    DRAFT_PROMPTS,
    convert_then_generate,
    count_copies,
    favoured_tokens,
    greedy_equal,
    law_after,
    plant_no_residual,
    plant_wrong_q,
    sampled_law_broken,
    sampled_law_kept,
    tiny_gguf_target,
    use_trees,
)

import ondevice
from ondevice.errors import OndeviceError

PROMPTS = DRAFT_PROMPTS
# repeats itself (copies draft); helpers.REPEATS meets a near-tie (0.002 logits) of the tiny llama target, where a
# batched pass and a single decode may pick differently (not batch-invariant there)
COPY_PROMPT = "class Cache:\n    def get(self, key):\n        return self.data.get(key)\n    def put(self, key"


def _draft(base, target, favourites, layer_ids=(0, 2, 3), seed=0):
    """A random-weight EAGLE-3 draft for ``target`` whose draft vocabulary is the ``favourites`` ids (d2t / t2d
    rewritten), so its q overlaps the target's p and both acceptance and rejection occur; converted to GGUF."""
    from safetensors.numpy import load_file, save_file

    from converters.eagle3 import convert_eagle3
    from ondevice.testing.eagle3 import make_tiny_eagle3

    src = make_tiny_eagle3(base / "e3src", own_embeddings=False, dtype="float32", draft_vocab=len(favourites),
                           layer_ids=list(layer_ids), seed=seed)
    t = load_file(src / "model.safetensors")
    ids = np.array(sorted(favourites), np.int64)
    t["d2t"] = ids - np.arange(len(ids), dtype=np.int64)
    mask = np.zeros(512, bool)
    mask[ids] = True
    t["t2d"] = mask
    save_file(t, src / "model.safetensors")
    convert_eagle3(src, target=target, out=base / "e3", dtype="f32")
    return base / "e3" / "model.gguf"


@pytest.fixture(scope="module", params=["llama", "qwen3", "qwen2"])
def pair(request, tmp_path_factory):
    """(target GGUF, eagle3 draft GGUF, the exact law, its prompt ids) for a tiny target of each architecture; the
    draft's vocabulary is the tokens the law and greedy answers favour (so drafts are both kept and rejected)."""
    base = tmp_path_factory.mktemp(f"e3d-{request.param}")
    target = tiny_gguf_target(base, request.param)
    law, ids = law_after(target)
    by_mass, by_seen = favoured_tokens(target, law)
    favourites = set(by_mass[:12]) | set(by_seen[:10])
    qwen2 = request.param == "qwen2"  # the tap cannot take layer 0's input; seed 0's draft is never accepted greedily
    return target, _draft(base, target, favourites, (1, 2, 3) if qwen2 else (0, 2, 3), seed=int(qwen2)), law, ids


def test_the_draft_file_names_its_kind_and_greedy_equals_plain(pair):
    """``draft=x.gguf`` of arch eagle3 selects the EAGLE-3 drafter; greedy speculation with a fixed γ emits plain
    decoding's tokens, with drafts both accepted and rejected."""
    target, draft = pair[:2]
    with ondevice.load(target, draft=str(draft), threads=1) as spec, \
            ondevice.load(target, drafter="none", threads=1) as plain:
        assert spec.drafter.name == "eagle3"
        use_trees(spec.drafter, False)  # chains (trees are tested apart; chains remain its path under a constraint)
        drafted, accepted = greedy_equal(spec, plain, PROMPTS, (1, 3))
        assert drafted > 0 and accepted > 0


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_copies_join_the_drafts_and_greedy_stays_exact(pair, shape):
    """Where the context repeats, a prompt-lookup copy drafts the chain or joins the tree
    (``ondevice.drafters.copies``; off by default for a downloaded draft), and greedy speculation still emits plain
    decoding's tokens; the control: ``copy_min`` 0 proposes no copy on the same prompts."""
    target, draft = pair[:2]
    with ondevice.load(target, draft=str(draft), threads=1) as spec, \
            ondevice.load(target, drafter="none", threads=1) as plain:
        assert spec.drafter.copies.copy_min == 0
        spec.drafter.copies.copy_min = 2
        use_trees(spec.drafter, shape == "tree")
        seen = count_copies(spec.drafter)
        greedy_equal(spec, plain, [COPY_PROMPT, *PROMPTS], (4,))
        assert any(seen), "no copy was proposed on a prompt that repeats itself"
        spec.drafter.copies.copy_min = 0
        seen.clear()
        greedy_equal(spec, plain, [COPY_PROMPT, *PROMPTS], (4,))
        assert seen and not any(seen)


def test_a_long_copy_run_keeps_the_pending_features_bounded(pair, monkeypatch):
    """While copies draft every chain, the draft's cache is not brought up to date, so the target kept every
    position's layer-input rows until the next drafted step (unbounded memory, then one huge catch-up batch); past
    ``pending_max`` rows a copied chain absorbs them. Greedy still equals plain."""
    target, draft = pair[:2]
    with ondevice.load(target, draft=str(draft), threads=1) as spec, \
            ondevice.load(target, drafter="none", threads=1) as plain:
        d = spec.drafter
        use_trees(d, False)
        d.pending_max = 8
        monkeypatch.setattr(d.copies, "chain", lambda context, gamma, constraint: [int(context[-1])])  # always a copy
        pending, real = [], d.propose

        def spy(context, *a, **k):
            out = real(context, *a, **k)
            pending.append(len(context) - 1 - d._valid)
            return out

        monkeypatch.setattr(d, "propose", spy)
        ref = plain.generate(PROMPTS[0], max_tokens=40, temperature=0).tokens
        assert spec.generate(PROMPTS[0], max_tokens=40, temperature=0, gamma=3).tokens == ref
        assert len(pending) > 20 and max(pending) <= d.pending_max, pending


def test_a_copied_chain_is_reported_as_a_free_copy(pair, monkeypatch):
    """A chain the drafter's copies drafted (``Copies.chain``) reaches the loop as a free copy (``Proposal.copied``),
    so the policy neither charges its near-zero drafting time as the draft's cost per token nor learns the draft's
    acceptance from it; a drafted chain is not one."""
    from ondevice import speculative

    target, draft = pair[:2]
    learned, real = [], speculative.learn
    monkeypatch.setattr(speculative, "learn", lambda policy, prop, *a: learned.append(prop.copied) or real(policy, prop, *a))
    with ondevice.load(target, draft=str(draft), threads=1) as spec:
        spec.drafter.copies.copy_min = 2
        use_trees(spec.drafter, False)
        seen = count_copies(spec.drafter)
        for prompt in [COPY_PROMPT, *PROMPTS]:
            spec.generate(prompt, max_tokens=24, temperature=0, gamma=3)
    assert any(seen) and not all(seen), seen
    assert sum(learned) == sum(seen), (sum(learned), sum(seen))


def test_sampled_law_is_the_targets(pair, monkeypatch):
    """Joint law of 3 tokens at T = 0.8, top-k 6 against the exact target law (γ = 3; q = the draft's processed
    distribution); the planted control, a residual that does not subtract q, must fail the same test."""
    target, draft, law, ids = pair
    with ondevice.load(target, drafter="eagle3", draft=str(draft), threads=1) as rt:
        use_trees(rt.drafter, False)
        sampled_law_kept(rt, ids, law)
        plant_no_residual(monkeypatch)  # the planted bug
        sampled_law_broken(rt, ids, law)


def test_a_wrong_q_fails_the_law(pair, monkeypatch):
    """Second planted control: q rows replaced by a uniform law over the draft vocabulary (not the distribution
    the tokens were drawn from) break the target's law."""
    from ondevice.drafters.eagle3 import Eagle3Drafter

    target, draft, law, ids = pair
    with ondevice.load(target, draft=str(draft), threads=1) as rt:
        use_trees(rt.drafter, False)
        plant_wrong_q(monkeypatch, Eagle3Drafter)
        sampled_law_broken(rt, ids, law)


def _spy_trees(monkeypatch):
    """Record each verified tree's node count and kept path (``LlamaBackend.eval_tree`` / ``keep_path``)."""
    from ondevice.backends.llama import LlamaBackend

    seen = {"nodes": [], "paths": []}
    real_eval, real_keep = LlamaBackend.eval_tree, LlamaBackend.keep_path

    def eval_tree(self, tokens, parents):
        seen["nodes"].append(len(tokens))
        return real_eval(self, tokens, parents)

    def keep_path(self, path):
        seen["paths"].append(list(path))
        return real_keep(self, path)

    monkeypatch.setattr(LlamaBackend, "eval_tree", eval_tree)
    monkeypatch.setattr(LlamaBackend, "keep_path", keep_path)
    return seen


def test_greedy_trees_equal_plain(pair, monkeypatch, request):
    """EAGLE-2 dynamic trees (the drafter's default): greedy speculation emits plain decoding's tokens, verified as
    trees of several nodes, some kept along a branch other than the first (the target's layer-input rows then
    follow that branch; on qwen2, whose random draft is rarely accepted, test_layer_inputs_tap checks that
    directly), with drafts both accepted and rejected."""
    target, draft = pair[:2]
    seen = _spy_trees(monkeypatch)
    with ondevice.load(target, draft=str(draft), threads=1) as spec, \
            ondevice.load(target, drafter="none", threads=1) as plain:
        assert spec.drafter.traits.trees
        drafted, accepted = greedy_equal(spec, plain, PROMPTS, (3, 6))
        assert 0 < accepted < drafted
    assert max(seen["nodes"]) >= 4
    if request.node.callspec.params["pair"] != "qwen2":
        assert any(len(p) > 1 and p != list(range(len(p))) for p in seen["paths"])


def test_sampled_trees_keep_the_targets_law(pair, monkeypatch):
    """Trees at T = 0.8, top-k 6: the joint law of 3 tokens is the target's (chi-square); the planted control, the
    tree rule's residual not reduced by the rejected child, must fail the same test."""
    from ondevice import tree as T

    target, draft, law, ids = pair
    seen = _spy_trees(monkeypatch)
    with ondevice.load(target, draft=str(draft), threads=1) as rt:
        sampled_law_kept(rt, ids, law, gamma=4)
        assert max(seen["nodes"]) > 2
        monkeypatch.setattr(T, "residual_sparse", lambda ids, pr, qv, V: pr)  # the planted bug
        sampled_law_broken(rt, ids, law, gamma=4)


def test_best_first_keeps_the_most_confident_nodes():
    """``best_first`` on a known draft: the n nodes of largest path probability in non-increasing order, parents
    first, zero-probability (−inf) tokens never proposed, depth capped, and only nodes whose score was the best
    still open expanded."""
    from ondevice.drafters.eagle3 import best_first

    def row(probs):
        p = np.zeros(6)
        p[list(probs)] = list(probs.values())
        with np.errstate(divide="ignore"):
            return np.log(p)

    uniform = {t: 1 / 6 for t in range(6)}
    rows = {0: {3: 0.9, 4: 0.1}, 1: {4: 0.6, 5: 0.4}, 3: {0: 1.0}}
    tokens: list[int] = []
    expanded: list[int] = []

    def expand(node):
        expanded.append(node)
        return row(rows.get(tokens[node - 1], uniform))

    toks, pars, scores = best_first(row({0: 0.5, 1: 0.3, 2: 0.2}), expand, 5, branch=3, max_depth=4,
                                    on_node=lambda t, p: tokens.append(t))
    assert toks == [0, 3, 0, 3, 1] and pars == [0, 1, 2, 3, 0]
    assert np.allclose(scores, [0.5, 0.45, 0.45, 0.405, 0.3])
    assert expanded == [1, 2, 3]  # node 4 is at the depth cap, node 5 was never the best open


def test_refusals_are_one_line(pair, tmp_path, request):
    """A draft reading layer 0's input is refused on a qwen2 target (its graph records no layer inputs and the
    cb_eval tap has no tensor for layer 0), naming the architecture; drafter='eagle3' without a draft says what
    to pass."""
    target, draft = pair[:2]
    with pytest.raises(OndeviceError, match="needs the draft"):
        ondevice.load(target, drafter="eagle3", threads=1)
    if request.node.callspec.params["pair"] == "qwen2":
        return  # its draft reads layers 1..3
    other = tiny_gguf_target(tmp_path / "q2", "qwen2")
    with pytest.raises(OndeviceError, match="architecture 'qwen2' records no layer inputs.*layer 0's input") as e:
        ondevice.load(other, draft=str(draft), threads=1)
    assert "\n" not in str(e.value)


def test_the_two_commands(pair, tmp_path):
    """``ondevice convert EAGLE_DIR --to gguf --target TARGET --out DIR`` then ``ondevice generate TARGET --draft
    DIR/model.gguf --gamma 3 --temperature 0 --json`` drafts with it (stats.drafted > 0)."""
    target, draft = pair[:2]
    convert_then_generate(draft.parent.parent / "e3src", target, tmp_path, "eagle3")
