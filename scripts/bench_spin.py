"""libgomp spin policies side by side: one-token decode speed idle and with busy CPUs, for choosing ondevice's default.

llama.cpp's CPU backend on Linux synchronises its threads with OpenMP barriers, and libgomp's wait policy
(``GOMP_SPINCOUNT``, ``OMP_WAIT_POLICY``) is read once, when the library loads — so each policy runs in a
process of its own. Each child loads the model with 2 threads and times plain greedy decodes in the two shapes
a process takes: decoding on the thread that loaded the model and on a second thread afterwards, as ``serve``
does. A thread that decoded keeps an OpenMP team; with two teams on 2 CPUs libgomp throttles its spin to 100
whatever the count, which ``keep_teams`` shows (ondevice as it was before it freed a thread's team at the end of
its request: ``ondevice.threads.release_omp_team``). ``--busy`` runs that many spinning processes beside the child (another app, a build)
— the case where a long spin collapses: a spinning thread holds the CPU its preempted partner needs.

Policies alternate within each round; the median seconds per token and each policy's ratio to libgomp's default
(in the same condition) are reported. JSON.

    python scripts/bench_spin.py [--model smollm2-135m-instruct] [--busy 0,1] [--rounds 3] [--tokens 48]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

PROMPT = "Write a long story about a dragon who learns to bake bread. Once upon a time"
# label -> environment; "default" is libgomp's own, which ondevice keeps (300k spins ≈ 3 ms when not throttled)
POLICIES = {
    "default": {},
    "spin30000": {"GOMP_SPINCOUNT": "30000"},
    "spin3000": {"GOMP_SPINCOUNT": "3000"},
    "spin300": {"GOMP_SPINCOUNT": "300"},
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
    # ondevice before it freed a thread's team when the thread's request ended (release_omp_team a no-op)
    "keep_teams": {"BENCH_SPIN_KEEP_TEAMS": "1"},
}
OMP_VARS = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY", "BENCH_SPIN_KEEP_TEAMS")


def _child(model: str, tokens: int) -> None:
    import ondevice
    from ondevice.store import lookup

    if os.environ.get("BENCH_SPIN_KEEP_TEAMS"):
        import ondevice.runtime

        ondevice.runtime.release_omp_team = lambda: None
    with ondevice.load(lookup.resolve(model), drafter="none", n_ctx=512, threads=2) as rt:
        def timed() -> float:
            rt.reset()
            out = rt.generate(PROMPT, max_tokens=tokens, temperature=0)
            return 1.0 / out.stats.decode_tokens_per_second  # seconds per decoded token, the prompt's prefill apart

        timed()  # warm: the main thread's team
        row = {"main_thread": min(timed() for _ in range(2))}
        box: list[float] = []
        t = threading.Thread(target=lambda: box.extend([timed(), timed(), timed()]))
        t.start()
        t.join()
        row["worker_thread"] = min(box[1:])  # the first builds the worker's team
    print(json.dumps(row))


def _busy(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--busy", default="0,1", help="busy processes beside the child, per condition")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--json", default=None, help="also write the report here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        _child(a.model, a.tokens)
        return 0
    labels = a.policies.split(",")
    base = {k: v for k, v in os.environ.items() if k not in OMP_VARS}
    report = {"model": a.model, "tokens": a.tokens, "threads": 2, "cpus": os.cpu_count(), "conditions": []}
    for busy in (int(b) for b in a.busy.split(",")):
        samples: dict[str, list[dict]] = {p: [] for p in labels}
        loads = []
        hogs = _busy(busy)
        try:
            time.sleep(1.0)
            for _ in range(a.rounds):
                for p in labels:
                    loads.append(os.getloadavg()[0])
                    out = subprocess.run(
                        [sys.executable, __file__, "--child", "--model", a.model, "--tokens", str(a.tokens)],
                        env={**base, **POLICIES[p]}, capture_output=True, text=True, check=True)
                    samples[p].append(json.loads(out.stdout.strip().splitlines()[-1]))
                    print(json.dumps({"busy": busy, "policy": p, **samples[p][-1]}), file=sys.stderr, flush=True)
        finally:
            for h in hogs:
                h.kill()
                h.wait()
        rows = {}
        for p in labels:
            rows[p] = {k: round(statistics.median(s[k] for s in samples[p]) * 1000, 2) for k in ("main_thread", "worker_thread")}
        for p in labels:
            for k in ("main_thread", "worker_thread"):
                rows[p][f"{k}_vs_default"] = round(rows[p][k] / rows["default"][k], 3) if "default" in rows else None
        report["conditions"].append({"busy_processes": busy, "load_average": [round(min(loads), 2), round(max(loads), 2)],
                                     "ms_per_token": rows})
    text = json.dumps(report, indent=2)
    print(text)
    if a.json:
        with open(a.json + ".tmp", "w") as f:
            f.write(text)
        os.replace(a.json + ".tmp", a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
