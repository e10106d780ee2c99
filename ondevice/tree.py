"""Tree speculation: a tree of candidate tokens verified in one target pass, kept exact by multi-draft
(recursive) rejection sampling (SpecInfer, Miao et al. 2024; Chen et al. 2023 for one draft).

A ``Tree`` holds n nodes in topological order: node 0 is the root (the *pending* token, already emitted,
whose row scores the first drafted position), ``parents[i] < i`` for i > 0, and node i's path is its
ancestors' tokens then its own. ``q[i]`` is the distribution node i's token was drawn from, or None for a
deterministic child (top-k, n-gram): a point mass at the token. Siblings must be drawn independently of
one another given their path (i.i.d. samples, or distinct deterministic guesses); never without
replacement from one q, which this rule does not keep exact.

The rule at a node u whose target distribution (processed by ``ondevice.sampling``, the same as the
chain's ``verify_logits``) is p, with children c_1..c_k (tokens x_j ~ q_j), p_1 = p:

    for j = 1..k:  accept x_j with probability a_j = min(1, p_j(x_j) / q_j(x_j)) and descend into c_j;
                   else  p_{j+1} = max(0, p_j − q_j) / Σ max(0, p_j − q_j)
    if none is accepted: emit y ~ p_{k+1} and stop   (a leaf: k = 0, so y ~ p — the bonus token).

Why the token chosen at u is distributed exactly as p (induction on k). With no child, y ~ p_1 = p. Else
x_1 ~ q_1 is independent of the children after it, which by induction turn p_2 into an output ~ p_2:
    P(out = y) = q_1(y)·min(1, p_1(y)/q_1(y)) + (1 − Σ_x min(q_1, p_1)(x)) · p_2(y)
               = min(q_1, p_1)(y) + β · max(0, p_1(y) − q_1(y)) / β          (β = Σ_x max(0, p_1 − q_1))
               = p_1(y),
using 1 − Σ min(q, p) = Σ max(0, p − q) = β. A point mass q_j = e_x: a_j = min(1, p_j(x)) and the
residual is p_j with x zeroed and renormalised. The subtree under an accepted child was drafted given
its path only, so the same argument applies at the next depth with that child's own target row: the
emitted sequence follows the target's law token by token. Greedy p is one-hot at its argmax a: the first
child equal to a is accepted (u·q(x) < [x = a]) and a rejection leaves p = e_a, so the output is the
argmax chain, as plain decoding. A chain (one child per node) draws the same uniforms as
``verify_logits`` and gives the same result (tested).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from ondevice.backends.base import Backend
from ondevice.drafters import Drafter
from ondevice.logprobs import token_logprobs
from ondevice.sampling import (
    SamplingParams,
    _window,
    probs_sparse,
    residual_sparse,
    sample_sparse,
    verify_logits,
)
from ondevice.speculative import Step

__all__ = ["Tree", "verify_tree", "tree_rows", "walk_tree", "ngram_paths", "TreeNgram", "tree_from_topk", "tree_support",
           "TreeStep", "tree_steps"]


@dataclass
class Tree:
    """Candidate tokens as a rooted tree in topological order (see the module docstring).

    Attributes:
        tokens: [n] ids; tokens[0] is the root (the pending token, not a draft).
        parents: [n] parent indices; parents[0] == -1 and 0 <= parents[i] < i.
        q: [n] per node, the [V] distribution its token was drawn from, or None (a point mass).
        scores: optional, per node the proposer's estimate that its whole path is accepted.
    """

    tokens: list[int]
    parents: list[int]
    q: list[np.ndarray | None] = field(default_factory=list)
    scores: list[float] | None = None  # per node, the proposer's chance its path is accepted (best-first trees)

    def __post_init__(self) -> None:
        if not self.q:
            self.q = [None] * len(self.tokens)
        if not self.tokens or len(self.parents) != len(self.tokens) or len(self.q) != len(self.tokens):
            raise ValueError("a tree needs a root and one parent and one q entry per node")
        if self.parents[0] != -1 or any(not 0 <= p < i for i, p in enumerate(self.parents) if i):
            raise ValueError(f"parents must be -1 for the root and < the node's index: {self.parents}")
        self.children: list[list[int]] = [[] for _ in self.tokens]
        self.depth = [0] * len(self.tokens)
        for i in range(1, len(self.tokens)):
            self.children[self.parents[i]].append(i)
            self.depth[i] = self.depth[self.parents[i]] + 1

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def from_paths(cls, root: int, paths: Sequence[Sequence[int]], max_nodes: int) -> Tree:
        """A trie of deterministic continuations of ``root``, in priority order: paths[0] first (it is the
        first child at every depth), then each later path shares the prefix already there and adds
        nodes while fewer than ``max_nodes`` drafted nodes exist (the root is not counted)."""
        tokens, parents = [int(root)], [-1]
        kids: dict[tuple[int, int], int] = {}
        for path in paths:
            at = 0
            for t in path:
                nxt = kids.get((at, int(t)))
                if nxt is None:
                    if len(tokens) - 1 >= max_nodes:
                        break
                    nxt = kids[(at, int(t))] = len(tokens)
                    tokens.append(int(t))
                    parents.append(at)
                at = nxt
        return cls(tokens, parents)

    def path(self, i: int) -> list[int]:
        """Node indices from the root to node i (both included)."""
        out = [i]
        while self.parents[out[-1]] >= 0:
            out.append(self.parents[out[-1]])
        return out[::-1]

    def leaves(self) -> list[int]:
        return [i for i, c in enumerate(self.children) if not c]

    def first_chain(self) -> list[int]:
        """The path that follows every node's first child (what a chain verifier would check)."""
        out = [0]
        while self.children[out[-1]]:
            out.append(self.children[out[-1]][0])
        return out

    def prefix(self, n: int) -> Tree:
        """The first ``n`` nodes (a tree again, since parents come first)."""
        return Tree(self.tokens[:n], self.parents[:n], self.q[:n], None if self.scores is None else self.scores[:n])


class _RngChoices:
    """The verifier's random choices from one generator, drawn as ``verify_logits`` draws them."""

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng

    def accept(self, px: float, qx: float) -> bool:
        return self.rng.random() * qx < px  # u < p/q  ⇔  u·q < p  (q(x) > 0 for a drafted token)

    def sample(self, ids: np.ndarray, pr: np.ndarray) -> int:
        return sample_sparse(ids, pr, self.rng)


def walk_tree(tree: Tree, rows: Callable[[int], tuple[np.ndarray, np.ndarray]], choices, V: int,
              residual: Callable | None = None) -> tuple[list[int], int]:
    """The rule of the module docstring, with its random choices made by ``choices``.

    Args:
        rows: node index → (ids, pr), the target's processed distribution after that node's path (sparse).
        choices: ``accept(px, qx) -> bool`` (true with probability min(1, px/qx)) and
            ``sample(ids, pr) -> token``; a test can enumerate them, ``verify_tree`` draws them.
        V: vocabulary width of the target rows.
        residual: the residual rule (default ``residual_sparse``; a test plants a wrong one to show power).
    Returns:
        (accepted node indices in path order, root excluded; the token emitted after them).
    """
    residual = residual or residual_sparse  # looked up per call, so a test can patch the module's name
    node, accepted = 0, []
    while True:
        ids, pr = rows(node)
        for c in tree.children[node]:
            x, qrow = tree.tokens[c], tree.q[c]
            hit = np.flatnonzero(ids == x)
            px = float(pr[hit[0]]) if len(hit) else 0.0
            qx = 1.0 if qrow is None else float(qrow[x])
            if qrow is not None and not qx > 0.0:
                raise ValueError(f"node {c}: its token {x} has q = {qx}; a drafted token must have q > 0")
            if choices.accept(px, qx):
                accepted.append(c)
                node = c
                break
            qv = (ids == x).astype(np.float64) if qrow is None else qrow[ids]  # q_j at p's ids
            pr = residual(ids, pr, qv, V)
        else:
            return accepted, choices.sample(ids, pr)


def tree_rows(tree: Tree, logits: np.ndarray, params: SamplingParams, history: Sequence[int]):
    """node i → (ids, pr): the target's processed row i, as the chain processes row i of its path.

    Row i sees ``history`` (the context, ending with the root token) then the drafted tokens of node i's
    path, for the repetition penalty (``sampling._window``, as ``verify_logits``)."""
    def rows(i: int) -> tuple[np.ndarray, np.ndarray]:
        drafted = [tree.tokens[j] for j in tree.path(i)[1:]]
        return probs_sparse(logits[i], params, _window(history, drafted, len(drafted)))

    return rows


def verify_tree(tree: Tree, logits: np.ndarray, params: SamplingParams, history: Sequence[int],
                rng: np.random.Generator) -> tuple[list[int], int]:
    """Multi-draft rejection sampling over a tree; target rows are processed only where the rule looks.

    Args:
        tree: the candidates (tree.tokens[0] == history[-1], the pending token).
        logits: [n, V] target logits, row i scoring the token after node i's path.
        params: the sampling parameters (the same processing as the chain's ``verify_logits``).
        history: the context, ending with the root token (for the repetition penalty).
        rng: draws one uniform per child tried and one for the emitted token.
    Returns:
        (accepted node indices, root excluded, in path order; the next token).
    """
    return walk_tree(tree, tree_rows(tree, logits, params, history), _RngChoices(rng), logits.shape[-1])


# -- proposals -----------------------------------------------------------------------------------
def ngram_paths(context: Sequence[int], max_depth: int, max_ngram: int = 4, min_ngram: int = 1,
                max_paths: int = 8) -> list[list[int]]:
    """Continuations of every earlier occurrence of the context's suffix (prompt lookup, all matches).

    Longer suffix matches come first, the most recent first among equals; each occurrence is used once.
    Returns:
        up to ``max_paths`` lists of up to ``max_depth`` tokens that followed a match.
    """
    a = np.asarray(context, dtype=np.int64)
    n = len(a)
    ends: set[int] = set()
    out: list[list[int]] = []
    for size in range(min(max_ngram, n - 1), min_ngram - 1, -1):
        # windows a[s : s+size] for s + size <= n − 1 (the suffix itself excluded); a match ends at e = s + size
        win = np.lib.stride_tricks.sliding_window_view(a[: n - 1], size)
        for e in (np.flatnonzero((win == a[n - size :]).all(axis=1)) + size)[::-1]:
            if int(e) not in ends:
                ends.add(int(e))
                out.append([int(t) for t in a[e : e + max_depth]])
                if len(out) >= max_paths:
                    return out
    return out


class TreeNgram(Drafter):
    """Prompt lookup as a tree: the continuations of several matches merged into one trie (point masses).

    Args:
        max_nodes: drafted nodes at most (the root not counted).
        max_depth: tokens per continuation at most.
        max_ngram, min_ngram: suffix lengths tried.
        max_paths: matches used at most.
    """

    name = "ngram-tree"
    trees = True

    def __init__(self, max_nodes: int = 8, max_depth: int = 4, max_ngram: int = 4, min_ngram: int = 1,
                 max_paths: int = 8) -> None:
        self.max_nodes, self.max_depth = max_nodes, max_depth
        self.max_ngram, self.min_ngram, self.max_paths = max_ngram, min_ngram, max_paths

    def propose_tree(self, context: Sequence[int], max_nodes: int, params: SamplingParams,
                     rng: np.random.Generator) -> Tree | None:
        """A tree rooted at ``context[-1]`` with at most ``min(max_nodes, self.max_nodes)`` drafted nodes."""
        paths = ngram_paths(context, self.max_depth, self.max_ngram, self.min_ngram, self.max_paths)
        tree = Tree.from_paths(context[-1], paths, min(max_nodes, self.max_nodes))
        return tree if len(tree) > 1 else None

    def reset(self) -> None:
        pass

    def close(self) -> None:
        pass


def tree_from_topk(root: int, topk: Sequence[Sequence[int]], choices: Sequence[Sequence[int]]) -> Tree:
    """The heads' hook: a Medusa-style tree from each head's ranked guesses (point masses).

    Args:
        root: the pending token.
        topk: topk[d] = head d's guesses for depth d + 1, best first.
        choices: node paths as ranks, e.g. (0,), (1,), (0, 0), (0, 1): (r_1, .., r_d) is topk[0][r_1] then
            topk[1][r_2] ...; a node's parent path must come earlier, sibling order = priority.
    """
    index = {(): 0}
    tokens, parents = [int(root)], [-1]
    for ch in choices:
        ch = tuple(ch)
        if ch[:-1] not in index:
            raise ValueError(f"tree choice {ch}: its parent {ch[:-1]} must be listed before it")
        index[ch] = len(tokens)
        tokens.append(int(topk[len(ch) - 1][ch[-1]]))
        parents.append(index[ch[:-1]])
    return Tree(tokens, parents)


# -- the loop ------------------------------------------------------------------------------------
def tree_support(backend: Backend) -> str | None:
    """None when ``backend`` can verify a tree in one pass, else why not (the loop then verifies a chain)."""
    return backend.tree_unsupported()


@dataclass
class TreeStep(Step):
    """A ``Step`` of tree speculation: ``drafted`` counts tree nodes; ``mode`` says how it was verified."""

    nodes: int = 0
    path: list[int] = field(default_factory=list)  # the accepted nodes (indices in the tree, root excluded)
    mode: str = "tree"  # "tree", or "chain: <why the backend cannot verify a tree>"


def tree_steps(target: Backend, proposer, context: list[int], params: SamplingParams, rng: np.random.Generator,
               *, max_nodes: int = 8, n_ctx: int | None = None, policy=None, logprobs: int | None = None) -> Iterator[TreeStep]:
    """Propose a tree → verify it in one target pass → keep the accepted branch, forever.

    Same invariant as ``speculative.steps``: the target's cache holds ``context[:-1]`` between steps.

    Args:
        target: a backend; when ``tree_unsupported()`` is None the whole tree is one pass (``eval_tree`` /
            ``keep_path``), else the tree's first branch is verified as a chain (``TreeStep.mode`` gives the
            reason; the law is exact either way).
        proposer: a ``Drafter`` with ``propose_tree(context, max_nodes, params, rng) -> Tree | None`` (None = a
            plain step); on steps the policy does not ask it to draft, its ``copy_tree`` (a free copy, or None)
            is offered instead (``Policy.copy_nodes`` sizes it).
        context: the whole sequence so far; extended in place with every emitted token.
        max_nodes: drafted nodes per step at most.
        policy: sizes each proposed tree (``Policy.tree_nodes``: a prefix of a best-first tree, 0 = a plain
            step) and learns from the outcome; None verifies every proposal whole.
        logprobs: attach ``TokenLogprob`` (this many alternatives) to every emitted token; None = off.
    Yields:
        One ``TreeStep`` per target pass.
    """
    n_ctx = target.n_ctx if n_ctx is None else min(n_ctx, target.n_ctx)
    why = tree_support(target)
    if policy is not None:
        policy.restart()
    while True:
        base = len(context) - 1
        if base + 1 > n_ctx:
            return
        t0 = time.perf_counter()
        budget = max_nodes if policy is None else min(max_nodes, policy.tree_budget())
        tree = proposer.propose_tree(context, budget, params, rng) if proposer is not None and budget > 0 else None
        copy_only = tree is None and policy is not None and proposer is not None
        if copy_only:  # not worth asking the drafter: a free copy may still be (``Policy.copy_nodes``)
            tree = proposer.copy_tree(context, max_nodes)
        if tree is None:
            tree = Tree([context[-1]], [-1])
        if tree.tokens[0] != context[-1]:
            raise ValueError("a proposed tree must be rooted at the pending token context[-1]")
        if policy is not None and len(tree) > 1:
            tree = tree.prefix(1 + (policy.copy_nodes(tree) if copy_only else policy.tree_nodes(tree)))
        tree = tree.prefix(min(len(tree), n_ctx - base))  # a node per free cache cell
        if policy is not None:  # the last row's hidden state is wanted only if the next step may draft
            target.want_hidden(policy.drafts_next())
        t1 = time.perf_counter()
        if why is None and len(tree) > 1:
            logits = target.eval_tree(tree.tokens, tree.parents)
            acc, nxt = verify_tree(tree, logits, params, context, rng)
            target.keep_path([0, *acc])
            rows = logits[[0, *acc]]
        else:  # a plain step, or a backend that verifies chains only: the first branch
            chain = tree.first_chain()
            draft = [tree.tokens[i] for i in chain[1:]]
            q = None
            if any(tree.q[i] is not None for i in chain[1:]):
                V = target.vocab_size
                q = np.stack([tree.q[i] if tree.q[i] is not None else np.eye(1, V, tree.tokens[i])[0] for i in chain[1:]])
            logits = target.eval([context[-1], *draft])
            n_acc, nxt = verify_logits(draft, q, logits, params, context, rng)
            acc = chain[1 : 1 + n_acc]
            target.rollback(base + 1 + n_acc)
            rows = logits[: n_acc + 1]
        emitted = [*(tree.tokens[i] for i in acc), nxt]
        if policy is not None and len(tree) > 1 and not copy_only:
            policy.update_tree(sum(tree.scores[1:]) if tree.scores else float(len(tree) - 1), len(acc))
        lps = None if logprobs is None else token_logprobs(rows, emitted, params, context, logprobs)
        context.extend(emitted)
        t2 = time.perf_counter()
        yield TreeStep(emitted, [True] * len(acc) + [False], len(tree) - 1, len(tree) - 1, len(acc), t1 - t0,
                       t2 - t1, lps, copy_only and len(tree) > 1, nodes=len(tree), path=list(acc),
                       mode="tree" if why is None else f"chain: {why}")
