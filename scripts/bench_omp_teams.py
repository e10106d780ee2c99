"""Why one llama.cpp decode path can be 0.6× or 10× another in the same process on Linux: libgomp's spin policy.

llama.cpp's CPU backend (built with OpenMP on Linux; macOS builds use ggml's own thread pool) synchronises its
threads with OpenMP barriers. libgomp lets a waiting thread spin ~300k iterations (≈ 3 ms) before sleeping — but
only while it manages no more threads than there are CPUs; past that ("throttled") it spins 100. Every thread that
has run a multi-threaded decode keeps an OpenMP team, so a process whose decodes ran on two threads (a load or
probe on one, a server or ``BatchEngine`` worker on another) is throttled: on an idle machine each barrier then
sleeps and wakes (the engine's lone request measured 0.61× of a single-team process); on a loaded machine the
unthrottled spin is what collapses (spinning threads take the CPU their preempted partner needs).

Side by side in one process: one-token decodes on the main thread (2 threads) with a second thread's team alive,
and the same after that thread released its team (``omp_pause_resource_all``), i.e. one team; the load average is
given with each row. JSON.

    python scripts/bench_omp_teams.py [--model smollm2-135m-instruct] [--rounds 3] [--tokens 24]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import threading
import time

import ondevice
from ondevice.store import lookup

PROMPT = "Write a long story about a dragon who learns to bake bread. Once upon a time"


def _timed(rt, tokens: int, reps: int = 2) -> float:
    ts = []
    for _ in range(reps):
        rt.reset()
        t0 = time.perf_counter()
        rt.generate(PROMPT, max_tokens=tokens, temperature=0)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=24)
    a = ap.parse_args(argv)
    try:
        gomp = ctypes.CDLL("libgomp.so.1")
    except OSError:
        print(json.dumps({"skipped": "no libgomp here (llama.cpp without OpenMP: nothing to measure)"}))
        return 0
    path = lookup.resolve(a.model)
    rows = []
    with ondevice.load(path, drafter="none", n_ctx=512, threads=2) as rt, \
            ondevice.load(path, drafter="none", n_ctx=512, threads=2) as other_rt:
        rt.generate(PROMPT, max_tokens=4, temperature=0)  # the main thread's team
        for _ in range(a.rounds):
            row = {"load_average": round(os.getloadavg()[0], 2)}
            for label, pause in (("two_teams_seconds", False), ("one_team_seconds", True)):
                ready, stop = threading.Event(), threading.Event()

                def other(pause: bool = pause, ready=ready, stop=stop) -> None:
                    other_rt.generate(PROMPT, max_tokens=2, temperature=0)  # a team of its own
                    if pause:
                        gomp.omp_pause_resource_all(2)  # omp_pause_hard: this thread's team is freed
                    ready.set()
                    stop.wait()

                t = threading.Thread(target=other)
                t.start()
                ready.wait()
                row[label] = round(_timed(rt, a.tokens), 3)
                stop.set()
                t.join()
            row["one_over_two"] = round(row["one_team_seconds"] / row["two_teams_seconds"], 3)
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    print(json.dumps({"model": path.name, "tokens": a.tokens, "threads": 2, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
