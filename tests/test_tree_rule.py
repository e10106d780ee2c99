"""Tree verification's maths on hand-made distributions: the exact output law by enumeration, the chain
case bit for bit against ``verify_logits``, a sampled chi-square, and planted bugs that must fail."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from helpers import chisquare

from ondevice import tree as T
from ondevice.drafters import TreeNgram, ngram_paths
from ondevice.drafters.heads import tree_from_topk
from ondevice.sampling import SamplingParams, probs_sparse, verify_logits

V = 6
CTX = [1, 4, 2]


def _logits(prefix, salt: int) -> np.ndarray:
    """Deterministic random logits for a prefix (a hand-made 'model')."""
    r = np.random.default_rng(abs(hash((salt, *prefix))) % 2**32)
    return r.normal(0, 1.5, V).astype(np.float32)


def target_p(prefix, params):
    ids, pr = probs_sparse(_logits(prefix, 0), params, prefix)
    out = np.zeros(V)
    out[ids] = pr
    return out


def draft_q(prefix):
    ids, pr = probs_sparse(_logits(prefix, 1), SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0), prefix)
    out = np.zeros(V)
    out[ids] = pr
    return out


# A shape: per node, (parent, kind): "s" = drawn from q(path), an int = that deterministic token.
SHAPES = {
    "two_sampled_children": [(0, "s"), (0, "s")],
    "mixed": [(0, "s"), (0, 3), (0, "s"), (1, "s"), (1, 0), (2, "s")],
    "deep": [(0, "s"), (1, "s"), (2, 5), (0, 2), (4, "s")],
    "point_masses": [(0, 0), (0, 1), (0, 2), (1, 4), (1, 3)],
}
PARAMS = {
    "t07_top_p": SamplingParams(temperature=0.7, top_k=0, top_p=0.8, min_p=0.0),
    "t1_top_k_penalty": SamplingParams(temperature=1.0, top_k=4, top_p=1.0, min_p=0.0, repetition_penalty=1.3),
    "greedy": SamplingParams(temperature=0.0),
}


def drafted_trees(shape):
    """Every tree the shape can draft after CTX, with its probability (the sampled nodes enumerated)."""
    def grow(i, tokens, parents, qs, prob):
        if i == len(shape):
            yield T.Tree(list(tokens), list(parents), list(qs)), prob
            return
        par, kind = shape[i]
        path = [tokens[j] for j in T.Tree(tokens, parents, qs).path(par)]
        prefix = CTX[:-1] + path
        if kind == "s":
            q = draft_q(prefix)
            for t in np.flatnonzero(q):
                yield from grow(i + 1, tokens + [int(t)], parents + [par], qs + [q], prob * q[t])
        else:
            yield from grow(i + 1, tokens + [kind], parents + [par], qs + [None], prob)

    yield from grow(0, [CTX[-1]], [-1], [None], 1.0)


def tree_logits(tree):
    return np.stack([_logits(CTX[:-1] + [tree.tokens[j] for j in tree.path(i)], 0) for i in range(len(tree))])


class _Fork(Exception):
    def __init__(self, options):
        self.options = options


class _Script:
    """The verifier's choices replayed from a script; the first choice past it forks the enumeration."""

    def __init__(self, script):
        self.script, self.i, self.prob = script, 0, 1.0

    def _next(self, options):
        if self.i == len(self.script):
            raise _Fork(options)
        choice = self.script[self.i]
        self.i += 1
        self.prob *= dict(options)[choice]
        return choice

    def accept(self, px, qx):
        a = min(1.0, px / qx)
        return self._next([(True, a), (False, 1.0 - a)])

    def sample(self, ids, pr):
        return self._next([(int(t), float(w / pr.sum())) for t, w in zip(ids, pr, strict=True) if w > 0])


def outcome_law(run):
    """{result: probability} of ``run(choices)`` over every branch of its random choices."""
    law, stack = {}, [[]]
    while stack:
        script = stack.pop()
        ch = _Script(script)
        try:
            res = run(ch)
        except _Fork as f:
            stack.extend(script + [o] for o, w in f.options if w > 0)
            continue
        law[res] = law.get(res, 0.0) + ch.prob
    return law


def extend_law(step_law, params, depth):
    """The law of the first ``depth`` tokens when each step's output is completed by target-only sampling."""
    out = {}

    def ext(seq, prob):
        if len(seq) == depth:
            out[seq] = out.get(seq, 0.0) + prob
            return
        p = target_p(CTX + list(seq), params)
        for t in np.flatnonzero(p):
            ext((*seq, int(t)), prob * p[t])

    for seq, prob in step_law.items():
        ext(seq[:depth], prob)
    return out


def tree_step_law(shape, params, residual=None):
    law = {}
    for tree, prob in drafted_trees(shape):
        rows = T.tree_rows(tree, tree_logits(tree), params, CTX)

        def run(ch, tree=tree, rows=rows):
            acc, nxt = T.walk_tree(tree, rows, ch, V, residual=residual)
            return (*(tree.tokens[i] for i in acc), nxt)

        for seq, w in outcome_law(run).items():
            law[seq] = law.get(seq, 0.0) + prob * w
    return law


@pytest.mark.parametrize("pname", PARAMS)
@pytest.mark.parametrize("shape", SHAPES)
def test_exact_output_law_by_enumeration(shape, pname):
    params = PARAMS[pname]
    depth = 4
    law = extend_law(tree_step_law(SHAPES[shape], params), params, depth)
    ref = extend_law({(): 1.0}, params, depth)
    assert abs(sum(law.values()) - 1) < 1e-12
    keys = set(law) | set(ref)
    assert max(abs(law.get(k, 0) - ref.get(k, 0)) for k in keys) < 1e-12


@pytest.mark.parametrize("shape", ["mixed", "point_masses"])
def test_planted_residual_without_q_changes_the_law(shape):
    params = PARAMS["t07_top_p"]
    law = extend_law(tree_step_law(SHAPES[shape], params, residual=lambda ids, pr, qv, V: pr), params, 4)
    ref = extend_law({(): 1.0}, params, 4)
    assert max(abs(law.get(k, 0) - ref.get(k, 0)) for k in set(law) | set(ref)) > 1e-3


@pytest.mark.parametrize("pname", PARAMS)
def test_a_chain_tree_is_verify_logits_bit_for_bit(pname):
    params = PARAMS[pname]
    for seed in range(200):
        r = np.random.default_rng(seed)
        g = int(r.integers(0, 5))
        draft, q = [], np.zeros((g, V))
        for i in range(g):
            q[i] = draft_q(CTX + draft)
            draft.append(int(r.choice(V, p=q[i])) if seed % 3 else int(r.integers(V)))
        deterministic = seed % 2 == 0
        tree = T.Tree([CTX[-1], *draft], list(range(-1, g)), [None] + [None if deterministic else q[i] for i in range(g)])
        if not deterministic and any(q[i, x] == 0 for i, x in enumerate(draft)):
            continue
        logits = tree_logits(tree)
        r1, r2 = np.random.default_rng(seed), np.random.default_rng(seed)
        acc, nxt = T.verify_tree(tree, logits, params, CTX, r1)
        n_acc, nxt2 = verify_logits(draft, None if deterministic else q, logits, params, CTX, r2)
        assert (acc, nxt) == (list(range(1, 1 + n_acc)), nxt2)
        assert r1.random() == r2.random()  # the same uniforms were drawn


def _sampled_counts(shape, params, n, seed, residual=None):
    rng = np.random.default_rng(seed)
    counts = {}
    for _ in range(n):
        tokens, parents, qs = [CTX[-1]], [-1], [None]
        for par, kind in shape:
            prefix = CTX[:-1] + [tokens[j] for j in T.Tree(tokens, parents, qs).path(par)]
            if kind == "s":
                q = draft_q(prefix)
                tokens, qs = tokens + [int(rng.choice(V, p=q))], qs + [q]
            else:
                tokens, qs = tokens + [kind], qs + [None]
            parents = parents + [par]
        tree = T.Tree(tokens, parents, qs)
        acc, nxt = T.walk_tree(tree, T.tree_rows(tree, tree_logits(tree), params, CTX), T._RngChoices(rng), V,
                               residual=residual)
        seq = (*(tree.tokens[i] for i in acc), nxt)
        while len(seq) < 3:
            seq = (*seq, int(rng.choice(V, p=target_p(CTX + list(seq), params))))
        counts[seq[:3]] = counts.get(seq[:3], 0) + 1
    return counts


def test_sampled_tree_output_passes_chi_square_and_a_planted_bug_fails():
    params, shape, n = PARAMS["t07_top_p"], SHAPES["mixed"], 6000
    law = extend_law({(): 1.0}, params, 3)
    assert chisquare(_sampled_counts(shape, params, n, seed=0), law, n) > 1e-3
    bug = _sampled_counts(shape, params, n, seed=0, residual=lambda ids, pr, qv, V: pr)
    assert chisquare(bug, law, n) < 1e-4


def test_ngram_paths_and_the_trie():
    ctx = [5, 6, 7, 9, 5, 6, 8, 1, 5, 6]
    paths = ngram_paths(ctx, max_depth=3)
    assert paths[0] == [8, 1, 5] and paths[1] == [7, 9, 5]  # "5 6" matched twice, the most recent first
    tree = T.Tree.from_paths(6, paths, max_nodes=8)
    assert tree.tokens[:4] == [6, 8, 1, 5] and tree.first_chain() == [0, 1, 2, 3]
    assert len(tree) - 1 <= 8 and tree.children[0][:2] == [1, 4]
    assert T.Tree.from_paths(6, [[1, 2, 3], [1, 2, 4], [1, 5]], max_nodes=4).tokens == [6, 1, 2, 3, 4]
    assert TreeNgram().propose_tree([1, 2, 3], 8, PARAMS["greedy"], np.random.default_rng(0)) is None


def test_topk_hook_builds_a_medusa_tree():
    tree = tree_from_topk(7, [[10, 11, 12], [20, 21]], [(0,), (1,), (0, 0), (0, 1), (1, 0)])
    assert tree.tokens == [7, 10, 11, 20, 21, 20] and tree.parents == [-1, 0, 0, 1, 1, 2]
    with pytest.raises(ValueError):
        tree_from_topk(7, [[1], [2]], [(0, 0)])
    with pytest.raises(ValueError):
        T.Tree([1, 2], [-1, 1])


def test_a_drafted_token_without_q_mass_is_refused():
    q = np.zeros(V)
    q[1] = 1.0
    tree = T.Tree([CTX[-1], 2], [-1, 0], [None, q])
    with pytest.raises(ValueError, match="q > 0"):
        T.verify_tree(tree, tree_logits(tree), PARAMS["t07_top_p"], CTX, np.random.default_rng(0))


def test_shapes_cover_every_branch():
    # every shape is a valid tree, and at least one of them has siblings of both kinds
    for shape in SHAPES.values():
        assert all(p <= i for i, (p, _) in enumerate(shape))
    assert any({k == "s" for _, k in s} == {True, False} for s in SHAPES.values())
    assert list(itertools.islice(drafted_trees(SHAPES["point_masses"]), 2))[0][1] == 1.0
