"""Measure the n-gram drafter's guess survival by (source, match bucket, guess position): ``GUESS_PRIORS``.

    python scripts/guess_priors.py ANSWERS.json [MORE.json ...]

For every position of every recorded greedy answer, asks the drafter for its guess (as plain decoding
would), and counts for each guess position j whether token j was right given tokens 1..j−1 were. Prints
the table in the form ``ondevice/policy.py`` keeps it (cells with fewer than 20 observations are shown
as None: fill them from a neighbour).
"""

from __future__ import annotations

import sys
from collections import defaultdict

from ondevice.drafters import NgramDrafter
from ondevice.policy import GuessSurvival, _column

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from replay_curves import load_answers  # noqa: E402


def measure(paths: list[str]) -> dict:
    n: dict = defaultdict(float)
    ok: dict = defaultdict(float)
    for _, _, prompt, answer in load_answers(paths):
        drafter, ctx = NgramDrafter(), list(prompt)
        for i, tok in enumerate(answer):
            guess, _ = drafter.propose(ctx, 32, None, None)
            cell = GuessSurvival.bucket(drafter.guess)
            for j in range(1, min(len(guess), len(answer) - i) + 1):
                right = guess[j - 1] == answer[i + j - 1]
                n[cell, _column(j)] += 1
                ok[cell, _column(j)] += right
                if not right:
                    break
            ctx.append(tok)
    cells = sorted({c for c, _ in n})
    return {c: tuple(round(ok[c, col] / n[c, col], 2) if n[c, col] >= 20 else None for col in range(6)) for c in cells}


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", help="bench --ngram JSON documents or docs/answers/*.json")
    for cell, row in measure(ap.parse_args().files).items():
        print(f"    {cell}: {row},")
