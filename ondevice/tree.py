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

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ondevice.sampling import (
    SamplingParams,
    _window,
    probs_sparse,
    residual_sparse,
    sample_sparse,
)

__all__ = ["Tree", "verify_tree", "tree_rows", "walk_tree"]


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
    def chain(cls, tokens: list[int], q: list | None = None) -> Tree:
        """A chain (node i's parent is node i − 1; ``tokens[0]`` the root), built without the general checks:
        the decode loop makes one every step."""
        n = len(tokens)
        if not n:
            raise ValueError("a tree needs a root")
        t = cls.__new__(cls)
        t.tokens, t.parents, t.scores = tokens, list(range(-1, n - 1)), None
        t.q = q if q is not None else [None] * n
        t.children = [[i] for i in range(1, n)] + [[]]
        t.depth = list(range(n))
        return t

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
