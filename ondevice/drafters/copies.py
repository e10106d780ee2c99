"""Free copies beside a trained drafter's drafts (the heads, EAGLE): prompt lookup where the context repeats.

A trained drafter rarely knows an identifier or a phrase the prompt spelled out; a copy rarely guesses free text, so
together they beat either alone (docs/heads.md, docs/eagle.md). When the context's suffix occurs earlier
(``NgramDrafter``, prompt lookup) with at least ``copy_min`` tokens agreeing:

- a chain is the copy instead of the drafter's tokens (a point mass per token, q None: exact at any temperature);
- a tree gets the copy as one more branch from the root, each copied token scored by the measured survival of
  n-gram guesses (``ondevice.guesses.GuessSurvival``), and the best ``max_nodes`` nodes of both are kept;
- on steps the policy does not ask the drafter to draft, the copy alone is offered (``Drafter.copy_tree``).
"""

from __future__ import annotations

from collections.abc import Sequence

from ondevice.drafters.ngram import NgramDrafter
from ondevice.guesses import GuessSurvival
from ondevice.sampling import SamplingParams
from ondevice.tree import Tree

COPY_MIN = 2  # measured best of 1, 2, 3, 4, 6 on held-out answers for the heads (1 lets chance one-token matches in)
_GREEDY = SamplingParams(temperature=0.0)
_PRIORS = GuessSurvival()  # read only: the measured priors of n-gram guesses' survival


def copy_guess(ngram: NgramDrafter, context: Sequence[int], gamma: int, copy_min: int, constraint=None) -> list[int]:
    """The prompt-lookup copy of up to ``gamma`` tokens after ``context`` when its match agrees for at least
    ``copy_min`` tokens, else []. Under a ``constraint`` the copy is cut before the first token it forbids
    (``Constraint.valid_prefix``: nothing after an end of generation; nothing consumed)."""
    guess, _ = ngram.propose(context, gamma, _GREEDY, None)
    if not guess or ngram.last_match_len < copy_min:
        return []
    guess = [int(t) for t in guess]
    return guess if constraint is None else guess[: constraint.valid_prefix(guess)]


def merge_copy(tokens: list[int], parents: list[int], scores: list[float], copy: list[int], alphas: list[float],
               max_nodes: int) -> tuple[list[int], list[int], list[float]]:
    """A best-first tree (``tokens``, ``parents``: 0 = the root, node i + 1 is entry i; ``scores``) with a copy
    grafted on as a path from the root, scored by the measured survival of n-gram guesses (``alphas``, the
    chance each copied token is kept given the ones before were; ``GUESS_PRIORS``). A copied token equal
    to a drafted node at the same place is that node (siblings stay distinct; it keeps the larger score).
    Returns the ``max_nodes`` best nodes by score, shallower first among equals, so every prefix is a tree
    (a node scores no more than its parent, from either source)."""
    child = {(parents[i], t): i + 1 for i, t in enumerate(tokens)}
    toks, pars, scs = list(tokens), list(parents), list(scores)
    node, score = 0, 1.0
    for t, a in zip(copy, alphas, strict=True):
        score *= a
        hit = child.get((node, t))
        if hit is None:
            toks.append(t)
            pars.append(node)
            scs.append(score)
            hit = len(toks)
            child[(node, t)] = hit
        else:
            scs[hit - 1] = max(scs[hit - 1], score)
        node = hit
    depth = [0] * (len(toks) + 1)
    for i, p in enumerate(pars):
        depth[i + 1] = depth[p] + 1  # parents come first in either source
    order = sorted(range(len(toks)), key=lambda i: (-scs[i], depth[i + 1]))[:max_nodes]
    pos = {0: 0, **{old + 1: new + 1 for new, old in enumerate(order)}}
    return [toks[i] for i in order], [pos[pars[i]] for i in order], [scs[i] for i in order]


class Copies:
    """A drafter's free copies (module docstring).

    Args:
        copy_min: the agreeing match length a copy needs (0: never copy).
    Attributes:
        copied: the last chain or tree holds a copy.
    """

    def __init__(self, copy_min: int = COPY_MIN) -> None:
        self.copy_min = copy_min
        self.ngram = NgramDrafter()
        self.copied = False

    def chain(self, context: Sequence[int], gamma: int, constraint=None) -> list[int]:
        """The copy that drafts this chain instead of the drafter, or []."""
        guess = copy_guess(self.ngram, context, gamma, self.copy_min, constraint) if self.copy_min and gamma > 0 else []
        self.copied = bool(guess)
        return guess

    def graft(self, context: Sequence[int], tokens: list[int], parents: list[int], scores: list[float],
              max_nodes: int) -> Tree:
        """The tree of these drafted nodes (best-first layout: 0 = the root) with the copy, if any, grafted on."""
        copy = copy_guess(self.ngram, context, max_nodes, self.copy_min) if self.copy_min and max_nodes > 0 else []
        self.copied = bool(copy)
        if copy:
            alphas = _PRIORS.alphas(self.ngram.guess, len(copy))
            tokens, parents, scores = merge_copy(tokens, parents, scores, copy, alphas, max_nodes)
        return Tree([int(context[-1]), *tokens], [-1, *parents], scores=[1.0, *scores])

    def tree(self, context: Sequence[int], max_nodes: int) -> Tree | None:
        """The copy alone as a scored chain ``Tree`` (no drafting cost), or None."""
        tree = self.graft(context, [], [], [], max_nodes)
        return tree if len(tree) > 1 else None

    def reset(self) -> None:
        self.ngram.reset()
