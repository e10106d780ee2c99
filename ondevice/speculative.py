"""The speculative loop, layered: ``steps`` (one target pass each) → ``stream`` (text chunks, stops).

Invariant between steps: the target's cache holds ``context[:-1]``; the last token is *pending*.
One step evaluates ``[pending] + draft`` in a single target pass, so plain decoding is just γ = 0.
"""

from __future__ import annotations

import codecs
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from ondevice.backends.base import Backend
from ondevice.constrain import Constraint
from ondevice.drafters import Drafter
from ondevice.logprobs import token_logprobs
from ondevice.policy import Policy
from ondevice.sampling import SamplingParams, probs_batch, verify, verify_logits


@dataclass
class Step:
    """One target forward pass."""

    tokens: list[int]  # emitted: accepted drafts, then the target's own token
    from_draft: list[bool]
    gamma: int  # drafts asked for
    drafted: int  # drafts proposed (a drafter may propose fewer than asked)
    accepted: int
    draft_seconds: float
    verify_seconds: float
    logprobs: list | None = None  # per emitted token: TokenLogprob (when asked for)
    copied: bool = False  # the drafts were a free copy (their time says nothing of the drafter's cost)


@dataclass
class Chunk:
    """A piece of streamed output."""

    text: str
    tokens: list[int]
    from_draft: list[bool]
    logprobs: list | None = None  # per token: TokenLogprob (when asked for)


@dataclass
class Stats:
    """Per-request statistics (the same names appear in every ``--json``).

    ``mean_accepted_per_forward`` counts tokens emitted per decoding target pass (accepted drafts
    plus the target's own token), the usual τ of the speculative decoding literature; plain decoding
    gives 1.0. ``accept_counts[k]`` is how many passes accepted exactly k drafts.
    """

    tokens: int = 0
    target_forwards: int = 0
    drafted: int = 0
    accepted: int = 0
    acceptance_rate: float = 0.0
    mean_accepted_per_forward: float = 0.0
    tokens_per_second: float = 0.0
    decode_tokens_per_second: float = 0.0
    time_to_first_token: float = 0.0
    load_seconds: float = 0.0
    probe_seconds: float = 0.0  # one-time cost measurement for gamma="auto" (not in tokens_per_second)
    prompt_tokens: int = 0
    prompt_eval_tokens: int = 0
    prompt_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    total_seconds: float = 0.0
    plain_steps: int = 0
    accept_counts: list[int] = field(default_factory=list)
    gamma_counts: dict[int, int] = field(default_factory=dict)
    drafter: str = "none"
    stop_reason: str = ""  # eos | length | stop | context | cancelled (also: closed or dropped unfinished) | error

    def add(self, step: Step) -> None:
        self.target_forwards += 1
        self.drafted += step.drafted
        self.accepted += step.accepted
        self.draft_seconds += step.draft_seconds
        self.verify_seconds += step.verify_seconds
        self.gamma_counts[step.gamma] = self.gamma_counts.get(step.gamma, 0) + 1
        if step.drafted == 0:
            self.plain_steps += 1
        while len(self.accept_counts) <= step.accepted:
            self.accept_counts.append(0)
        self.accept_counts[step.accepted] += 1

    def bench_fields(self) -> dict:
        """Extra fields a benchmark row reports (a sharded target's collectives: ``DistStats``)."""
        return {}

    def finish(self, t_start: float, t_first: float | None, t_end: float) -> None:
        self.total_seconds = t_end - t_start
        self.acceptance_rate = self.accepted / self.drafted if self.drafted else 0.0
        self.mean_accepted_per_forward = (self.accepted + self.target_forwards) / self.target_forwards if self.target_forwards else 0.0
        self.tokens_per_second = self.tokens / self.total_seconds if self.total_seconds > 0 else 0.0
        if t_first is not None:
            self.time_to_first_token = t_first - t_start
            decode = t_end - t_first
            self.decode_tokens_per_second = (self.tokens - 1) / decode if self.tokens > 1 and decode > 0 else 0.0


@dataclass
class Result:
    text: str
    tokens: list[int]  # generated ids only
    stats: Stats
    logprobs: list | None = None  # per token: TokenLogprob (when asked for)


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
) -> Iterator[Step]:
    """Draft → verify once → accept → roll back, forever (the caller stops it).

    Args:
        target: holds ``context[:-1]`` in its cache on entry; kept so after every step.
        drafter: proposes drafts (None = plain decoding).
        context: the whole sequence so far; extended in place with every emitted token.
        policy: chooses γ per step (0 = plain step) and learns from each outcome. A cheap drafter
            (n-gram) proposes its longest guess first and the policy keeps a prefix, judged by the
            match length; a model drafter is asked for exactly γ tokens, and on steps it is not asked it may
            offer a free copy (``Drafter.copy_tree``: heads) that ``Policy.copy_nodes`` sizes.
        rng: draws every random number (draft sampling and verification).
        The target's p is never masked (but by a constraint): ids a draft cannot propose (beyond the pair's shared vocabulary)
        have q = 0 and still come out of the residual with exactly the target's probability.
        observer: called as ``observer(draft, q, p, n_accepted)`` after each verification (benchmarks).
        n_ctx: the context both caches can hold (default: the target's).
        constraint: the request's matcher (``ondevice.constrain``), holding the tokens emitted so far.
            Every verified row of the target is masked with the matcher state after the prefix up to
            it, a model drafter draws from (and reports) its masked q, and a cheap drafter's guess is cut
            at the first id the matcher refuses: p and q are both the constrained laws, so the
            rejection rule is exact with respect to the constrained target.
        logprobs: attach ``TokenLogprob`` (with this many alternatives, 0-20) to every emitted token,
            from the target's processed (constrained) row for it; None = off.
    Yields:
        One ``Step`` per target pass.
    """
    V = target.vocab_size
    n_ctx = target.n_ctx if n_ctx is None else min(n_ctx, target.n_ctx)
    policy.restart()  # guesses about an earlier request's tokens are not judged against this one's
    while True:
        base = len(context) - 1  # the target cache holds context[:-1]
        if base + 1 > n_ctx:
            return  # the context is full: the caller reports stop_reason "context"
        room = n_ctx - base - 1
        t0 = time.perf_counter()
        draft: list[int] = []
        proposal: list[int] = []  # a cheap drafter's whole guess (the policy learns from it even when unused)
        q = None
        hint = 0
        copied = False
        if drafter is None:
            g = 0
        elif drafter.cheap:
            proposal, q = drafter.propose(context, min(policy.max_gamma, room), params, rng)
            if constraint is not None and proposal:  # a guess the constraint refuses is cut, never proposed
                proposal = proposal[: constraint.valid_prefix(proposal)]
            hint = drafter.hint
            g = min(policy.next_gamma(hint), room) if proposal else 0
            draft = proposal[:g]
        else:
            g = max(0, min(policy.next_gamma(0, drafter.lag(context)), room))
            if g > 0:
                draft, q = drafter.propose(context, g, params, rng, keep_drafting=policy.keep_drafting,
                                           constraint=constraint)  # q from masked logits
            else:  # not worth asking the drafter: a free copy may still be
                copy = drafter.copy_tree(context, min(policy.max_gamma, room))
                if copy is not None:
                    n = policy.copy_nodes(copy)
                    if constraint is not None:
                        n = min(n, constraint.valid_prefix(copy.tokens[1 : n + 1]))
                    draft, copied, g = copy.tokens[1 : n + 1], n > 0, n
        t1 = time.perf_counter()
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
                q = _one_hot(draft, V)
            n_acc, nxt = verify(draft, q, p, rng)
            observer(draft, q, p, n_acc)
        target.rollback(base + 1 + n_acc)  # keep pending + accepted drafts; nxt becomes pending
        emitted = [*draft[:n_acc], nxt]
        if not copied:  # a free copy's outcome says nothing about the drafter's own drafts
            policy.update(len(draft), n_acc, hint, proposal, emitted)
        lps = None if logprobs is None else token_logprobs(logits, emitted, params, context, logprobs)
        if constraint is not None:
            constraint.advance(emitted)
        context.extend(emitted)
        t2 = time.perf_counter()
        yield Step(emitted, [True] * n_acc + [False], g, len(draft), n_acc, t1 - t0, t2 - t1, lps, copied)


class TextAssembler:
    """Bytes of tokens → text, holding back incomplete UTF-8 and anything that may begin a stop string."""

    def __init__(self, token_bytes: Callable[[int], bytes], stop: Sequence[str]) -> None:
        self._bytes = token_bytes
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.stop = [s for s in stop if s]
        self.text = ""  # everything decoded so far
        self.emitted = 0  # characters of text already released
        self.stopped = False

    def feed(self, token: int) -> str:
        """Add a token; return newly releasable text (may be empty). Sets ``stopped`` on a stop string."""
        self.text += self._dec.decode(self._bytes(token))
        return self._release(final=False)

    def flush(self) -> str:
        """The end (EOS, a stop, a token limit, a cut): release the rest. An incomplete UTF-8 sequence left at
        the end (a character cut in the middle by ``max_tokens``) is dropped, never shown as U+FFFD."""
        self._dec.reset()
        return self._release(final=True)

    def _stop_prefix(self, s: str) -> int:
        """Length of the longest proper prefix of ``s`` that the text ends with (0 if none)."""
        for k in range(min(len(s) - 1, len(self.text)), 0, -1):
            if self.text.endswith(s[:k]):
                return k
        return 0

    def _release(self, final: bool) -> str:
        hits = [i for s in self.stop if (i := self.text.find(s, max(0, self.emitted - len(s)))) >= 0]
        if hits:  # cut at the earliest occurrence of any stop string
            self.text = self.text[: min(hits)]
            self.stopped = True
            final = True
        end = len(self.text)
        if not final:  # hold back the longest suffix that could still grow into any stop string
            end -= max((self._stop_prefix(s) for s in self.stop), default=0)
        out = self.text[self.emitted : end]
        self.emitted = max(self.emitted, end)
        return out


def step_chunks(step: Step, is_eog: Callable[[int], bool], text: TextAssembler, stats: Stats, max_tokens: int) -> list[Chunk]:
    """One step's tokens → chunks (one per run of draft / target tokens), stopping at EOS, a stop
    string or ``max_tokens`` (recorded in ``stats.stop_reason``)."""
    chunks: list[Chunk] = []
    lps = step.logprobs if step.logprobs is not None else [None] * len(step.tokens)
    for tok, fd, lp in zip(step.tokens, step.from_draft, lps, strict=True):
        if is_eog(tok):
            stats.stop_reason = "eos"
            break
        piece = text.feed(tok)
        if chunks and chunks[-1].from_draft[-1] == fd:
            chunks[-1].tokens.append(tok)
            chunks[-1].from_draft.append(fd)
            chunks[-1].text += piece
        else:
            chunks.append(Chunk(piece, [tok], [fd], [] if step.logprobs is not None else None))
        if step.logprobs is not None:
            chunks[-1].logprobs.append(lp)
        stats.tokens += 1
        if text.stopped:
            stats.stop_reason = "stop"
            break
        if stats.tokens >= max_tokens:
            stats.stop_reason = "length"
            break
    return chunks
