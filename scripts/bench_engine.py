"""Engine benchmark: plain vs fixed-γ speculative vs raw llama-cpp-python, interleaved, one JSON.

Also reports, from the same p and q rows, the acceptance our rejection rule achieves
(E[min(1, p/q)] = Σ min(p, q)) next to the token-matching rule other runtimes use (Σ p·q).

    python scripts/bench_engine.py --target qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import numpy as np

import ondevice
from ondevice.store import lookup

PROMPTS = {
    "code": "<|im_start|>user\nWrite a Python function `is_prime(n)` with a docstring.<|im_end|>\n<|im_start|>assistant\n",
    "edit": (
        "<|im_start|>user\nRename `total` to `acc` and return the whole function unchanged otherwise.\n\n"
        "```python\ndef summarize(values, weights=None):\n    total = 0\n    count = 0\n    for i, v in enumerate(values):\n"
        "        w = 1 if weights is None else weights[i]\n        total += v * w\n        count += w\n"
        "    if count == 0:\n        return 0.0\n    return total / count\n```<|im_end|>\n<|im_start|>assistant\n"
    ),
}


class AcceptanceObserver:
    """Expected acceptance per verified draft position under both rules, from the same p and q rows."""

    def __init__(self) -> None:
        self.ours: list[float] = []
        self.matching: list[float] = []

    def __call__(self, draft, q, p, n_acc) -> None:
        for i in range(min(len(draft), n_acc + 1)):  # positions the rule was applied to
            self.ours.append(float(np.minimum(p[i], q[i]).sum()))
            self.matching.append(float((p[i] * q[i]).sum()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--temperatures", default="0,0.8")
    ap.add_argument("--gammas", default="2,4")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--json", default=None)
    a = ap.parse_args()

    import llama_cpp

    from ondevice.backends.llama_ext import guard_amx

    guard_amx()  # raw loads before any ondevice backend: else an AMX machine crashes (llama_ext.amx_off)
    target = lookup.resolve(a.target)
    draft = lookup.resolve(a.draft)
    th = a.threads
    raw = llama_cpp.Llama(str(target), n_ctx=4096, n_threads=th, n_threads_batch=th, n_batch=512, verbose=False)
    plain = ondevice.load(target, drafter="none", threads=th)
    spec = ondevice.load(target, draft, threads=th)
    runs = []
    temps = [float(x) for x in a.temperatures.split(",")]
    gammas = [int(x) for x in a.gammas.split(",")]
    for temp in temps:
        for pid, prompt in PROMPTS.items():
            for rep in range(a.repeats):
                kw = dict(max_tokens=a.max_tokens, temperature=temp, top_k=40, top_p=0.95, min_p=0.05, seed=rep)
                raw.reset()
                t0 = time.perf_counter()
                out = raw.create_completion(prompt, max_tokens=a.max_tokens, temperature=temp, top_k=40, top_p=0.95,
                                            min_p=0.05, repeat_penalty=1.0, seed=rep)
                dt = time.perf_counter() - t0
                runs.append(dict(mode="raw_create_completion", temperature=temp, prompt=pid, repeat=rep,
                                 tokens=out["usage"]["completion_tokens"], seconds=dt,
                                 tokens_per_second=out["usage"]["completion_tokens"] / dt))
                plain.reset()
                r = plain.generate(prompt, gamma=0, **kw)
                runs.append(dict(mode="plain", temperature=temp, prompt=pid, repeat=rep, tokens=r.stats.tokens,
                                 seconds=r.stats.total_seconds, tokens_per_second=r.stats.tokens_per_second))
                for g in gammas:
                    obs = AcceptanceObserver()
                    spec.observer = obs
                    spec.reset()
                    r = spec.generate(prompt, gamma=g, **kw)
                    runs.append(dict(mode=f"spec_gamma{g}", temperature=temp, prompt=pid, repeat=rep, tokens=r.stats.tokens,
                                     seconds=r.stats.total_seconds, tokens_per_second=r.stats.tokens_per_second,
                                     acceptance_rate=r.stats.acceptance_rate,
                                     mean_accepted_per_forward=r.stats.mean_accepted_per_forward,
                                     expected_acceptance_ours=statistics.fmean(obs.ours) if obs.ours else None,
                                     expected_acceptance_token_matching=statistics.fmean(obs.matching) if obs.matching else None,
                                     draft_seconds=r.stats.draft_seconds, verify_seconds=r.stats.verify_seconds))
                print(json.dumps(runs[-1]), file=sys.stderr)
    summary = []
    for temp in temps:
        base = [r for r in runs if r["mode"] == "plain" and r["temperature"] == temp]
        base_tps = statistics.median(r["tokens_per_second"] for r in base)
        for mode in ["raw_create_completion", "plain", *(f"spec_gamma{g}" for g in gammas)]:
            rs = [r for r in runs if r["mode"] == mode and r["temperature"] == temp]
            row = dict(mode=mode, temperature=temp, median_tokens_per_second=statistics.median(r["tokens_per_second"] for r in rs),
                       min_tokens_per_second=min(r["tokens_per_second"] for r in rs),
                       max_tokens_per_second=max(r["tokens_per_second"] for r in rs))
            row["ratio_vs_plain"] = row["median_tokens_per_second"] / base_tps
            if mode.startswith("spec"):
                for k in ("acceptance_rate", "expected_acceptance_ours", "expected_acceptance_token_matching"):
                    vals = [r[k] for r in rs if r.get(k) is not None]
                    row[k] = statistics.fmean(vals) if vals else None
            summary.append(row)
    result = dict(machine=dict(platform=platform.platform(), processor=platform.processor(), cpus=os.cpu_count(), threads=th),
                  target=str(target), draft=str(draft), max_tokens=a.max_tokens, runs=runs, summary=summary)
    text = json.dumps(result, indent=2)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text)
    print(json.dumps(summary, indent=2))
    plain.close()
    spec.close()


if __name__ == "__main__":
    main()
