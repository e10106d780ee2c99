"""Choosing γ each step: maximise expected tokens per second from measured costs and acceptance.

Exactness never depends on γ (the rejection rule is exact for any γ chosen before the target sees
the drafts), so the policy is free to use anything it has seen so far.

Model of one step with γ drafts (units: one plain target decode):
    E[tokens] = 1 + Σ_{i=1..γ} Π_{j≤i} α_j        (α_j: chance draft j is kept, given j−1 were)
    cost      = γ·c + cost(γ+1)/cost(1)            (c: draft token ÷ target decode; 0 for n-gram)
γ = 0 is plain decoding with E = 1, cost = 1, so speculation is chosen only when it is expected to
win; a cheap probe (γ = 1) now and then keeps the acceptance estimates fresh, unless even perfect
acceptance could not win on this machine (then the drafter is never asked). A model draft that fell
behind during plain steps must first catch up: that batch is charged to the step that drafts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from ondevice.costs import Costs


class Policy(Protocol):
    max_gamma: int

    def next_gamma(self, hint: int = 0, lag: int = 0) -> int:
        """γ for the next step (``hint``: n-gram match length; ``lag``: how far the draft cache is behind)."""
        ...

    def update(self, drafted: int, accepted: int, hint: int = 0) -> None:
        """Learn from a verified step."""
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


def expected_rate(alphas: list[float], gamma: int, c: float, costs: Costs, extra: float = 0.0) -> float:
    """Expected tokens per unit time (plain decoding = 1.0) of a step with ``gamma`` drafts
    (``extra``: a one-off cost of the step, e.g. catching the draft cache up)."""
    if gamma == 0:
        return 1.0
    tokens, run = 1.0, 1.0
    for i in range(gamma):
        run *= alphas[i]
        tokens += run
    return tokens / (gamma * c + costs.verify_cost(gamma + 1) + extra)


class FixedGamma:
    """Always the same γ (``gamma=N``)."""

    def __init__(self, gamma: int) -> None:
        self.gamma = self.max_gamma = gamma

    def next_gamma(self, hint: int = 0, lag: int = 0) -> int:
        return self.gamma

    def update(self, drafted: int, accepted: int, hint: int = 0) -> None:
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
        probe_every: after this many plain steps, try γ = 1 once to refresh the estimates.
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
            # priors: a long agreement with earlier text is usually a copy in progress
            prior = {8: 0.7, 16: 0.9}.get(key, 0.5) if self.drafter == "ngram" else 0.7
            self.estimates[key] = AcceptanceEstimate(prior=prior)
        return self.estimates[key]

    def next_gamma(self, hint: int = 0, lag: int = 0) -> int:
        """γ for the next step.

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
        alphas = [est.at(i) for i in range(limit)]
        best, best_rate, ceiling = 0, 1.0, 0.0
        tokens, perfect, run = 1.0, 1.0, 1.0
        for g in range(1, limit + 1):
            cost = g * c + vc[g] + extra
            run *= alphas[g - 1]
            tokens += run
            perfect += 1.0
            ceiling = max(ceiling, perfect / cost)
            if tokens / cost > best_rate:
                best, best_rate = g, tokens / cost
        # Even drafts that are always accepted cannot beat plain decoding on this machine: never draft.
        if ceiling <= 1.0:
            return 0
        if best == 0:
            self.plain_run += 1
            if self.plain_run >= self.probe_every:
                self.plain_run = 0
                self.probing = True
                return 1
        else:
            self.plain_run = 0
        return best

    def keep_drafting(self, confidences: list[float]) -> bool:
        """Draft one more token? Only if it raises the expected rate, judging the drafts so far by
        min(position estimate, the draft's own probability of its token)."""
        est = self._estimate(0)
        k = len(confidences)
        if k >= self.max_gamma:
            return False
        alphas = [min(est.at(j), confidences[j]) for j in range(k)] + [est.at(k)]
        return expected_rate(alphas, k + 1, self.c, self.costs) > expected_rate(alphas, k, self.c, self.costs)

    def observe_step(self, drafted: int, verify_seconds: float, draft_seconds: float) -> None:
        """Refine the cost model with a real step's timings (the probe at load can be noisy)."""
        if not self.learn_costs:
            return
        per_token = draft_seconds / drafted if (drafted and self.drafter == "model") else None
        self.costs.observe(drafted + 1, verify_seconds, per_token)

    def update(self, drafted: int, accepted: int, hint: int = 0) -> None:
        if drafted == 0:
            return
        self._estimate(hint).update(drafted, accepted)
        self.streak = self.streak + 1 if accepted == drafted else 0
        if self.probing:  # a failed probe waits twice as long for the next one (a success resets that)
            self.probe_every = self.base_probe_every if accepted == drafted else min(self.probe_every * 2, 512)
