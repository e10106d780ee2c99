"""The drafter contract: what a kind declares (``Traits``), what the loop asks (``Ask``) and what every
drafter hands back (``Proposal``: a token tree rooted at the pending token; a chain is a tree with one branch).

A new kind subclasses ``Drafter``, declares its ``traits`` and implements the hooks it needs — ``propose`` (a
chain), ``propose_tree`` (a best-first tree) or ``copy_tree`` (a free copy) — or overrides ``proposal`` whole;
then it is registered by name in ``ondevice.drafters.registry``. Nothing outside the registry looks at its name.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

from ondevice.backends.base import Backend
from ondevice.errors import OndeviceError
from ondevice.sampling import SamplingParams
from ondevice.tree import Tree


class Guess(NamedTuple):
    """What the policy judges a cheap (lookup) drafter's guess by."""

    match_len: int  # how far back the copied source agrees with the context
    from_prompt: bool  # the guess copies the request's prompt (not the answer so far)


@dataclass(frozen=True, kw_only=True)
class Traits:
    """What a drafter kind declares; the loader, ``draft="auto"``, the policy and the loop read these, never a name.

    Attributes:
        name: the registry name ("model", "ngram", "heads", ...), reported in ``Stats.drafter``.
        cheap: proposing costs nothing: the loop asks for the longest guess every step and the policy keeps a
            prefix of it, judged by ``Proposal.guess`` and learnt per match length (``GuessSurvival``); an
            expensive drafter is asked for exactly γ tokens and its acceptance is learnt per position.
        trees: grows best-first trees (``propose_tree``) whose prefixes the policy sizes.
        needs: what the drafter reads from the target's pass (``Backend.features``: "hidden", the post-norm
            hidden state of the last cached row); the runtime switches these on and keeps the last row.
        model: the kind drafts with a second model (``load(draft=...)``).
    """

    name: str
    cheap: bool = False
    trees: bool = False
    needs: frozenset[str] = frozenset()
    model: bool = False

    @property
    def max_gamma(self) -> int:
        """The most drafts a step asks for by default: long copies for a free lookup, else 8."""
        return 32 if self.cheap else 8


@dataclass(frozen=True, kw_only=True)
class Ask:
    """What the loop asks a drafter for in one step.

    Attributes:
        context: the whole sequence so far (its last token is pending).
        budget: drafted tokens (a chain) or nodes (a tree) at most.
        shape: "chain" or "tree".
        copy_only: the policy does not ask the drafter to draft; a free copy may still be offered.
        keep_drafting: asked after each drafted token with the draft's probabilities so far; False stops.
        constraint: the request's ``ondevice.constrain.Constraint`` (None: unconstrained).
    """

    context: Sequence[int]
    budget: int
    params: SamplingParams
    rng: np.random.Generator | None
    shape: str = "chain"
    copy_only: bool = False
    keep_drafting: Callable[[list[float]], bool] | None = None
    constraint: object = None


@dataclass(frozen=True, kw_only=True)
class Proposal:
    """One step's drafts: a ``Tree`` rooted at the pending token (node 0), with per-node q rows and scores.

    Attributes:
        tree: the candidates; a chain is a tree with one branch, a plain step the root alone.
        q: a chain's q rows stacked [drafted, V] as the drafter made them (None: point masses, or see ``tree.q``).
        asked: the γ or node budget the step was planned with (``Stats.gamma_counts``).
        guess: a cheap drafter's lookup (what the policy judged it by), else None.
        whole: a cheap drafter's whole guess, drafted or not (the policy learns from all of it).
        copied: the drafts are a free copy (their outcome and time say nothing of the drafter).
    """

    tree: Tree
    q: np.ndarray | None = None
    asked: int = 0
    guess: Guess | None = None
    whole: tuple[int, ...] = ()
    copied: bool = False

    @classmethod
    def plain(cls, root: int, **kw) -> Proposal:
        """No drafts: the step emits the target's own token."""
        return cls(tree=Tree.chain([int(root)]), **kw)

    @classmethod
    def chain(cls, root: int, tokens: Sequence[int], q: np.ndarray | None = None, **kw) -> Proposal:
        """A chain of ``tokens`` after ``root`` with q rows ``q`` [len(tokens), V] (None: point masses)."""
        n = len(tokens)
        tree = Tree.chain([int(root), *map(int, tokens)], None if q is None else [None, *q[:n]])
        return cls(tree=tree, q=None if q is None else q[:n], **kw)

    @property
    def drafted(self) -> int:
        return len(self.tree) - 1

    def is_chain(self) -> bool:
        return all(len(c) <= 1 for c in self.tree.children)


class Drafter:
    """The drafter contract; every member the loop, the runtime and the policy use, with defaults.

    Attributes:
        traits: what the kind declares (class attribute of each kind).
        backend: the draft model's backend, when there is one (its cost is measured; its context bounds the
            runtime's).
    """

    traits: Traits = Traits(name="drafter")
    backend: Backend | None = None
    vocab_limit: int | None = None  # the ids it can propose, below this (None: the target's whole vocabulary)
    copies = None  # an ``ondevice.drafters.copies.Copies`` beside its drafts, if any (not imported: copies imports base)

    @property
    def name(self) -> str:
        return self.traits.name

    @property
    def guess(self) -> Guess | None:
        """What the policy judges the last guess by (cheap drafters; None otherwise)."""
        return None

    def lag(self, context: Sequence[int]) -> int:
        """Tokens of ``context`` the drafter must evaluate before it can draft (charged to a drafting step)."""
        return 0

    def proposal(self, ask: Ask) -> Proposal | None:
        """The one entry the loop calls: a ``Proposal`` rooted at ``ask.context[-1]``, or None (a plain step).

        The default builds it from the kind's hooks: ``copy_tree`` for ``ask.copy_only``, ``propose_tree`` for
        trees, ``propose`` for chains. A kind may override it whole."""
        ctx = ask.context
        if ask.copy_only:
            tree = self.copy_tree(ctx, ask.budget)
            return None if tree is None else Proposal(tree=tree, copied=True)
        if ask.shape == "tree":
            tree = self.propose_tree(ctx, ask.budget, ask.params, ask.rng)
            return None if tree is None else Proposal(tree=tree, asked=ask.budget)
        tokens, q = self.propose(ctx, ask.budget, ask.params, ask.rng, keep_drafting=ask.keep_drafting,
                                 constraint=ask.constraint)
        copied = bool(tokens) and self.copies is not None and self.copies.copied  # the chain is a free copy
        return Proposal.chain(ctx[-1], tokens, q, asked=ask.budget, guess=self.guess, copied=copied)

    def propose(
        self, context: Sequence[int], gamma: int, params: SamplingParams, rng: np.random.Generator,
        keep_drafting: Callable[[list[float]], bool] | None = None, constraint=None,
    ) -> tuple[list[int], np.ndarray | None]:
        """(chain hook) Guess up to ``gamma`` tokens that follow ``context`` (the whole sequence so far).

        Args:
            keep_drafting: asked after each drafted token with the draft's probabilities so far; False stops.
            constraint: the request's ``ondevice.constrain.Constraint`` (None: unconstrained); an expensive
                drafter draws from (and reports) the masked q; a cheap drafter's guess is cut by the loop.
        Returns:
            (tokens[γ'], q[γ', target V] or None for a deterministic drafter), γ' ≤ γ.
        """
        raise NotImplementedError

    def propose_tree(self, context: Sequence[int], max_nodes: int, params: SamplingParams, rng: np.random.Generator):
        """(tree hook, ``traits.trees``) An ``ondevice.tree.Tree`` rooted at ``context[-1]`` with up to
        ``max_nodes`` drafted nodes whose every prefix is a tree, and ``scores`` (the drafter's chance each
        node's path is accepted), or None for a plain step."""
        raise NotImplementedError

    def copy_tree(self, context: Sequence[int], max_nodes: int):
        """(copy hook) A free copy (no drafting cost: heads' prompt lookup) as a chain ``Tree`` with ``scores``,
        offered on steps the policy does not ask this drafter to draft (sized by ``Policy.copy_nodes``);
        None: nothing to offer (the default)."""
        return None

    def seconds_per_token(self) -> float | None:
        """Measured seconds per drafted token of a drafter without a backend (None: free, or measured on
        ``backend``); charged by the adaptive policy."""
        return None

    def reset(self) -> None:
        """Forget any cached state."""

    def close(self) -> None:
        """Free what the drafter holds (a draft model)."""


class LayerInputsDrafter(Drafter):
    """A drafter whose draft (``graph``: llama.cpp's, with ``rollback`` and ``close``) runs on the target's layer
    inputs, recorded for every token of every pass (EAGLE-3, DFlash): the draft's cache positions 0..``_valid``-1
    hold what the target's true features of ``_tokens`` made. A kind calls ``_attach`` before making its graph,
    ``_new_features`` then ``_absorbed`` to bring the cache up to a context."""

    graph = None

    def _attach(self, target) -> Callable[[list[int]], object]:
        """Hold ``target`` (its vocabulary is the draft's) with an empty draft cache; returns the hook the graph
        calls with the layer ids it reads, once checked against the target, before it makes its own context: it
        switches the target's layer inputs on (a qwen2 target recreates its own context). A target that cannot
        record layer inputs is refused here, in its backend's one line."""
        if "layer_inputs" not in target.features:
            target.enable_layer_inputs([])  # raises the backend's one-line refusal
        self.target = target
        self.target_vocab = target.vocab_size
        self._tokens: list[int] = []  # the context the valid draft positions were built from
        self._valid = 0  # draft positions 0..valid-1 hold what the target's true features made
        self._spt: float | None = None

        def layer_inputs_on(ids: list[int]):
            self.width = target.enable_layer_inputs(ids)

        return layer_inputs_on

    def _new_features(self, context: Sequence[int], shared: int) -> tuple[int, np.ndarray] | None:
        """What the draft's cache lacks to hold positions 0..L-2 (L = len(context)): (keep, the target's
        layer-input rows of positions keep..L-2 [L-1-keep, width]), keep being the cached positions still valid
        (at most ``shared``: those built from the same context); ``_valid`` is cut to keep before the caller
        changes the draft's cache (an interruption leaves a prefix). None when the target kept no features for
        position L-2 (nothing to draft from)."""
        last = len(context) - 2
        if last < 0 or self.target.feature("layer_inputs", last) is None:
            return None
        keep = max(0, min(self._valid, shared, last))
        self._valid = keep
        feats = np.zeros((last + 1 - keep, self.width), np.float32)
        for i, pos in enumerate(range(keep, last + 1)):
            row = self.target.feature("layer_inputs", pos)
            if row is not None:  # a pass made without features leaves zeros: only the guesses change, never the law
                feats[i] = row
        return keep, feats

    def _absorbed(self, context: Sequence[int], tokens: int) -> None:
        """The draft's cache now holds positions 0..L-2 of ``context``, built from its first ``tokens`` tokens;
        the target may drop the features it kept up to L-2."""
        last = len(context) - 2
        self._valid, self._tokens = last + 1, [int(t) for t in context[:tokens]]
        self.target.release_features(last)

    def reset(self) -> None:
        self._valid, self._tokens = 0, []
        self.graph.rollback(0)

    def close(self) -> None:
        self.graph.close()  # before the target: the draft borrows its context


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two id sequences."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def file_arch(path: str | Path) -> str | None:
    """A GGUF file's ``general.architecture`` read from its header alone; None for anything else (not a
    ``.gguf`` file, unreadable, no architecture)."""
    from ondevice.formats.gguf import read_header

    p = Path(path)
    if p.suffix != ".gguf" or not p.is_file():
        return None
    try:
        arch = read_header(p)[0].get("general.architecture")
    except (OndeviceError, OSError):
        return None
    return arch if isinstance(arch, str) else None
