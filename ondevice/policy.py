"""Choosing γ each step: maximise expected throughput from measured costs and acceptance.

Exactness never depends on γ (the rejection rule is exact for any γ chosen before the target sees
the drafts), so the policy is free to use anything it has seen so far.

Model of one step with γ drafts (units: one plain target decode):
    E[tokens] = 1 + Σ_{i=1..γ} Π_{j≤i} α_j        (α_j: chance draft j is kept, given j−1 were)
    cost      = γ·c + cost(γ+1)/cost(1)            (c: draft token ÷ target decode; 0 for n-gram)
Each step takes the γ with the largest expected *gain* E[tokens] − cost: the decodes it saves over
plain decoding (γ = 0 gains nothing). Time to finish an answer is Σ cost over its steps, and plain
decoding makes one token per unit, so this is the per-step rule that minimises it; maximising each
step's own ratio E[tokens] ÷ cost instead stops drafting too early when cost(k) is flat (a 4-draft step
at α = 0.5 with cost(5) = 1.7 gains 0.24 decodes although its ratio, 1.14, is below a 1-draft step's).
Unless even perfect acceptance could not win on this machine (then the drafter is never asked),
speculation is chosen when it is expected to gain.

Acceptance is learnt per draft position. A cheap (n-gram) drafter proposes its whole guess every step,
drafted or not, so every step — plain ones included — also says how much of the guess the target agreed
with (``update(..., proposal, emitted)``): for a deterministic guess the emitted token equals guess i
exactly as often as guess i would have been accepted, so the estimates stay fresh without probes.
A model draft (costly to ask) is probed with γ = 1 now and then instead. A model draft that fell
behind during plain steps must first catch up: that batch is charged to the step that drafts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from ondevice.costs import Costs


class Policy(Protocol):
    max_gamma: int

    def next_gamma(self, hint: int = 0, lag: int = 0) -> int:
        """γ for the next step (``hint``: n-gram match length; ``lag``: how far the draft cache is behind)."""
        ...

    def update(self, drafted: int, accepted: int, hint: int = 0, proposal: Sequence[int] | None = None,
               emitted: Sequence[int] | None = None) -> None:
        """Learn from a verified step (a cheap drafter also passes its whole ``proposal`` and the ``emitted`` tokens)."""
        ...


@dataclass
class AcceptanceEstimate:
    """Exponentially weighted acceptance per draft position, with a prior."""

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


def expected_gain(alphas: list[float], gamma: int, c: float, costs: Costs, extra: float = 0.0) -> float:
    """Expected decodes saved over plain decoding by a step with ``gamma`` drafts: E[tokens] − cost."""
    return expected_tokens(alphas, gamma) - step_cost(gamma, c, costs, extra)


class FixedGamma:
    """Always the same γ (``gamma=N``)."""

    def __init__(self, gamma: int) -> None:
        self.gamma = self.max_gamma = gamma

    def next_gamma(self, hint: int = 0, lag: int = 0) -> int:
        return self.gamma

    def update(self, drafted: int, accepted: int, hint: int = 0, proposal=None, emitted=None) -> None:
        pass


class AdaptivePolicy:
    """γ per step from the cost model and running acceptance estimates (``gamma="auto"``).

    For a model drafter one estimate is kept per draft position. For n-gram drafts the estimate is
    kept per *match length* of the lookup (longer matches are copied text and are accepted more), and
    a streak of fully accepted drafts lets γ grow to ``max_gamma`` (long verbatim copies).

    Args:
        costs: measured target verify curve and draft cost.
        drafter: "model" or "ngram".
        max_gamma: largest γ considered (8 for models, 32 for n-gram by default).
        probe_every: model drafts: after this many plain steps, try γ = 1 once to refresh the estimates.
        learn_costs: refine the cost curve with every step's real timings.
    """

    def __init__(self, costs: Costs, drafter: str, max_gamma: int | None = None, probe_every: int = 24,
                 learn_costs: bool = True) -> None:
        self.costs = costs
        self.learn_costs = learn_costs
        self.drafter = drafter
        self.max_gamma = max_gamma or (8 if drafter == "model" else 32)
        self.probe_every = self.base_probe_every = probe_every
        self.probing = False
        self.estimates: dict[int, AcceptanceEstimate] = {}
        self.plain_run = 0
        self.streak = 0  # consecutive steps whose drafts were all accepted

    @property
    def c(self) -> float:
        """Draft token ÷ target decode (n-gram drafts cost nothing)."""
        return self.costs.draft_cost_ratio if self.drafter == "model" else 0.0

    def _estimate(self, hint: int) -> AcceptanceEstimate:
        # n-gram: one estimate per match-length bucket 0, 1, 2, 3, 4–7, 8–15, 16+ (log scale past 4)
        key = (min(hint, 4) if hint < 8 else 8 if hint < 16 else 16) if self.drafter == "ngram" else 0
        if key not in self.estimates:
            # priors: a long agreement with earlier text is usually a copy in progress; a match of 1–3 tokens
            # starts doubtful (chat and summaries guess wrong 90 % of the time) and learns fast, since every
            # step, plain or not, judges the n-gram guess for free (replayed on greedy answers: this loses
            # least where n-grams do not help and gains most where they do)
            if self.drafter == "ngram":
                prior, weight = {8: 0.7, 16: 0.9}.get(key, 0.5 if key >= 4 else 0.2), 0.15
            else:
                prior, weight = 0.7, 0.1
            self.estimates[key] = AcceptanceEstimate(prior=prior, weight=weight)
        return self.estimates[key]

    def next_gamma(self, hint: int = 0, lag: int = 0) -> int:
        """γ for the next step: the largest expected gain E[tokens] − cost (0 = plain decoding).

        Args:
            hint: the n-gram match length (0 for model drafts).
            lag: tokens the draft's cache is behind the context (model drafts after plain steps).
        """
        self.probing = False
        est = self._estimate(hint)
        copying = self.streak >= 2 or hint >= 16  # a long verbatim copy is under way: allow long drafts
        limit = self.max_gamma if (self.drafter == "model" or copying) else min(self.max_gamma, 8)
        c = self.c
        vc = self.costs.verify_costs(max(limit + 1, lag))  # one pass over the curve per step
        # A draft cache ``lag`` tokens behind must catch up first: one batch on the draft, whose curve
        # is taken to have the target's shape; it is charged to the step that drafts.
        extra = c * (vc[lag - 1] - 1.0) if lag > 1 else 0.0
        best, best_gain, ceiling = 0, 0.0, 0.0
        tokens, run = 1.0, 1.0
        for g in range(1, limit + 1):
            cost = g * c + vc[g] + extra
            run *= est.at(g - 1)
            tokens += run
            ceiling = max(ceiling, (g + 1) / cost)
            if tokens - cost > best_gain + 1e-9:
                best, best_gain = g, tokens - cost
        # Even drafts that are always accepted cannot beat plain decoding on this machine: never draft.
        if ceiling <= 1.0:
            return 0
        if best == 0 and self.drafter == "model":  # n-gram estimates learn from every step: no probes
            self.plain_run += 1
            if self.plain_run >= self.probe_every:
                self.plain_run = 0
                self.probing = True
                return 1
        elif best:
            self.plain_run = 0
        return best

    def keep_drafting(self, confidences: list[float]) -> bool:
        """Draft one more token? Only if it raises the expected gain, judging the drafts so far by
        min(position estimate, the draft's own probability of its token)."""
        est = self._estimate(0)
        k = len(confidences)
        if k >= self.max_gamma:
            return False
        alphas = [min(est.at(j), confidences[j]) for j in range(k)] + [est.at(k)]
        return expected_gain(alphas, k + 1, self.c, self.costs) > expected_gain(alphas, k, self.c, self.costs)

    def observe_step(self, drafted: int, verify_seconds: float, draft_seconds: float) -> None:
        """Refine the cost model with a real step's timings (the probe at load can be noisy)."""
        if not self.learn_costs:
            return
        per_token = draft_seconds / drafted if (drafted and self.drafter == "model") else None
        self.costs.observe(drafted + 1, verify_seconds, per_token)

    def update(self, drafted: int, accepted: int, hint: int = 0, proposal: Sequence[int] | None = None,
               emitted: Sequence[int] | None = None) -> None:
        """Learn from a verified step.

        Args:
            drafted, accepted: drafts verified and kept.
            hint: the match length the step was chosen with.
            proposal, emitted: a deterministic drafter's whole guess, and the tokens the step emitted. Guess
                i agrees with emitted i exactly when a draft of it would have been accepted (greedy), and
                as often as it would have been (sampling: a one-hot draft of t is kept with chance p(t), the
                chance the target emits t), so the estimate learns beyond ``drafted``, even from plain steps.
        """
        if proposal:
            judged, agreed = 0, 0
            for a, b in zip(proposal, emitted or (), strict=False):
                judged += 1
                if a != b:
                    break
                agreed += 1
            self._estimate(hint).update(judged, agreed)
            self.streak = self.streak + 1 if agreed == judged else 0
            return
        if drafted == 0:
            return
        self._estimate(hint).update(drafted, accepted)
        self.streak = self.streak + 1 if accepted == drafted else 0
        if self.probing:  # a failed probe waits twice as long for the next one (a success resets that)
            self.probe_every = self.base_probe_every if accepted == drafted else min(self.probe_every * 2, 512)

