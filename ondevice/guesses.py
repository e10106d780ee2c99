"""How far a deterministic drafter's guesses agree with what the target emits (n-gram drafting): the
measured priors and ``GuessSurvival``, which the adaptive γ policy (``ondevice.policy``) learns with."""

from __future__ import annotations

from collections.abc import Sequence

# n-gram guesses: α_j = P(guess token j is right | tokens 1..j−1 were), by match-length bucket (rows) and
# guess position (columns: j = 1, 2, 3–4, 5–8, 9–16, 17+). Priors from ~11,000 judged guess positions in
# greedy answers of two models (SmolLM2-135M, Qwen2.5-Coder-1.5B) to code, edit, summary and chat prompts:
# a guess backed by a long agreement with earlier text is a copy in progress, and a copy that has held
# for a few tokens tends to hold.
MATCH_BUCKETS = (0, 1, 2, 3, 4, 8, 16, 32)
# α for guess positions j = 1, 2, 3–4, 5–8, 9–16, 17+, by (copying from the request's prompt, match bucket):
# measured over ~40,000 judged guess tokens of this drafter in greedy answers of SmolLM2-135M and
# Qwen2.5-Coder-1.5B to the code, edit, summary and chat prompts of scripts/prompts:
#   python scripts/guess_priors.py docs/answers/qwen2.5-coder-1.5b-iq4nl.json \
#       docs/bench-speed-ngram-smollm2-q4_0-before-curve-fix.json docs/bench-speed-ngram-smollm2-q4_0.json
# (cells with too few observations filled from a neighbour: (True, 0), (False, 0) and (False, 1)'s 17+). A guess backed by a long agreement with earlier
# text is a copy in progress; one copied from the prompt (an edit) holds better than the answer repeating
# itself, except for very long self-repeats (code restating its own structure).
GUESS_PRIORS = {
    (True, 0): (0.24, 0.67, 0.80, 0.80, 0.88, 0.93),
    (True, 1): (0.24, 0.67, 0.80, 0.80, 0.88, 0.93),
    (True, 2): (0.65, 0.80, 0.88, 0.91, 0.90, 0.95),
    (True, 3): (0.77, 0.87, 0.90, 0.92, 0.91, 0.96),
    (True, 4): (0.79, 0.88, 0.91, 0.90, 0.94, 0.97),
    (True, 8): (0.87, 0.91, 0.91, 0.94, 0.97, 0.96),
    (True, 16): (0.93, 0.96, 0.96, 0.96, 0.96, 0.98),
    (True, 32): (0.96, 0.96, 0.97, 0.97, 0.97, 0.97),
    (False, 0): (0.17, 0.41, 0.47, 0.83, 0.74, 0.80),
    (False, 1): (0.17, 0.41, 0.47, 0.83, 0.74, 0.80),
    (False, 2): (0.39, 0.54, 0.67, 0.72, 0.86, 0.90),
    (False, 3): (0.57, 0.64, 0.73, 0.83, 0.90, 0.95),
    (False, 4): (0.61, 0.77, 0.81, 0.87, 0.86, 0.96),
    (False, 8): (0.83, 0.88, 0.89, 0.87, 0.92, 0.95),
    (False, 16): (0.91, 0.94, 0.96, 0.98, 0.98, 0.95),
    (False, 32): (0.99, 0.99, 0.99, 0.99, 0.99, 0.99),
}


def _column(j: int) -> int:
    """Guess position j ≥ 1 → its column: 1, 2, 3–4, 5–8, 9–16, 17+."""
    return 0 if j == 1 else 1 if j == 2 else 2 if j <= 4 else 3 if j <= 8 else 4 if j <= 16 else 5


class GuessSurvival:
    """How far a deterministic drafter's guesses agree with what the target emits, learnt from every
    step's guess, used or not, per (source, match bucket) and guess position.

    Cells are decayed counts started from ``GUESS_PRIORS`` with ``weight`` pseudo-observations at every
    request, so the estimate follows the request (edits copy, chat does not) within a few dozen tokens.
    """

    def __init__(self, weight: float = 4.0, decay: float = 0.97) -> None:
        self.weight, self.decay = weight, decay
        self.restart()

    @staticmethod
    def bucket(hint) -> tuple[bool, int]:
        """``hint``: the match length, or (match length, copying from the prompt)."""
        n, prompt = hint if isinstance(hint, tuple) else (hint, True)
        return bool(prompt), max(b for b in MATCH_BUCKETS if b <= n)

    def alphas(self, hint, n: int) -> list[float]:
        """[α_1, …, α_n] for a guess made with ``hint``."""
        per_col = [ok / cnt for cnt, ok in self.cells[self.bucket(hint)]]
        return [per_col[_column(j)] for j in range(1, n + 1)]

    def restart(self) -> None:
        """A new request starts from the priors. Carried over, what one request taught misled the next
        (live: after two edits whose copies ended early, a shared policy ran every later answer plain)."""
        self.cells = {k: [[self.weight, self.weight * a] for a in v] for k, v in GUESS_PRIORS.items()}
        self._pending: list[list] = []  # [cell, guess, positions judged] of guesses still agreeing

    def judge(self, hint, guess: Sequence[int], emitted: Sequence[int]) -> None:
        """Record a step: its whole ``guess`` and the tokens it emitted.

        Every guess still agreeing with everything emitted since it was made is judged on each new token
        (an unused guess thus also teaches the later positions, which plain steps alone never would). The
        guesses made during one copy overlap and mostly say the same thing, so each emitted token carries
        one observation in all, shared among the guesses it judges.
        """
        if guess:
            self._pending.append([self.bucket(hint), list(guess), 0])
        for tok in emitted:
            if not self._pending:
                break
            w = 1.0 / len(self._pending)
            d = self.decay ** w
            for item in self._pending:
                cell, g, done = item
                right = g[done] == tok
                c = self.cells[cell][_column(done + 1)]
                c[0] = c[0] * d + w
                c[1] = c[1] * d + w * right
                item[2] = done + 1 if right else len(g)
            self._pending = [it for it in self._pending if it[2] < len(it[1])]
