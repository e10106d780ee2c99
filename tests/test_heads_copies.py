"""Prompt-lookup copies in the heads drafter: ``merge_copy`` keeps a tree whose every prefix is a tree, the
sampled law of trees holding copies is the target's, a copy drafts without a hidden row, and a request's drafts
do not depend on what the runtime decoded before."""

from __future__ import annotations

import random

import numpy as np
import pytest
import test_heads
from helpers import count_copies, use_trees
from test_heads import PROMPTS, REPEATS, _copy_prompt, _counts

import ondevice
from ondevice import sampling
from ondevice.backends.llama import LlamaBackend
from ondevice.drafters.copies import merge_copy
from ondevice.tree import Tree

trained, home = test_heads.trained, test_heads.home  # the tiny target's heads, trained once for this module too


def _heads_tree(rng: random.Random, n: int) -> tuple[list[int], list[int], list[float]]:
    """A best-first tree as ``grow.best_first`` returns it: 3 levels of 3 distinct children per expanded node
    (scores: products of chances, ties included), the ``n`` best, shallower first among equals."""
    nodes, frontier, nid = [], [(0, 1.0, 0)], 1
    for _ in range(3):
        grown = []
        for pid, score, depth in frontier:
            for t in rng.sample(range(6), 3):
                s = score * rng.choice([1.0, 0.5, 0.25, rng.random()])
                nodes.append((t, pid, s, depth + 1, nid))
                grown.append((nid, s, depth + 1))
                nid += 1
        frontier = sorted(grown, key=lambda x: -x[1])[:3]
    kept = sorted(nodes, key=lambda x: (-x[2], x[3]))[:n]
    pos = {0: 0, **{x[4]: i + 1 for i, x in enumerate(kept)}}
    return [x[0] for x in kept], [pos[x[1]] for x in kept], [x[2] for x in kept]


def test_merge_copy_keeps_every_prefix_a_tree_of_distinct_siblings():
    """Random heads trees (empty ones included) and copies (longer than max_nodes, along heads nodes, with
    survival chances of 1): at most max_nodes nodes, parents first, scores never rising from parent to child
    and sorted, distinct siblings, and the copy's path kept as far as its scores rank."""
    rng = random.Random(0)
    for _ in range(3000):
        t, p, s = _heads_tree(rng, rng.randint(0, 10))
        if t and rng.random() < 0.3:  # the copy follows the heads' first path, then maybe leaves it
            node, copy = 0, []
            while (kids := [i for i, q in enumerate(p) if q == node]) and len(copy) < 4:
                copy.append(t[kids[0]])
                node = kids[0] + 1
            copy += [rng.randrange(6) for _ in range(rng.randint(0, 2))]
        else:
            copy = [rng.randrange(6) for _ in range(rng.randint(0, 12))]
        alphas = [rng.choice([1.0, 0.9, 0.5, rng.random()]) for _ in copy]
        max_nodes = rng.randint(1, 12)
        toks, pars, scs = merge_copy(t, p, s, copy, alphas, max_nodes)
        assert len(toks) == len(pars) == len(scs) <= max_nodes
        tree = Tree([99, *toks], [-1, *pars], scores=[1.0, *scs])  # parents come first
        assert scs == sorted(scs, reverse=True)
        assert all(tree.scores[i] <= tree.scores[tree.parents[i]] for i in range(1, len(tree)))
        assert all(len({tree.tokens[c] for c in kids}) == len(kids) for kids in tree.children)
        node, score = 0, 1.0
        for x, a in zip(copy, alphas, strict=True):  # the copy's path, as long as its nodes were kept
            score *= a
            nxt = [c for c in tree.children[node] if tree.tokens[c] == x]
            if not nxt:  # ranked out: only by max_nodes better or equal nodes
                assert len(scs) == max_nodes and min(scs) >= score, (copy, toks, pars, scs)
                break
            assert tree.scores[nxt[0]] >= score
            node = nxt[0]


def test_merge_copy_edge_cases():
    """No heads nodes, one node allowed, a copy equal to heads nodes (no new node, the larger score kept)."""
    assert merge_copy([], [], [], [5, 6, 7], [0.9, 0.9, 0.9], 2) == ([5, 6], [0, 1], [0.9, pytest.approx(0.81)])
    assert merge_copy([1, 2], [0, 0], [0.6, 0.3], [2], [0.8], 1) == ([2], [0], [0.8])
    assert merge_copy([1, 2], [0, 1], [0.6, 0.3], [1, 2], [0.5, 0.9], 8) == ([1, 2], [0, 1], [0.6, pytest.approx(0.45)])
    assert merge_copy([1], [0], [0.6], [], [], 3) == ([1], [0], [0.6])


def test_a_copy_drafts_without_a_hidden_row(trained, home):
    """A wholly cached prompt whose last row is gone: the copy still drafts (a chain of point masses, a tree of the
    copy alone); without a copy nothing is drafted."""
    with ondevice.load(trained[0], draft="heads", threads=1) as rt:
        d = rt.drafter
        d.target.hidden = lambda pos: None
        params = sampling.SamplingParams(temperature=0.7)
        rng = np.random.default_rng(0)
        ids = rt.tokenize(REPEATS)
        toks, q = d.propose(ids, 3, params, rng)
        assert toks and q is None and d.copies.copied
        tree = d.propose_tree(list(ids), 8, params, rng)
        assert tree is not None and len(tree) > 1 and d.copies.copied
        assert all(tree.parents[i] == i - 1 for i in range(1, len(tree)))  # one path: the copy
        assert tree.scores == sorted(tree.scores, reverse=True)
        plain = rt.tokenize("ab")
        assert d.propose(plain, 3, params, rng)[0] == [] and d.propose_tree(plain, 8, params, rng) is None


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_a_requests_drafts_do_not_depend_on_earlier_requests(trained, home, shape):
    """The drafter's prompt lookup is rebuilt for every request: the same seeded request, alone or after others,
    drafts and emits the same."""
    outs = []
    for first in (None, REPEATS + " y = z", PROMPTS[1]):
        with ondevice.load(trained[0], draft="heads", threads=1) as rt:
            use_trees(rt.drafter, shape == "tree")
            if first:
                rt.generate(first, max_tokens=30, temperature=0.7, seed=1, gamma=3)
            r = rt.generate(REPEATS, max_tokens=40, temperature=0.7, seed=5, gamma=3)
            outs.append((r.tokens, r.stats.accept_counts, r.stats.drafted))
    assert outs[0][2] > 0 and outs[0] == outs[1] == outs[2]


@pytest.mark.slow  # 2 × 4000 tree requests: ~3.5 min on the loaded 2-core box (point masses: the chain-copies test is the quick one)
def test_sampled_trees_with_copies_match_target_law(trained, home, monkeypatch):
    """Best-first trees holding a copy branch at T = 0.7, top-p 0.9 (top-k 6): the joint law of 3 tokens is the
    target's (chi-square), and the planted control (a residual that does not subtract q) fails it."""
    from helpers import chisquare, exact_law

    from ondevice import tree

    kw = dict(temperature=0.7, top_k=6, top_p=0.9, min_p=0.0)
    n = 4000
    with ondevice.load(trained[0], draft="heads", threads=1) as rt:
        use_trees(rt.drafter, True)
        seen = count_copies(rt.drafter)
        b = LlamaBackend(trained[0], n_ctx=128, threads=1)
        try:
            ids = _copy_prompt(b, rt.tokenize(PROMPTS[1]), sampling.SamplingParams(**kw))
            law = exact_law(b, ids, sampling.SamplingParams(**kw))
        finally:
            b.close()
        assert chisquare(_counts(rt, ids, n, 3, **kw), law, n) > 1e-3
        assert any(seen)
        monkeypatch.setattr(tree, "residual_sparse", lambda ids, pr, qv, V: pr)  # the planted bug
        assert chisquare(_counts(rt, ids, n, 3, **kw), law, n) < 1e-4
