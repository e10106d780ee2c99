"""Side by side before / after a refactor: the same greedy requests through two checkouts of ondevice, rounds
interleaved, each in its own process (``python -P``, ``PYTHONPATH`` = the checkout). Reports whether the greedy
ids are identical and the decode tok/s ratio after ÷ before per mode (plain, n-gram at γ=auto and a fixed γ,
heads when stored for the model).

Usage: python scripts/bench_before_after.py BEFORE_DIR AFTER_DIR [--model smollm2-135m-instruct] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

PROMPTS = Path(__file__).resolve().parent / "prompts"

CHILD = r"""
import json, sys
import ondevice
model, drafter, gamma, max_tokens, prompts = json.loads(sys.argv[1])
out = []
with ondevice.load(model, **({"draft": "heads"} if drafter == "heads" else {"drafter": drafter}), threads=1) as rt:
    for p in prompts:
        r = rt.generate(p, max_tokens=max_tokens, temperature=0, gamma=gamma)
        out.append({"tokens": r.tokens, "decode_tps": r.stats.decode_tokens_per_second})
print(json.dumps(out))
"""


def _prompts(n: int) -> list[str]:
    out = []
    for f in ("chat", "code", "edit"):
        lines = (PROMPTS / f"{f}.jsonl").read_text().splitlines()[:n]
        out += [json.loads(x)["prompt"] if "prompt" in json.loads(x) else json.loads(x)["messages"][-1]["content"]
                for x in lines]
    return out


def run(checkout: str, model: str, drafter: str, gamma, max_tokens: int, prompts: list[str]) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": checkout}
    r = subprocess.run([sys.executable, "-P", "-c", CHILD, json.dumps([model, drafter, gamma, max_tokens, prompts])],
                       capture_output=True, text=True, env=env, cwd=checkout, timeout=1800)
    if r.returncode:
        raise SystemExit(f"{checkout} {drafter}: {r.stderr.strip().splitlines()[-1]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--per-class", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--heads", action="store_true", help="also heads (stored for the model)")
    a = ap.parse_args()
    prompts = _prompts(a.per_class)
    modes = [("none", 0), ("ngram", "auto"), ("ngram", 4)] + ([("heads", 3)] if a.heads else [])
    report = {"model": a.model, "rounds": a.rounds, "max_tokens": a.max_tokens, "prompts": len(prompts),
              "load_average": list(os.getloadavg()), "modes": {}}
    for drafter, gamma in modes:
        same, ratios = 0, []
        for r in range(a.rounds):  # the order alternates, so a drifting load favours neither side
            if r % 2:
                c = run(a.after, a.model, drafter, gamma, a.max_tokens, prompts)
                b = run(a.before, a.model, drafter, gamma, a.max_tokens, prompts)
            else:
                b = run(a.before, a.model, drafter, gamma, a.max_tokens, prompts)
                c = run(a.after, a.model, drafter, gamma, a.max_tokens, prompts)
            same += sum(x["tokens"] == y["tokens"] for x, y in zip(b, c, strict=True))
            ratios += [y["decode_tps"] / x["decode_tps"] for x, y in zip(b, c, strict=True) if x["decode_tps"] > 0]
        report["modes"][f"{drafter}_g{gamma}"] = {
            "greedy_identical": f"{same}/{a.rounds * len(prompts)}",
            "decode_ratio_after_over_before": {"median": statistics.median(ratios), "min": min(ratios),
                                               "max": max(ratios), "n": len(ratios)}}
        print(json.dumps({f"{drafter}_g{gamma}": report["modes"][f"{drafter}_g{gamma}"]}), flush=True)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
