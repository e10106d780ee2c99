"""Continuous batching (``--parallel N``) against the same requests one after another, side by side in one run.

For each concurrency k (default 1, 2, 4): k greedy requests decoded together by a ``BatchEngine`` (a runtime
loaded with ``parallel=max k``), and the same k requests one after another on a usual runtime (no drafter:
both plain, so the comparison is batching alone; both with the same thread count). Reports aggregate tokens/s,
per-request latency and time to first token, whether every batched answer equals its one-at-a-time answer, and
the speed-up (the run with the median speed-up of ``--repeat``, the two modes alternated), with the load
average around each row.

Beside it, llama.cpp's raw ceiling measured in the same run (``raw``): ``--max-tokens`` decode steps of k rows
(k sequences, the batch's context) against k·max-tokens single-row decodes on the one-sequence runtime, no
Python between them but the loop; ``ideal_speedup`` adds the requests' measured prefill to both sides (the
batch prefills each prompt alone, as one after another does), and ``efficiency`` = speedup ÷ ideal_speedup is
what the engine's per-step Python and threads leave of it. JSON.

    python scripts/bench_parallel.py [--model smollm2-135m-instruct] [--max-tokens 64] [--ks 1,2,4] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import ondevice
from ondevice.batching import BatchEngine
from ondevice.store import lookup
from ondevice.threads import default_threads

PROMPTS = [  # prompts that keep going (no early end of generation): every request decodes max_tokens
    "1, 2, 3, 4, 5, 6, 7, 8,",
    "The alphabet, letter by letter: A, B, C, D,",
    "Write a long story about a dragon who learns to bake bread. Once upon a time",
    "List the months of the year, then the days of the week: January,",
    "Repeat after me forever: the quick brown fox jumps over the lazy dog. The quick brown fox",
    "Here are two hundred even numbers: 2, 4, 6, 8,",
    "A very long poem about the sea, verse after verse:\n",
    "Count from one to one hundred in words: one, two, three,",
]


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _row(results, wall: float) -> dict:
    tokens = sum(len(r[0]) for r in results)
    lat = [r[1] for r in results]
    ttft = [r[2] for r in results]
    return {"tokens": tokens, "seconds": round(wall, 3), "tokens_per_second": round(tokens / wall, 2),
            "latency_mean": round(statistics.mean(lat), 3), "latency_max": round(max(lat), 3),
            "ttft_mean": round(statistics.mean(ttft), 3)}


def one_after_another(rt, prompts, max_tokens: int):
    t0 = time.perf_counter()
    out = []
    for p in prompts:
        rt.reset()  # no prefix reused from an earlier request (a batch slot keeps none either)
        r = rt.generate(p, max_tokens=max_tokens, temperature=0)
        done = time.perf_counter() - t0  # a queued request's latency includes its wait
        out.append((r.tokens, done, done - r.stats.total_seconds + r.stats.time_to_first_token))
    return out, time.perf_counter() - t0


def batched(eng: BatchEngine, prompts, max_tokens: int):
    """Every request queued before the first batched step, each read by a client thread of its own."""
    import threading

    out: list = [None] * len(prompts)

    def client(i: int, s) -> None:
        first = None
        for c in s:
            if c.tokens and first is None:
                first = time.perf_counter() - t0
        out[i] = (s.tokens, time.perf_counter() - t0, first or 0.0)

    t0 = time.perf_counter()
    with eng.rt._lock:
        streams = [eng.stream(p, max_tokens=max_tokens, temperature=0) for p in prompts]
    threads = [threading.Thread(target=client, args=(i, s)) for i, s in enumerate(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out, time.perf_counter() - t0


def raw(rt, prt, prompts, k: int, steps: int) -> dict:
    """llama.cpp alone: ``steps`` decodes of k rows (one per sequence, on the batch's context) vs the same tokens
    as single-row decodes on the one-sequence runtime, and the prompts' prefill (seconds). Both runtimes are left
    empty."""
    t, u = prt.target, rt.target
    ids = [rt.tokenize(p) for p in prompts[:k]]
    with prt._lock, rt._lock:
        try:
            t.clear_seqs()
            t0 = time.perf_counter()
            for s, x in enumerate(ids):  # each prompt alone, as the batch prefills it
                t.eval_seqs([(s, p, tok) for p, tok in enumerate(x[:-1])], outputs=[False] * (len(x) - 1))
            prefill = time.perf_counter() - t0
            t0 = time.perf_counter()
            for i in range(steps):
                t.eval_seqs([(s, len(x) - 1 + i, x[-1]) for s, x in enumerate(ids)])
            batch = time.perf_counter() - t0
            single = 0.0
            for x in ids:
                u.rollback(0)
                u.eval(x[:-1], logits="last")
                t0 = time.perf_counter()
                for _ in range(steps):
                    u.eval(x[-1:])
                single += time.perf_counter() - t0
        finally:
            t.clear_seqs()
            u.rollback(0)
    rt.reset()
    prt.reset()
    return {"batch_seconds": batch, "single_seconds": single, "prefill_seconds": prefill}


def _raw_row(runs: list[dict]) -> dict:
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    return {**{k: round(v, 4) for k, v in med.items()},
            "raw_ratio": round(med["single_seconds"] / med["batch_seconds"], 3),
            "ideal_speedup": round((med["prefill_seconds"] + med["single_seconds"])
                                   / (med["prefill_seconds"] + med["batch_seconds"]), 3)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--ks", default="1,2,4")
    ap.add_argument("--n-ctx", type=int, default=512)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeat", type=int, default=5, help="runs per concurrency (the median speed-up is reported)")
    ap.add_argument("--json", default=None, help="also write the report here")
    a = ap.parse_args(argv)
    ks = [int(k) for k in a.ks.split(",")]
    if max(ks) > len(PROMPTS):
        ap.error(f"--ks: at most {len(PROMPTS)} concurrent requests")
    path = lookup.resolve(a.model)
    rows = []
    threads = a.threads or default_threads()  # one count for both runtimes (each would pick its own at load)
    # one after another runs on a thread of its own, as a server's requests do; with llama.cpp's OpenMP (Linux) a
    # thread frees its team when its request ends (ondevice.threads.release_omp_team), so neither side decodes
    # beside the other's idle team, which makes libgomp stop spinning (scripts/bench_spin.py)
    with ondevice.load(path, drafter="none", n_ctx=a.n_ctx, threads=threads) as rt, \
            ondevice.load(path, drafter="none", n_ctx=a.n_ctx, threads=threads, parallel=max(max(ks), 2)) as prt, \
            ThreadPoolExecutor(1, thread_name_prefix="one-after-another") as alone:
        eng = BatchEngine(prt)
        alone.submit(rt.generate, PROMPTS[0], max_tokens=4, temperature=0).result()  # warm-up
        eng.generate(PROMPTS[0], max_tokens=4, temperature=0)
        for k in ks:
            runs, raws, load = [], [], [_load()]
            for _ in range(a.repeat):  # alternated, so a change in the machine's load hits both alike
                serial = alone.submit(one_after_another, rt, PROMPTS[:k], a.max_tokens).result()
                prt.reset()  # no prefix kept from the previous round (sequences keep theirs otherwise)
                runs.append((serial, batched(eng, PROMPTS[:k], a.max_tokens)))
                raws.append(raw(rt, prt, PROMPTS, k, a.max_tokens))
            load.append(_load())
            (s_res, s_wall), (res, wall) = sorted(runs, key=lambda r: r[0][1] / r[1][1])[len(runs) // 2]
            b, s, r = _row(res, wall), _row(s_res, s_wall), _raw_row(raws)
            speedup = round(b["tokens_per_second"] / s["tokens_per_second"], 3)
            rows.append({"concurrent": k, "batched": b, "one_after_another": s, "speedup": speedup,
                         "speedups": sorted(round(x[0][1] / x[1][1], 3) for x in runs), "raw": r,
                         "efficiency": round(speedup / r["ideal_speedup"], 3), "load_average": load,
                         "answers_equal": all([x[0] for x in q[1][0]] == [x[0] for x in q[0][0]] for q in runs)})
    report = {"model": str(path.name), "max_tokens": a.max_tokens, "threads": [rt.target.threads, prt.target.threads],
              "repeat": a.repeat, "rows": rows}
    text = json.dumps(report, indent=2)
    print(text)
    if a.json:
        from ondevice.atomic import write_text

        write_text(a.json, text + "\n")
    return 0 if all(r["answers_equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
