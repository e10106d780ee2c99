"""Thread-count benchmark: decode speed per ``--threads`` value, idle and with competing CPU-bound processes.

Loads one runtime per thread count in one process (plain decoding, greedy, 32 tokens as
``generate --no-spec --max-tokens 32``) and interleaves them round by round, with and without
``--competitors`` processes running ``while True: pass``, so every ratio is side by side in one run.
Records the load average before each round (the machines this runs on are shared).

    python scripts/bench_threads.py --model smollm2-135m-instruct --rounds 5 --out docs/bench-threads-smollm2.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import ondevice
from ondevice.store import lookup
from ondevice.threads import default_threads, physical_cores, usable_cpus

PROMPT = "<|im_start|>user\nWrite a short poem about the sea.<|im_end|>\n<|im_start|>assistant\n"


def _spin(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-P", "-c", "while True: pass"]) for _ in range(n)]


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
        p.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--competitors", type=int, default=1, help="CPU-bound processes in the busy condition")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()

    cores = usable_cpus()
    counts = sorted({1, max(1, cores - 1), max(1, cores // 2), physical_cores(), cores})
    path = lookup.resolve(a.model) if not os.path.exists(a.model) else a.model
    runtimes = {n: ondevice.load(path, drafter="none", threads=n, n_ctx=512) for n in counts}
    rows: list[dict] = []
    for r in range(a.rounds):
        for cond in ("idle", "busy"):
            procs = _spin(a.competitors) if cond == "busy" else []
            try:
                time.sleep(1.0)  # let the competitors reach the run queue
                load = os.getloadavg()[0]
                default = default_threads()  # what a model loaded now would get
                order = counts if r % 2 == 0 else counts[::-1]
                for n in order:
                    rt = runtimes[n]
                    rt.reset()
                    res = rt.generate(PROMPT, max_tokens=a.max_tokens, temperature=0.0, gamma=0)
                    s = res.stats
                    rows.append({"round": r, "condition": cond, "threads": n, "is_default": n == default,
                                 "tokens": s.tokens, "decode_tok_s": s.tokens_per_second, "loadavg_1m": load})
                    print(f"round {r} {cond:4} threads={n}{'*' if n == default else ' '}: "
                          f"{s.tokens_per_second:6.1f} tok/s (load {load:.1f})", flush=True)
            finally:
                _stop(procs)
        _write(a, path, cores, counts, rows)  # after every round: an interrupted run keeps what it measured
    for rt in runtimes.values():
        rt.close()
    print(json.dumps(_write(a, path, cores, counts, rows)["summary"], indent=2))


def _write(a, path, cores: int, counts: list[int], rows: list[dict]) -> dict:
    summary: dict = {}
    for cond in ("idle", "busy"):
        cr = [x for x in rows if x["condition"] == cond]
        med = {n: statistics.median(v) for n in counts if (v := [x["decode_tok_s"] for x in cr if x["threads"] == n])}
        dflt = [x["decode_tok_s"] for x in cr if x["is_default"]]
        if not med or not dflt:
            continue
        best = max(med.values())
        summary[cond] = {"median_tok_s": med, "best_threads": max(med, key=med.get),
                         "default_median_tok_s": statistics.median(dflt),
                         "default_threads_chosen": sorted({x["threads"] for x in cr if x["is_default"]}),
                         "default_to_best": statistics.median(dflt) / best,
                         "ratio_to_best": {n: v / best for n, v in med.items()}}
    out = {"model": a.model, "path": str(path), "cores": cores, "physical_cores": physical_cores(),
           "machine": platform.platform(), "python": platform.python_version(), "competitors": a.competitors,
           "max_tokens": a.max_tokens, "rows": rows, "summary": summary,
           "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=2)
    return out


if __name__ == "__main__":
    main()
