"""The EAGLE-3 drafter: a published EAGLE-3 draft (a GGUF of arch ``eagle3``, ``ondevice convert EAGLE_DIR --to
gguf --target TARGET``) run on the target's layer inputs by llama.cpp's own graph (``ondevice.backends.eagle3``)
for a llama.cpp target, or by the same layer written in MLX (``ondevice.backends.mlx_eagle3``) for an MLX one.

The target records the inputs of the draft's 3 layers for every token of every pass (``Traits.needs``:
"layer_inputs"; ``LlamaBackend.enable_layer_inputs``), so drafting costs no extra target pass. The draft keeps
its own KV cache, position P holding the pair (token at P + 1, g of the target's features at P): before each
chain it is rolled back to the positions built from true features of the same context (the accepted prefix),
the new ones are absorbed from the last verify pass's rows, and the chain is drafted from the pending token.

q: each drafted token is drawn from the draft's logits (over the target vocabulary, −inf outside the draft's)
processed with the request's own ``SamplingParams`` (``probs_sparse``: temperature, top-k/p, min-p, repetition
penalty), masked first by the request's constraint: the shared rejection rule keeps the target's law at any
temperature. Greedy drafting is deterministic (q None).

Trees (``Traits.trees``; the runtime asks for them unless a constraint, an observer or the backend rules them
out): EAGLE-2's dynamic tree, grown best first (``best_first``) by the draft's confidence in each node (the
product of its softmax probabilities along the path), the ``max_nodes`` best nodes kept in that order so every
prefix is a tree the policy can size (``Policy.tree_nodes``). Every node is a deterministic guess (distinct
siblings, point-mass q), which ``ondevice.tree``'s multi-draft rejection rule keeps exact at any temperature.
A node is expanded (one draft decode of its path's rows not already in the draft's cache) only when its score
is the best still open, so a tree of n nodes costs at most n draft decodes.

**Copies** (``ondevice.drafters.copies``, as the heads): where the context repeats a stretch of at least
``copy_min`` tokens, a chain is that prompt-lookup copy instead of drafted tokens, and a tree gets it as one more
branch; on by default for the drafter ``train-heads`` makes (measured: docs/eagle.md), off for downloaded ones.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

from ondevice.drafters.base import LayerInputsDrafter, Traits, common_prefix, file_arch
from ondevice.drafters.chain import Chain
from ondevice.drafters.copies import COPY_MIN, Copies
from ondevice.sampling import SamplingParams, probs_sparse
from ondevice.tree import Tree

_GREEDY = SamplingParams(temperature=0.0)


def is_eagle3_gguf(path: str) -> bool:
    """Whether ``path`` is a GGUF file whose architecture is ``eagle3`` (read from its header alone)."""
    return file_arch(path) == "eagle3"


class Eagle3Drafter(LayerInputsDrafter):
    """Chains and best-first trees from an EAGLE-3 draft fed the target's layer inputs (see the module docstring).

    Args:
        target: the target backend; it must record layer inputs (a llama.cpp target of an architecture whose
            graph keeps them, or an MLX target whose mlx-lm model has a ``layers`` list; others are refused in
            one line naming the architecture).
        path: the eagle3 GGUF.
        threads: CPU threads of the draft's context (llama.cpp).
        trees: propose trees (``propose_tree``) when the runtime allows; False: chains only.
        copy_min: a prompt-lookup copy agreeing for at least this many tokens drafts the chain and joins the
            tree (0: the draft alone). Default: 2 for a drafter ``train-heads`` wrote (measured: docs/eagle.md),
            0 for one downloaded (a strong EAGLE-3 draft may beat a short copy; not measurable here).
    """

    traits = Traits(name="eagle3", trees=True, needs=frozenset({"layer_inputs"}))
    branch = 4  # children considered per expanded tree node
    max_depth = 8  # deepest tree node
    pending_max = 64  # a run of copied chains absorbs the rows it left behind past this many (see ``propose``)

    def __init__(self, target, path: str | Path, threads: int | None = None, trees: bool = True,
                 copy_min: int | None = None) -> None:
        layer_inputs_on = self._attach(target)  # refuses a target that records no layer inputs
        if copy_min is None:
            from ondevice.heads.eagle_store import read_meta

            copy_min = COPY_MIN if read_meta(path) else 0
        self.copies = Copies(copy_min)
        # llama.cpp's eagle3 graph or the same layer in MLX, by the target's backend; checked against the target
        # (hidden size, vocabulary, depth), embedding with its table when the draft has none
        self.graph = target.eagle3_draft(path, layer_inputs_on, threads=threads)
        if not trees:
            self.traits = replace(self.traits, trees=False)

    def _absorb(self, context: Sequence[int]) -> tuple[np.ndarray, np.ndarray] | None:
        """Bring the draft's cache to pairs 0..L-2 (L = len(context)); the depth-1 (logits, pre-norm) rows, or
        None when the target kept no features for the last cached position."""
        from ondevice.backends.eagle3 import absorb

        # a pair holds the next token too: position P is valid only while context[P + 1] is the same
        new = self._new_features(context, common_prefix(self._tokens, context) - 1)
        if new is None:
            return None
        keep, feats = new
        logits, pre = absorb(self.graph, feats, context[keep:len(context) - 1], keep, int(context[-1]))
        self._absorbed(context, len(context))
        return logits, pre

    def propose(self, context, gamma, params, rng, keep_drafting=None, constraint=None):
        """Up to ``gamma`` tokens after ``context`` (its last token pending, the rest in the target's cache), each
        drawn from the draft's processed (and constrained) distribution; (tokens, q rows [γ', V] or None greedy).
        Nothing (a plain step) when the target kept no features for the last cached position."""
        V = self.target_vocab
        none = ([], None if params.greedy else np.zeros((0, V)))
        gamma = min(gamma, self.graph_room(context))
        if gamma <= 0:
            return none
        guess = self.copies.chain(context, gamma, constraint)
        if guess:  # the draft's cache catches up at the next drafted step (the target keeps the features) ...
            if len(context) - 1 - self._valid > self.pending_max:  # ... unless a long copy run piles them up:
                self._absorb(context)  # the target's kept rows and the next catch-up batch stay bounded
            return guess, None
        first = self._absorb(context)
        if first is None:
            return none
        logits, pre = first
        pos = len(context) - 1
        with Chain(context, gamma, params, rng, keep_drafting, constraint) as chain:
            while chain.take(logits[-1]):
                logits, pre = self.graph.decode([chain.tokens[-1]], pre[-1:], pos)
                pos += 1
        return chain.result(V)

    def propose_tree(self, context: Sequence[int], max_nodes: int, params: SamplingParams, rng) -> Tree | None:
        """A best-first tree of up to ``max_nodes`` drafted nodes after ``context`` (module docstring), with
        ``scores`` (the draft's confidence in each node) and a copy grafted on (``Copies.graft``); the copy alone
        when the target kept no features for the last cached position; None when nothing fits."""
        g = self.graph
        max_depth = min(self.max_depth, self.graph_room(context))
        if max_nodes <= 0 or max_depth <= 0:
            return None
        max_nodes = min(max_nodes, self.graph_room(context))  # a copy's nodes are cache cells too
        first = self._absorb(context)
        if first is None:
            return self.copies.tree(context, max_nodes)
        logits0, pre0 = first
        shared = g.n_past  # pairs up to the pending token's: node at depth d goes to position shared + d - 1
        nodes: list[tuple[int, int]] = [(int(context[-1]), -1)]  # (token, parent) per node, the root first
        pre: dict[int, np.ndarray] = {0: pre0[-1]}  # an expanded node's pre-norm output: its children's g
        cached: list[int] = []  # the nodes whose pairs the draft's cache holds after ``shared``

        def expand(node: int) -> np.ndarray:
            path = []
            while node > 0:
                path.append(node)
                node = nodes[node][1]
            path.reverse()
            c = common_prefix(cached, path)
            g.rollback(shared + c)
            todo = path[c:]
            logits, out = g.decode([nodes[n][0] for n in todo], np.stack([pre[nodes[n][1]] for n in todo]),
                                   shared + c, "last")
            cached[:] = path
            pre[path[-1]] = out[-1]
            return logits[-1]

        tokens, parents, scores = best_first(logits0[-1], expand, max_nodes, self.branch, max_depth,
                                             on_node=lambda t, p: nodes.append((t, p)))
        tree = self.copies.graft(context, tokens, parents, scores, max_nodes)
        return tree if len(tree) > 1 else None

    def copy_tree(self, context: Sequence[int], max_nodes: int) -> Tree | None:
        """The copy alone (``Copies.tree``; no draft decode), offered on steps the policy does not ask the draft
        to draft."""
        return self.copies.tree(context, min(max_nodes, self.graph_room(context)))

    def graph_room(self, context: Sequence[int]) -> int:
        """Drafts the draft's cache has room for after ``context``."""
        return self.target.n_ctx - len(context)

    def reset(self) -> None:
        super().reset()
        self.copies.reset()

    def seconds_per_token(self, reps: int = 7) -> float:
        """Median seconds of one drafted token (a decoder step and its logits), timed once on the draft's cache
        (left as it was found); charged by the adaptive policy."""
        if self._spt is None:
            from ondevice.backends.eagle3 import seconds_per_token

            self._spt = seconds_per_token(self.graph, reps, lambda logits: probs_sparse(logits[0], _GREEDY, []))
        return self._spt



def best_first(logits: np.ndarray, expand: Callable[[int], np.ndarray], max_nodes: int, branch: int, max_depth: int,
               on_node: Callable[[int, int], None] | None = None) -> tuple[list[int], list[int], list[float]]:
    """EAGLE-2's dynamic tree: the ``max_nodes`` nodes of largest confidence (the product of the draft's softmax
    probabilities along the path; each node's ``branch`` most likely children considered), found best first.

    A node's children are known once it is expanded (``expand(node)`` → its logits row); since a child's score
    is at most its parent's, a node is expanded only when its own score is the best still open, so the nodes come
    out in non-increasing score with every parent before its children (each prefix is a tree).

    Args:
        logits: the root's row (the depth-1 candidates); −inf entries (outside the draft's vocabulary) are never
            proposed.
        expand: node index (1-based: the root is 0) → that node's logits row.
        on_node: called with (token, parent) as each node joins the tree, before it can be expanded.
    Returns:
        (tokens, parents (0 = the root, node i + 1 is entry i), scores), in the order the nodes joined.
    """
    tokens: list[int] = []
    parents: list[int] = []
    scores: list[float] = []
    heap: list = []
    tie = itertools.count()  # equal scores: the earlier pushed first (a node before its children)

    def push_children(row: np.ndarray, parent: int, score: float, depth: int) -> None:
        row = np.asarray(row, np.float32)
        k = min(branch, row.size)
        top = np.argpartition(-row, k - 1)[:k]  # O(V): a full sort of a 150k vocabulary costs ~10 ms per node
        top = top[np.argsort(-row[top], kind="stable")]
        m = float(row[top[0]])
        if not np.isfinite(m):
            return
        z = float(np.exp(row - m, dtype=np.float64).sum())  # −inf rows (outside the draft vocabulary) add 0
        for t in top:
            p = float(np.exp(float(row[t]) - m)) / z
            if np.isfinite(row[t]) and p > 0:
                heapq.heappush(heap, (-score * p, next(tie), False, (int(t), parent, depth)))

    push_children(logits, 0, 1.0, 1)
    while heap and len(tokens) < max_nodes:
        neg, _, is_open, item = heapq.heappop(heap)
        if is_open:  # a tree node whose children are now the best candidates
            node, depth = item
            push_children(expand(node), node, -neg, depth + 1)
            continue
        t, parent, depth = item
        tokens.append(t)
        parents.append(parent)
        scores.append(-neg)
        if on_node is not None:
            on_node(t, parent)
        if depth < max_depth:
            heapq.heappush(heap, (neg, next(tie), True, (len(tokens), depth)))
    return tokens, parents, scores
