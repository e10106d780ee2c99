"""The oracle bound of a deterministic drafter: the best per-step γ in hindsight, by dynamic programming.

Replaying a greedy answer, the drafter's real guess at every position is known, and so is how many of
its tokens the target would keep (the common prefix with the answer). Knowing that, the fastest way
through the answer chooses γ at each step to minimise the total modelled time under the measured verify
curve (one plain decode = 1):

    T(i) = min over γ ∈ 0..len(guess_i) of  cost(γ+1) + T(i + min(γ, kept_i) + 1),   T(N) = 0

and the oracle speedup is N ÷ T(0). A policy that only knows the past can at best reach it; the
benchmark reports realized ÷ oracle so that every policy change is judged against what the drafts
allowed. The guesses come from one drafter queried at every position in turn (as plain decoding would
query it); exactness never depends on any of this.
"""

from __future__ import annotations

from collections.abc import Sequence

from ondevice.costs import Costs


def guesses(prompt: Sequence[int], answer: Sequence[int], max_gamma: int = 32, drafter=None) -> list[tuple[int, int]]:
    """(guess length, tokens of it the answer agrees with) at every position of ``answer``.

    Args:
        prompt, answer: token ids (the answer as greedy decoding produced it).
        max_gamma: the longest guess asked for.
        drafter: a deterministic drafter (default: a fresh ``NgramDrafter``).
    """
    if drafter is None:
        from ondevice.drafters import NgramDrafter

        drafter = NgramDrafter()
    context = list(prompt)
    out = []
    for i, tok in enumerate(answer):
        guess, _ = drafter.propose(context, max_gamma, None, None)
        kept = 0
        while kept < len(guess) and i + kept < len(answer) and guess[kept] == answer[i + kept]:
            kept += 1
        out.append((len(guess), kept))
        context.append(tok)
    return out


def oracle_time(steps: Sequence[tuple[int, int]], costs: Costs) -> tuple[float, list[int]]:
    """Least modelled time (in plain decodes) through an answer, and the γ chosen at each step taken.

    Args:
        steps: ``guesses(...)`` of the answer.
        costs: the measured verify curve.
    """
    n = len(steps)
    if n == 0:
        return 0.0, []
    longest = max(g for g, _ in steps)
    vc = costs.verify_costs(longest + 1)  # vc[g] = cost(g + 1) / cost(1)
    best = [0.0] * (n + 1)
    choice = [0] * n
    for i in range(n - 1, -1, -1):
        length, kept = steps[i]
        b, bg = 1.0 + best[i + 1], 0
        for g in range(1, length + 1):
            t = vc[g] + best[min(n, i + min(g, kept) + 1)]
            if t < b:
                b, bg = t, g
        best[i], choice[i] = b, bg
    path, i = [], 0
    while i < n:
        g = choice[i]
        path.append(g)
        i += min(g, steps[i][1]) + 1
    return best[0], path


def oracle_speedup(prompt: Sequence[int], answer: Sequence[int], costs: Costs, max_gamma: int = 32) -> dict:
    """The n-gram oracle of one greedy answer (speedup over plain decoding, passes), with the ``auto``
    policy replayed on the same answer and curve beside it (``replay_policy``)."""
    steps = guesses(prompt, answer, max_gamma)
    t, path = oracle_time(steps, costs)
    return {"oracle_speedup": len(answer) / t if t else None, "oracle_passes": len(path),
            "oracle_plain_passes": sum(g == 0 for g in path), **replay_policy(prompt, answer, costs)}


def replay_policy(prompt: Sequence[int], answer: Sequence[int], costs: Costs, policy=None) -> dict:
    """Run the n-gram ``auto`` policy over a greedy answer without a model: modelled time, no timing noise.

    Greedy acceptance is a fact of the answer (a draft is kept while it equals the answer), so the
    policy's choices, and the time they cost under ``costs``, can be replayed exactly; set beside
    ``oracle_time`` on the same curve this isolates what the policy leaves on the table from the noise of
    a shared machine. The policy does not refine the curve during the replay.

    Returns:
        {"policy_speedup", "policy_passes", "policy_plain_passes"}: the modelled speedup over plain decoding.
    """
    import copy

    from ondevice.drafters import NgramDrafter
    from ondevice.policy import AdaptivePolicy

    pol = policy or AdaptivePolicy(copy.deepcopy(costs), "ngram", learn_costs=False)
    pol.restart()
    vc = costs.verify_costs(pol.max_gamma + 1)
    drafter = NgramDrafter()
    context = list(prompt)
    i, t, passes, plain = 0, 0.0, 0, 0
    n = len(answer)
    while i < n:
        proposal, _ = drafter.propose(context, pol.max_gamma, None, None)
        hint = drafter.guess
        g = pol.next_gamma(hint) if proposal else 0
        draft = proposal[:g]
        kept = 0
        while kept < len(draft) and i + kept < n and draft[kept] == answer[i + kept]:
            kept += 1
        emitted = list(answer[i : i + kept + 1])
        pol.update(len(draft), kept, hint, proposal, emitted)
        t += vc[len(draft)]
        passes += 1
        plain += not draft
        context.extend(emitted)
        i += len(emitted)
    return {"policy_speedup": n / t if t else None, "policy_passes": passes, "policy_plain_passes": plain}
