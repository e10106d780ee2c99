"""Two checkouts of ondevice side by side: is a refactor behaviour- and speed-neutral?

Each round runs one child process per tree (interleaved, order alternating), which loads the same model and
answers the same prompts greedily, plain (gamma=0) and with n-gram drafting; the parent compares the token
ids (they must be identical) and the plain decode tok/s (median ratio after ÷ before). Prints JSON.

    python scripts/compare_trees.py --before /tmp/old-checkout --after . --model smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import json, sys, ondevice
model, n, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
prompts = json.loads(sys.argv[4])
out = {}
with ondevice.load(model, drafter="ngram", threads=threads) as rt:
    for i, p in enumerate(prompts):
        ids = rt.render_chat([{"role": "user", "content": p}])
        for mode, gamma in (("plain", 0), ("ngram", "auto")):
            rt.reset()
            r = rt.generate(ids, max_tokens=n, temperature=0, gamma=gamma)
            out[f"{i}:{mode}"] = {"tokens": r.tokens, "decode_tps": r.stats.decode_tokens_per_second}
print(json.dumps(out))
"""

PROMPTS = [
    "Write a Python function that reverses a string.",
    "Rename the variable `count` to `total` in: def f(xs):\n    count = 0\n    for x in xs:\n        count += x\n    return count",
    "Explain in two sentences what a KV cache is.",
]


def run(tree: str, model: str, n: int, threads: int) -> dict:
    env = {**os.environ, "PYTHONPATH": os.path.abspath(tree)}
    r = subprocess.run([sys.executable, "-P", "-c", CHILD, model, str(n), str(threads), json.dumps(PROMPTS)],
                       capture_output=True, text=True, env=env, cwd=os.path.abspath(tree), check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True)
    ap.add_argument("--after", required=True)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    ratios, identical, compared = [], 0, 0
    for rnd in range(a.rounds):
        order = [("before", a.before), ("after", a.after)][:: 1 if rnd % 2 == 0 else -1]
        res = {name: run(tree, a.model, a.max_tokens, a.threads) for name, tree in order}
        for key in res["before"]:
            compared += 1
            identical += res["before"][key]["tokens"] == res["after"][key]["tokens"]
            if key.endswith(":plain") and res["before"][key]["decode_tps"] > 0:
                ratios.append(res["after"][key]["decode_tps"] / res["before"][key]["decode_tps"])
    print(json.dumps({"model": a.model, "rounds": a.rounds, "max_tokens": a.max_tokens, "threads": a.threads,
                      "load_average": os.getloadavg(), "greedy_identical": f"{identical}/{compared}",
                      "plain_decode_ratio_after_over_before": {"median": statistics.median(ratios),
                                                               "min": min(ratios), "max": max(ratios),
                                                               "n": len(ratios)}}, indent=2))


if __name__ == "__main__":
    main()
