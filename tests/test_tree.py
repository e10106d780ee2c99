"""Tree verification on real backends (tiny llama.cpp and MLX models): one pass per tree, logits per node
equal to the chain's, the kept branch's cache equal to a fresh one, greedy tree == greedy plain, and the
sampled law against the exact target law with a planted bug that must fail."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import chisquare, exact_law

from ondevice import sampling
from ondevice import tree as T
from ondevice.backends.base import Backend
from ondevice.drafters import Drafter, TreeNgram, ngram_paths
from ondevice.policy import FixedGamma
from ondevice.speculative import steps

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")

PROMPT = "The model draft and the target verify the model draft and the target"
GREEDY = sampling.SamplingParams(temperature=0.0)
# A tree with 4 leaves, depth 3, parents before children: 0 → {1, 2, 3}, 1 → {4, 5}, 4 → {6}, 2 → {7}
PARENTS = [-1, 0, 0, 0, 1, 1, 4, 2]


def _llama(path):
    from ondevice.backends.llama import LlamaBackend

    return LlamaBackend(path, n_ctx=256)


def _mlx(path):
    from ondevice.backends.mlx import MLXBackend

    return MLXBackend(path, n_ctx=256, device="cpu")


@pytest.fixture(params=["llama:llama", "llama:qwen2", "mlx:qwen2"])
def backend_of(request, tiny_gguf, tiny_mlx):
    """(opener, model path) per backend and architecture (tiny q8_0 models, batch-invariant)."""
    kind, arch = request.param.split(":")
    if kind == "mlx":
        pytest.importorskip("mlx.core", reason="MLX is not installed")
        return lambda: _mlx(tiny_mlx(arch))
    return lambda: _llama(tiny_gguf(arch, "q8_0"))


def _tree_tokens(ids, seed=0):
    r = np.random.default_rng(seed)
    return [ids[-1], *(int(t) for t in r.integers(3, 200, len(PARENTS) - 1))]


def test_tree_rows_equal_each_paths_chain_and_the_kept_cache_equals_a_fresh_one(backend_of):
    b = backend_of()
    try:
        ids = b.tokenize(PROMPT)
        b.eval(ids[:-1])
        base = b.n_past
        tokens = _tree_tokens(ids)
        tree = T.Tree(tokens, PARENTS)
        logits = b.eval_tree(tokens, PARENTS)
        assert logits.shape == (len(tokens), b.vocab_size)
        b.keep_path([0, 1, 4])  # a path whose leaf is not sequence 0's
        assert b.n_past == base + 3
        after = b.eval([5, 6])
        # the chain's rows for every node, from a cache holding only the context
        b.rollback(base)
        for leaf in tree.leaves():
            path = tree.path(leaf)
            chain = b.eval([tokens[i] for i in path])
            np.testing.assert_array_equal(logits[path], chain)  # bit for bit (batch-invariant q8_0 models)
            b.rollback(base)
        fresh = b.eval([tokens[0], tokens[1], tokens[4], 5, 6])[-2:]
        np.testing.assert_array_equal(after, fresh)
        # a step that keeps only the root, then an ordinary chain: the cache holds context + root
        b.rollback(base)
        b.eval_tree(tokens, PARENTS)
        b.keep_path([0])
        assert b.n_past == base + 1
        np.testing.assert_array_equal(b.eval([7]), fresh_row(b, ids[:-1] + [tokens[0], 7]))
    finally:
        b.close()


def fresh_row(b, ctx):
    b.rollback(0)
    return b.eval(ctx)[-1:]


class RandomTree(Drafter):
    """Deterministic trees of arbitrary tokens mixed with the n-gram tree: drafts that are often wrong."""

    name = "random-tree"

    def __init__(self, seed=0):
        self.rng = np.random.default_rng(seed)
        self.ngram = TreeNgram(max_nodes=5)

    def propose_tree(self, context, max_nodes, params, rng):
        paths = ngram_paths(context, 3)[:3] + [list(self.rng.integers(3, 100, 2)) for _ in range(2)]
        return T.Tree.from_paths(context[-1], paths, max_nodes)


class OracleTree(Drafter):
    """Trees that hold the plain output's next tokens on a random branch among decoys (sometimes cut short
    or corrupted at depth 3): every branch position gets accepted, and rejected, some time."""

    name = "oracle-tree"

    def __init__(self, full, seed=0):
        self.full, self.rng = full, np.random.default_rng(seed)

    def propose_tree(self, context, max_nodes, params, rng):
        n, r = len(context), self.rng
        true = list(self.full[n : n + 3])
        if r.random() < 0.3 and len(true) == 3:
            true[2] = int(r.integers(3, 100))
        paths = [[int(t) for t in r.integers(3, 100, 2)] for _ in range(2)]
        paths.insert(int(r.integers(0, 3)), true)
        return T.Tree.from_paths(context[-1], [p for p in paths if p], max_nodes)


def _plain(b, ids, n):
    b.rollback(0)
    b.eval(ids[:-1])
    ctx = list(ids)
    it = steps(b, None, ctx, GREEDY, FixedGamma(0), np.random.default_rng(0))
    while len(ctx) < len(ids) + n:
        next(it)
    return ctx[len(ids) : len(ids) + n]


def _tree(b, ids, n, proposer, params=GREEDY, seed=0, reuse=False):
    """n tokens after ``ids`` by tree speculation (``reuse``: the cache already starts with ids[:-1])."""
    b.rollback(min(b.n_past, len(ids) - 1) if reuse else 0)
    if b.n_past < len(ids) - 1:
        b.eval(ids[b.n_past : -1])
    ctx = list(ids)
    it = steps(b, proposer, ctx, params, FixedGamma(8), np.random.default_rng(seed), trees=True, max_nodes=8)
    got = []
    while len(ctx) < len(ids) + n:
        got.append(next(it))
    assert b.n_past == len(ctx) - 1
    return ctx[len(ids) : len(ids) + n], got


def test_greedy_tree_speculation_equals_greedy_plain(backend_of):
    b = backend_of()
    try:
        ids = b.tokenize(PROMPT)
        ref = _plain(b, ids, 40)
        every = []
        for proposer in (TreeNgram(), RandomTree(), OracleTree(ids + ref)):
            out, st = _tree(b, ids, 40, proposer)
            assert out == ref, proposer.name
            assert all(s.mode == "tree" for s in st)
            every += st
        assert any(s.nodes > 2 for s in every)
        assert 0 < sum(s.accepted for s in every) < sum(s.drafted for s in every)
        # a branch other than the first was kept at least once (the cache was re-laid, sequences renamed)
        assert any(s.path and s.path != list(range(1, len(s.path) + 1)) for s in every)
    finally:
        b.close()


class ChainOnly(Backend):
    """A backend without a tree pass: the loop must verify the tree's first branch as a chain."""

    def __init__(self, b):
        self.b = b
        self.n_ctx, self.vocab_size = b.n_ctx, b.vocab_size

    def eval(self, tokens, logits="all"):
        return self.b.eval(tokens, logits)

    def rollback(self, n):
        self.b.rollback(n)

    @property
    def n_past(self):
        return self.b.n_past


def test_a_backend_without_tree_pass_degrades_to_a_chain_with_a_reason(tiny_gguf):
    b = _llama(tiny_gguf("llama", "q8_0"))
    try:
        ids = b.tokenize(PROMPT)
        ref = _plain(b, ids, 24)
        out, st = _tree(ChainOnly(b), ids, 24, TreeNgram())
        assert out == ref
        assert all(s.mode.startswith("chain: ChainOnly has no tree pass") for s in st)
    finally:
        b.close()


# -- the sampled law -------------------------------------------------------------------------------
class SampledTree(Drafter):
    """Children drawn i.i.d. from a draft model's processed q (2 at the root, 1 under each), plus the
    draft's argmax as a deterministic third root child: both kinds of node, drafted given their path only."""

    name = "sampled-tree"

    def __init__(self, draft, params):
        self.draft, self.params, self._memo = draft, params, {}

    def _q(self, prefix):
        key = tuple(prefix)
        if key not in self._memo:  # q depends on the prefix only
            self.draft.rollback(0)
            self._memo[key] = sampling.probs(self.draft.eval(prefix, logits="last")[-1], self.params, prefix)
        return self._memo[key]

    def propose_tree(self, context, max_nodes, params, rng):
        q0 = self._q(context)
        tokens, parents, qs = [context[-1]], [-1], [None]
        for _ in range(2):
            x = sampling.sample(q0, rng)
            tokens, parents, qs = tokens + [x], parents + [0], qs + [q0]
        for c in (1, 2):
            q1 = self._q([*context, tokens[c]])
            tokens, parents, qs = tokens + [sampling.sample(q1, rng)], parents + [c], qs + [q1]
        tokens, parents, qs = tokens + [int(np.argmax(q0))], parents + [0], qs + [None]
        return T.Tree(tokens, parents, qs)


def _sampled(b, ids, proposer, params, n):
    counts, acc, tried = {}, 0, 0
    b.rollback(0)
    for seed in range(n):
        out, st = _tree(b, ids, 3, proposer, params, seed, reuse=True)
        counts[tuple(out)] = counts.get(tuple(out), 0) + 1
        acc, tried = acc + sum(s.accepted for s in st), tried + len(st)
    return counts, acc / tried


def test_sampled_tree_matches_the_target_law_and_a_planted_bug_fails(tiny_gguf, monkeypatch):
    target, draft = _llama(tiny_gguf("qwen2", "q8_0")), _llama(tiny_gguf("qwen2_draft", "q8_0"))
    try:
        ids = target.tokenize("The model draft and the target verify")
        params = sampling.SamplingParams(temperature=0.7, top_k=8, top_p=0.9, min_p=0.0)
        law = exact_law(target, ids, params)
        assert abs(sum(law.values()) - 1) < 1e-9
        n = 800  # the planted bug gives p ~ 1e-50 at n = 600; the exact rule p ~ 0.5
        proposer = SampledTree(draft, params)
        counts, acc = _sampled(target, ids, proposer, params, n)
        assert 0.3 < acc < 2.0, acc  # drafts are both accepted and rejected
        assert chisquare(counts, law, n) > 1e-3
        monkeypatch.setattr(T, "residual_sparse", lambda ids, pr, qv, V: pr)  # the planted bug: p not reduced by q
        bug, _ = _sampled(target, ids, proposer, params, n)
        assert chisquare(bug, law, n) < 1e-4
    finally:
        target.close()
        draft.close()
