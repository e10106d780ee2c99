"""The decode loop: one target pass per step verifies one ``Proposal`` (a chain, or a tree where the backend
verifies trees in one pass) through the rule in ``ondevice.sampling`` / ``ondevice.tree``.

Invariant between steps: the target's cache holds ``context[:-1]``; the last token is *pending*.
One step evaluates ``[pending] + drafts`` in a single target pass, so plain decoding is just γ = 0.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from ondevice import tree as trees_rule  # looked up per call: a test can plant a wrong rule there
from ondevice.backends.base import Backend
from ondevice.constrain import Constraint
from ondevice.drafters.base import Ask, Drafter, Proposal
from ondevice.logprobs import token_logprobs
from ondevice.policy import Policy
from ondevice.results import Chunk, Result, Stats  # noqa: F401 - re-exported (the server imports them here)
from ondevice.sampling import SamplingParams, probs_batch, verify, verify_logits
from ondevice.tree import Tree

TREE_NODES = 16  # drafted nodes per tree step at most (a fixed γ asks up to this many; gamma="auto" up to the drafter's max_gamma)


@dataclass(frozen=True, kw_only=True)
class Step:
    """One target forward pass."""

    tokens: list[int]  # emitted: accepted drafts, then the target's own token
    from_draft: list[bool]
    gamma: int  # drafts (or tree nodes) asked for
    drafted: int  # drafts proposed (a drafter may propose fewer than asked); a tree's drafted nodes
    accepted: int
    draft_seconds: float
    verify_seconds: float
    logprobs: list | None = None  # per emitted token: TokenLogprob (when asked for)
    copied: bool = False  # the drafts were a free copy (their time says nothing of the drafter's cost)
    nodes: int = 1  # nodes verified, the root (pending token) included
    path: list[int] = field(default_factory=list)  # the accepted nodes (indices in the proposal, root excluded)
    mode: str = "chain"  # "chain", "tree", or "chain: <why the backend cannot verify a tree>"


def _one_hot(tokens: Sequence[int], V: int) -> np.ndarray:
    q = np.zeros((len(tokens), V))
    q[np.arange(len(tokens)), np.asarray(tokens, dtype=np.int64)] = 1.0
    return q


def steps(
    target: Backend,
    drafter: Drafter | None,
    context: list[int],
    params: SamplingParams,
    policy: Policy,
    rng: np.random.Generator,
    observer: Callable[[list[int], np.ndarray | None, np.ndarray, int], None] | None = None,
    *,
    n_ctx: int | None = None,
    constraint: Constraint | None = None,
    logprobs: int | None = None,
    trees: bool = False,
    max_nodes: int = TREE_NODES,
) -> Iterator[Step]:
    """Plan a proposal → verify it in one target pass → keep the accepted part → roll back, forever.

    Args:
        target: holds ``context[:-1]`` in its cache on entry; kept so after every step.
        drafter: proposes drafts (None = plain decoding).
        context: the whole sequence so far; extended in place with every emitted token.
        policy: sizes each proposal (0 = plain step) and learns from each outcome (see ``plan``).
        rng: draws every random number (draft sampling and verification).
        The target's p is never masked (but by a constraint): ids a draft cannot propose (beyond the pair's
        shared vocabulary) have q = 0 and still come out of the residual with exactly the target's probability.
        observer: called as ``observer(draft, q, p, n_accepted)`` after each chain verification (benchmarks).
        n_ctx: the context both caches can hold (default: the target's).
        constraint: the request's matcher (``ondevice.constrain``), holding the tokens emitted so far.
            Every verified row of the target is masked with the matcher state after the prefix up to
            it, a model drafter draws from (and reports) its masked q, and a cheap drafter's guess is cut
            at the first id the matcher refuses: p and q are both the constrained laws, so the
            rejection rule is exact with respect to the constrained target.
        logprobs: attach ``TokenLogprob`` (with this many alternatives, 0-20) to every emitted token,
            from the target's processed (constrained) row for it; None = off.
        trees: ask the drafter for best-first trees (``Traits.trees``); a backend that cannot verify a tree in
            one pass verifies each tree's first branch as a chain (``Step.mode`` says why; exact either way).
            Not with a constraint or an observer.
        max_nodes: drafted nodes per tree step at most.
    Yields:
        One ``Step`` per target pass.
    """
    n_ctx = target.n_ctx if n_ctx is None else min(n_ctx, target.n_ctx)
    if trees and (constraint is not None or observer is not None):
        raise ValueError("tree steps take neither a constraint nor an observer")
    why = target.tree_unsupported() if trees else "chain"
    mode = "chain" if not trees else "tree" if why is None else f"chain: {why}"
    features = trees and drafter is not None and bool(drafter.traits.needs)
    policy.restart()  # guesses about an earlier request's tokens are not judged against this one's
    while True:
        base = len(context) - 1  # the target cache holds context[:-1]
        if base + 1 > n_ctx:
            return  # the context is full: the caller reports stop_reason "context"
        t0 = time.perf_counter()
        ask = dict(context=context, params=params, rng=rng, room=n_ctx - base - 1)
        prop = plan_tree(drafter, policy, max_nodes=max_nodes, **ask) if trees else \
            plan_chain(drafter, policy, constraint=constraint, **ask)
        if features:  # the last row's features are wanted only if the next step may draft
            target.keep_features(policy.drafts_next())
        t1 = time.perf_counter()
        if why is None and prop.drafted:
            acc, nxt, rows = _verify_tree(target, prop.tree, context, params, rng)
        else:
            acc, nxt, rows = _verify_chain(target, prop, context, params, rng, constraint, observer)
        emitted = [*(prop.tree.tokens[i] for i in acc), nxt]
        learn(policy, prop, len(acc), emitted, trees)
        lps = None if logprobs is None else token_logprobs(rows, emitted, params, context, logprobs)
        if constraint is not None:
            constraint.advance(emitted)
        context.extend(emitted)
        t2 = time.perf_counter()
        yield Step(tokens=emitted, from_draft=[True] * len(acc) + [False], gamma=prop.asked, drafted=prop.drafted,
                   accepted=len(acc), draft_seconds=t1 - t0, verify_seconds=t2 - t1, logprobs=lps, copied=prop.copied,
                   nodes=len(prop.tree), path=list(acc), mode=mode)


def plan_chain(drafter: Drafter | None, policy: Policy, *, context: list[int], params: SamplingParams,
               rng: np.random.Generator, room: int, constraint: Constraint | None = None) -> Proposal:
    """This step's chain. A cheap drafter (``Traits.cheap``) proposes its longest guess and the policy keeps a
    prefix, judged by ``Proposal.guess``; an expensive one is asked for exactly γ tokens, and on steps it is not
    asked it may offer a free copy (``Drafter.copy_tree``: heads) that ``Policy.copy_nodes`` sizes."""
    root = context[-1]
    if drafter is None:
        return Proposal.plain(root)
    if drafter.traits.cheap:
        p = drafter.proposal(Ask(context=context, budget=min(policy.max_gamma, room), params=params, rng=rng))
        guess = p.guess if p is not None else drafter.guess
        whole = p.tree.tokens[1:] if p is not None else []
        if constraint is not None and whole:  # a guess the constraint refuses is cut, never proposed
            whole = whole[: constraint.valid_prefix(whole)]
        g = min(policy.next_gamma(guess), room) if whole else 0
        return Proposal.chain(root, whole[:g], None if p is None else p.q, asked=g, guess=guess, whole=tuple(whole))
    g = max(0, min(policy.next_gamma(0, drafter.lag(context)), room))
    if g > 0:  # q from masked logits under a constraint
        p = drafter.proposal(Ask(context=context, budget=g, params=params, rng=rng, keep_drafting=policy.keep_drafting,
                              constraint=constraint))
        return Proposal.plain(root, asked=g) if p is None else Proposal(tree=p.tree, q=p.q, asked=g, copied=p.copied)
    copy = drafter.proposal(Ask(context=context, budget=min(policy.max_gamma, room), params=params, rng=rng,
                             copy_only=True))  # not worth asking the drafter: a free copy may still be
    if copy is None:
        return Proposal.plain(root)
    n = policy.copy_nodes(copy.tree)
    if constraint is not None:
        n = min(n, constraint.valid_prefix(copy.tree.tokens[1 : n + 1]))
    return Proposal.chain(root, copy.tree.tokens[1 : n + 1], asked=n, copied=n > 0)


def plan_tree(drafter: Drafter | None, policy: Policy, *, context: list[int], params: SamplingParams,
              rng: np.random.Generator, room: int, max_nodes: int = TREE_NODES) -> Proposal:
    """This step's tree: the drafter's best-first tree within ``Policy.tree_budget``, or on steps it is not
    asked a free copy; a prefix sized by ``Policy.tree_nodes`` (``copy_nodes`` for a copy) and the free cells."""
    root = context[-1]
    budget = min(max_nodes, policy.tree_budget())
    p = drafter.proposal(Ask(context=context, budget=budget, params=params, rng=rng, shape="tree")) \
        if drafter is not None and budget > 0 else None
    copy_only = p is None and drafter is not None
    if copy_only:  # not worth asking the drafter: a free copy may still be (``Policy.copy_nodes``)
        p = drafter.proposal(Ask(context=context, budget=max_nodes, params=params, rng=rng, copy_only=True))
    tree = Tree([root], [-1]) if p is None else p.tree
    if tree.tokens[0] != root:
        raise ValueError("a proposed tree must be rooted at the pending token context[-1]")
    if len(tree) > 1:
        tree = tree.prefix(1 + (policy.copy_nodes(tree) if copy_only else policy.tree_nodes(tree)))
    tree = tree.prefix(min(len(tree), room + 1))  # a node per free cache cell
    return Proposal(tree=tree, asked=len(tree) - 1, copied=copy_only and len(tree) > 1)


def learn(policy: Policy, prop: Proposal, accepted: int, emitted: list[int], trees: bool) -> None:
    """The policy learns from a verified proposal (a free copy's outcome says nothing about the drafter)."""
    if prop.copied:
        return
    if not trees:
        policy.update(prop.drafted, accepted, prop.guess or 0, list(prop.whole), emitted)
    elif prop.drafted:
        scores = prop.tree.scores
        policy.update_tree(sum(scores[1:]) if scores else float(prop.drafted), accepted)


def _verify_chain(target, prop: Proposal, context, params, rng, constraint, observer):
    """The proposal's first branch in one pass (``verify_logits``); the cache keeps the accepted drafts.
    Returns (accepted node indices, the next token, the rows that scored the emitted tokens)."""
    tree = prop.tree
    chain = tree.first_chain()
    draft = [tree.tokens[i] for i in chain[1:]]
    q = prop.q
    if q is None and any(tree.q[i] is not None for i in chain[1:]):
        V = target.vocab_size
        q = np.stack([tree.q[i] if tree.q[i] is not None else np.eye(1, V, tree.tokens[i])[0] for i in chain[1:]])
    base = len(context) - 1
    logits = target.eval([context[-1], *draft])  # [len(draft)+1, V]
    if constraint is not None:  # row i: the matcher state after draft[:i]
        logits = constraint.mask_rows(logits, draft)
    if draft and q is not None:
        q = q[: len(draft)]
    if observer is None:  # the target's own law (masked only by a constraint); only the rows examined are processed
        n_acc, nxt = verify_logits(draft, q, logits, params, context, rng)
    else:  # the same rule on every row, with p and q built in full for the observer
        p = probs_batch(logits, params, context, draft)
        if draft and q is None:
            q = _one_hot(draft, target.vocab_size)
        n_acc, nxt = verify(draft, q, p, rng)
        observer(draft, q, p, n_acc)
    target.rollback(base + 1 + n_acc)  # keep pending + accepted drafts; nxt becomes pending
    return chain[1 : 1 + n_acc], nxt, logits


def _verify_tree(target, tree: Tree, context, params, rng):
    """The whole tree in one pass (``eval_tree``, ``verify_tree``); the cache keeps the accepted branch."""
    logits = target.eval_tree(tree.tokens, tree.parents)
    acc, nxt = trees_rule.verify_tree(tree, logits, params, context, rng)
    target.keep_path([0, *acc])
    return acc, nxt, logits[[0, *acc]]
