"""Choosing γ each step: maximise expected throughput from measured costs and acceptance.

Exactness never depends on γ (the rejection rule is exact for any γ chosen before the target sees
the drafts), so the policy is free to use anything it has seen so far.

Model of one step with γ drafts (units: one plain target decode):
    E[tokens] = 1 + Σ_{i=1..γ} Π_{j≤i} α_j        (α_j: chance draft j is kept, given j−1 were)
    cost      = γ·c + cost(γ+1)/cost(1)            (c: draft token ÷ target decode; 0 for n-gram)
Each step takes the γ with the largest expected *gain* E[tokens] − cost: the decodes it saves over
plain decoding (γ = 0 gains nothing), with the time a step adds over a plain one counted ``RISK`` times
(a margin against the upward bias of the best of many noisy estimates). Time to finish an answer is Σ cost over its steps, and plain
decoding makes one token per unit, so this is the per-step rule that minimises it; maximising each
step's own ratio E[tokens] ÷ cost instead stops drafting too early when cost(k) is flat (a 4-draft step
at α = 0.5 with cost(5) = 1.7 gains 0.24 decodes although its ratio, 1.14, is below a 1-draft step's).
Unless even perfect acceptance could not win on this machine (then the drafter is never asked),
speculation is chosen when it is expected to gain.

Acceptance is learnt per draft position (for n-gram guesses also per match length and source:
``GuessSurvival``). A cheap (n-gram) drafter proposes its whole guess every step, drafted or not, so every
step — plain ones included — also says how much of the guess the target agreed with (``update(...,
proposal, emitted)``): for a deterministic guess the emitted token equals guess i exactly as often as
guess i would have been accepted, so the estimates stay fresh without probes.
A model draft (costly to ask) is probed with γ = 1 now and then instead. A model draft that fell
behind during plain steps must first catch up: that batch is charged to the step that drafts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ondevice.costs import Costs
from ondevice.drafters.base import Guess, Traits
from ondevice.guesses import GUESS_PRIORS, MATCH_BUCKETS, GuessSurvival, _column  # noqa: F401 - re-exported


class Policy:
    """The contract of a γ policy; every member the loop calls, with the default a simple policy wants.

    Attributes:
        max_gamma: the most drafts one step may ask for (a cheap drafter proposes up to this many).
    """

    max_gamma: int = 0

    def next_gamma(self, hint: Guess | int = 0, lag: int = 0) -> int:
        """γ for the next step (``hint``: a cheap drafter's ``Guess`` (match length, copying from the prompt), or
        a match length, 0 for model drafts; ``lag``: how far the draft cache is behind)."""
        raise NotImplementedError

    def update(self, drafted: int, accepted: int, hint: Guess | int = 0, proposal: Sequence[int] | None = None,
               emitted: Sequence[int] | None = None) -> None:
        """Learn from a verified step (a cheap drafter also passes its whole ``proposal`` and the ``emitted`` tokens)."""

    def keep_drafting(self, confidences: list[float]) -> bool:
        """While a model drafter drafts: draft one more token after these (the draft's own probabilities)?"""
        return True

    def tree_budget(self) -> int:
        """Most drafted nodes worth proposing for the next step (0: a plain step without asking the drafter)."""
        return self.max_gamma

    def drafts_next(self) -> bool:
        """Whether the next step may ask the drafter (else its inputs, e.g. hidden rows, need not be kept)."""
        return True

    def tree_nodes(self, tree) -> int:
        """Drafted nodes of a proposed ``ondevice.tree.Tree`` (best first: every prefix is a tree, with
        ``scores``) to verify in the next pass; 0 = a plain step."""
        return min(self.max_gamma, len(tree) - 1)

    def copy_nodes(self, tree) -> int:
        """Drafted nodes of a copy offered while the drafter itself is not asked (``tree_budget`` 0: a plain run,
        or γ = 0); 0 = a plain step, as here."""
        return 0

    def update_tree(self, expected: float, accepted: int) -> None:
        """Learn from a verified tree: the drafter expected ``expected`` accepted nodes (Σ scores), ``accepted`` were."""

    def observe_step(self, drafted: int, verify_seconds: float, draft_seconds: float, copied: bool = False) -> None:
        """A decoding step's measured timings (the prompt's pass excluded; ``copied``: the drafts were a free copy)."""

    def restart(self) -> None:
        """A new request starts: forget what only concerned the previous one's tokens."""


@dataclass
class AcceptanceEstimate:
    """Exponentially weighted acceptance per draft position, with a prior (model drafts)."""

    prior: float = 0.6
    weight: float = 0.1  # EMA step
    by_position: list[float] = field(default_factory=list)

    def at(self, i: int) -> float:
        if i < len(self.by_position):
            return self.by_position[i]
        return self.by_position[-1] if self.by_position else self.prior

    def update(self, drafted: int, accepted: int) -> None:
        """Positions 0..accepted were judged (the first rejection, if any, included)."""
        for i in range(min(drafted, accepted + 1)):
            while len(self.by_position) <= i:
                self.by_position.append(self.at(i))
            hit = 1.0 if i < accepted else 0.0
            self.by_position[i] += self.weight * (hit - self.by_position[i])


# The tokens a draft adds must pay for RISK times the time it adds over a plain step: the best γ's gain is
# the largest of many noisy estimates, so it is biased upwards. Chosen by replaying 86 recorded greedy answers
# (Qwen2.5-Coder-1.5B, SmolLM2-135M) under the idle two-thread Qwen IQ4_NL curve: at 1.0 chat and summaries
# ran at 0.79-0.96 of plain, at 1.75 at 0.98-1.07, with edits and code at 1.00-1.25 (2.5 never drafts).
RISK = 1.75


def expected_tokens(alphas: list[float], gamma: int) -> float:
    """E[tokens] of a step with ``gamma`` drafts: 1 + Σ_i Π_{j≤i} α_j."""
    tokens, run = 1.0, 1.0
    for i in range(gamma):
        run *= alphas[i]
        tokens += run
    return tokens


def step_cost(gamma: int, c: float, costs: Costs, extra: float = 0.0) -> float:
    """Modelled time of a step with ``gamma`` drafts, in plain decodes."""
    return 1.0 if gamma == 0 else gamma * c + costs.verify_cost(gamma + 1) + extra


def expected_rate(alphas: list[float], gamma: int, c: float, costs: Costs, extra: float = 0.0) -> float:
    """Expected tokens per unit time (plain decoding = 1.0) of a step with ``gamma`` drafts
    (``extra``: a one-off cost of the step, e.g. catching the draft cache up)."""
    return expected_tokens(alphas, gamma) / step_cost(gamma, c, costs, extra)


def expected_gain(alphas: list[float], gamma: int, c: float, costs: Costs, extra: float = 0.0, risk: float = 1.0) -> float:
    """Expected decodes saved over plain decoding by a step with ``gamma`` drafts: E[tokens] − cost, with the
    time beyond a plain step counted ``risk`` times (a margin, see ``RISK``)."""
    return expected_tokens(alphas, gamma) - 1.0 - risk * (step_cost(gamma, c, costs, extra) - 1.0)


class FixedGamma(Policy):
    """Always the same γ (``gamma=N``)."""

    def __init__(self, gamma: int) -> None:
        self.gamma = self.max_gamma = gamma

    def next_gamma(self, hint: Guess | int = 0, lag: int = 0) -> int:
        return self.gamma

    def tree_budget(self) -> int:
        return self.gamma


class AdaptivePolicy(Policy):
    """γ per step from the cost model and running acceptance estimates (``gamma="auto"``).

    For a model drafter one estimate is kept per draft position. For n-gram drafts the estimates are
    kept per *match length* of the lookup and guess position (``GuessSurvival``): longer matches are
    copied text and are kept more, and a copy that has held for a few tokens tends to hold.

    Args:
        costs: measured target verify curve and draft cost (for heads: their measured seconds per token).
        drafter: the drafter's declared ``Traits`` (or a registered kind's name): a cheap one's guesses are
            free and judged by their ``Guess``; one that pays per drafted token is probed now and then when
            plain steps win.
        max_gamma: largest γ considered (8 for models, 32 for n-gram by default).
        probe_every: model drafts: after this many plain steps, try γ = 1 once to refresh the estimates.
        learn_costs: refine the cost curve with every step's real timings.
    """

    def __init__(self, costs: Costs, drafter: Traits | str, max_gamma: int | None = None, probe_every: int = 24,
                 learn_costs: bool = True) -> None:
        self.costs = costs
        self.learn_costs = learn_costs
        if isinstance(drafter, str):
            from ondevice.drafters import registry

            drafter = registry.traits(drafter)
        self.traits = drafter
        self.cheap = drafter.cheap  # free deterministic guesses: learnt per match length, never probed
        self.max_gamma = max_gamma or drafter.max_gamma
        self.probe_every = self.base_probe_every = probe_every
        self.probing = False
        self.estimate = AcceptanceEstimate(prior=0.7, weight=0.1)  # model drafts
        self.guesses = GuessSurvival()  # n-gram drafts
        self.plain_run = 0
        self.calibration = 0.8  # trees: accepted nodes ÷ the drafter's Σ scores (EMA)

    @property
    def c(self) -> float:
        """Draft token ÷ target decode (n-gram drafts cost nothing)."""
        return 0.0 if self.cheap else self.costs.draft_cost_ratio

    def restart(self) -> None:
        """A new request (token stream) begins: n-gram estimates start again from their priors."""
        self.guesses.restart()

    def alphas(self, hint: Guess | int, n: int) -> list[float]:
        """[α_1, …, α_n]: the chance each draft position is kept, given the ones before it were."""
        if self.cheap:
            return self.guesses.alphas(hint, n)
        return [self.estimate.at(i) for i in range(n)]

    def next_gamma(self, hint: Guess | int = 0, lag: int = 0) -> int:
        """γ for the next step: the largest expected gain E[tokens] − 1 − RISK·(cost − 1) (0 = plain decoding;
        the loop is ``expected_gain`` for every γ in one pass).

        Args:
            hint: the n-gram drafter's (match length, copying from the prompt), or a match length (0 for model drafts).
            lag: tokens the draft's cache is behind the context (model drafts after plain steps).
        """
        self.probing = False
        limit = self.max_gamma
        alphas = self.alphas(hint, limit)
        c = self.c
        vc = self.costs.verify_costs(max(limit + 1, lag))  # one pass over the curve per step
        # A draft cache ``lag`` tokens behind must catch up first: one batch on the draft, whose curve
        # is taken to have the target's shape; it is charged to the step that drafts.
        extra = c * (vc[lag - 1] - 1.0) if lag > 1 else 0.0
        best, best_gain, ceiling = 0, 0.0, 0.0
        tokens, run = 1.0, 1.0
        for g in range(1, limit + 1):
            cost = g * c + vc[g] + extra
            run *= alphas[g - 1]
            tokens += run
            ceiling = max(ceiling, (g + 1) / cost)
            gain = tokens - 1.0 - RISK * (cost - 1.0)  # the extra tokens must pay RISK × the extra time
            if gain > best_gain + 1e-9:
                best, best_gain = g, gain
        # Even drafts that are always accepted cannot beat plain decoding on this machine: never draft.
        if ceiling <= 1.0:
            return 0
        if best == 0 and not self.cheap:  # n-gram estimates learn from every step: no probes
            self.plain_run += 1
            if self.plain_run >= self.probe_every:
                self.plain_run = 0
                self.probing = True
                return 1
        elif best:  # drafting chosen on its merits: probes, when plain runs come back, start again soon
            self.plain_run = 0
            self.probe_every = self.base_probe_every
        return best

    def keep_drafting(self, confidences: list[float]) -> bool:
        """Draft one more token? Only if it raises the expected gain, judging the drafts so far by
        min(position estimate, the draft's own probability of its token)."""
        k = len(confidences)
        if k >= self.max_gamma:
            return False
        est = self.alphas(0, k + 1)
        alphas = [min(est[j], confidences[j]) for j in range(k)] + [est[k]]
        return expected_gain(alphas, k + 1, self.c, self.costs, risk=RISK) > expected_gain(alphas, k, self.c, self.costs, risk=RISK)

    def tree_budget(self) -> int:
        """0 when even trees accepted whole could not beat plain decoding on this curve, or while a run of
        plain steps waits for its next probe (growing a tree costs head steps: a plain run asks for none);
        else ``max_gamma``."""
        if not self._hopeful():
            return 0
        if 0 < self.plain_run < self.probe_every:
            self.plain_run += 1
            return 0
        return self.max_gamma

    def drafts_next(self) -> bool:
        """``tree_budget`` will be positive at the next step (peeked, nothing changes)."""
        return self._hopeful() and not 0 < self.plain_run < self.probe_every

    def _hopeful(self) -> bool:
        """Trees accepted whole could beat plain decoding on this curve."""
        vc = self.costs.verify_costs(self.max_gamma + 1)
        return max((g + 1) / (g * self.c + vc[g]) for g in range(1, self.max_gamma + 1)) > 1.0

    def tree_nodes(self, tree) -> int:
        """The prefix of a best-first tree with the largest expected gain: E[tokens] = 1 + κ·Σ scores of its
        nodes (κ: ``calibration``, learnt), cost = n·c + cost(n + 1); 0 when nothing gains, which starts a run
        of plain steps (``tree_budget``) that ends with a probe of one node after ``probe_every`` steps."""
        probe_due = self.plain_run >= self.probe_every
        self.probing = False
        scores = list((tree.scores or [1.0] * len(tree))[1 : self.max_gamma + 1])
        vc = self.costs.verify_costs(len(scores) + 1)
        c = self.c
        best, best_gain, tokens = 0, 0.0, 1.0
        for n in range(1, len(scores) + 1):
            tokens += min(1.0, self.calibration * scores[n - 1])
            gain = tokens - 1.0 - RISK * (n * c + vc[n] - 1.0)
            if gain > best_gain + 1e-9:
                best, best_gain = n, gain
        if best == 0:
            if probe_due and scores:
                self.plain_run, self.probing = 0, True
                return 1
            self.plain_run = 1
            return 0
        self.plain_run = 0  # drafting chosen on its merits: probes, when plain runs come back, start again soon
        self.probe_every = self.base_probe_every
        return best

    def copy_nodes(self, tree) -> int:
        """The prefix of a copy (a chain of point masses whose ``scores`` are the measured survival of such
        guesses, ``GUESS_PRIORS``) with the largest expected gain at no drafting cost; nothing else changes
        (a copy is free to ask for, so it is judged every step, during plain runs too)."""
        scores = list((tree.scores or [])[1 : self.max_gamma + 1])
        vc = self.costs.verify_costs(len(scores) + 1)
        best, best_gain = 0, 0.0
        for n in range(1, len(scores) + 1):
            gain = sum(scores[:n]) - RISK * (vc[n] - 1.0)
            if gain > best_gain + 1e-9:
                best, best_gain = n, gain
        return best

    def update_tree(self, expected: float, accepted: int) -> None:
        """κ ← EMA of accepted ÷ expected (bounded to [0.05, 1.5]); every probe doubles the wait (``_after_probe``)."""
        if expected > 0:
            self.calibration += 0.1 * (min(1.5, max(0.05, accepted / expected)) - self.calibration)
        self._after_probe()

    def _after_probe(self) -> None:
        """A probe, whatever it found, doubles the wait for the next one (up to 512 steps): what it learnt
        shows in the next decisions, and only a decision to draft on the merits (``next_gamma`` /
        ``tree_nodes`` choosing drafts) brings the wait back to ``probe_every``. So when drafting does not pay
        (a steep verify curve) the probes' cost fades to nothing over a long answer, instead of a probe that
        kept one token (a success, yet a loss on that curve) resetting the wait every time."""
        if self.probing:
            self.probe_every = min(self.probe_every * 2, 512)
            self.probing = False

    def observe_step(self, drafted: int, verify_seconds: float, draft_seconds: float, copied: bool = False) -> None:
        """Refine the cost model with a real step's timings (the probe at load can be noisy); a free copy's
        drafting time is not the drafter's cost per token."""
        if not self.learn_costs:
            return
        per_token = draft_seconds / drafted if (drafted and not self.cheap and not copied) else None
        self.costs.observe(drafted + 1, verify_seconds, per_token)

    def update(self, drafted: int, accepted: int, hint: Guess | int = 0, proposal: Sequence[int] | None = None,
               emitted: Sequence[int] | None = None) -> None:
        """Learn from a verified step.

        Args:
            drafted, accepted: drafts verified and kept.
            hint: the match length the step was chosen with.
            proposal, emitted: a deterministic drafter's whole guess, and the tokens the step emitted. Guess
                i agrees with emitted i exactly when a draft of it would have been accepted (greedy), and
                as often as it would have been (sampling: a one-hot draft of t is kept with chance p(t), the
                chance the target emits t), so the estimate learns beyond ``drafted``, even from plain steps
                (``GuessSurvival`` keeps judging a guess against later steps' tokens).
        """
        if self.cheap:
            if proposal is None:  # only the drafted part is known: positions 1..accepted+1 were judged
                proposal = list(range(drafted))
                emitted = list(range(min(accepted, drafted))) + [-1]
            self.guesses.judge(hint, proposal, emitted or ())
            return
        if drafted == 0:
            return
        self.estimate.update(drafted, accepted)
        self._after_probe()
