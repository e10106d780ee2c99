"""Replay the greedy n-gram answers of a bench JSON under other verify curves: oracle and ``auto`` policy.

    python scripts/replay_curves.py docs/bench-x.json "q4_0=2:1.3,4:2.02,8:3.36,16:4.53" ...

Each curve is ``name=k:cost(k),...`` in plain decodes (cost(1) = 1). Prints, per curve and class, the
median modelled speedup of the oracle (best γ per step in hindsight) and of the policy, and their ratio.
Timing-free: acceptance is a fact of each greedy answer, so this isolates the policy from machine noise.
"""

from __future__ import annotations

import json
import statistics
import sys

from ondevice.costs import Costs
from ondevice.oracle import oracle_speedup


def parse(spec: str) -> tuple[str, Costs]:
    name, _, pts = spec.partition("=")
    curve = {1: 1.0} | {int(k): float(v) for k, v in (p.split(":") for p in pts.split(","))}
    return name, Costs(curve)


def main(path: str, specs: list[str]) -> dict:
    runs = [r for r in json.loads(open(path).read())["runs"] if r.get("answer_ids")]
    out = {}
    for spec in specs:
        name, costs = parse(spec)
        by_class: dict[str, list] = {}
        for r in runs:
            by_class.setdefault(r["class"], []).append(oracle_speedup(r["prompt_ids"], r["answer_ids"], costs))
        for cls, rs in by_class.items():
            o = statistics.median(x["oracle_speedup"] for x in rs)
            p = statistics.median(x["policy_speedup"] for x in rs)
            out[f"{name}/{cls}"] = {"oracle": round(o, 3), "policy": round(p, 3), "policy_over_oracle": round(p / o, 3),
                                   "answers": len(rs)}
            print(f"{name:>10} {cls:>8}: oracle {o:.2f}×  policy {p:.2f}×  policy/oracle {p / o:.2f}  ({len(rs)} answers)")
    return out


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
