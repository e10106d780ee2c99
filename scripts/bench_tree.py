"""Tree verification, measured side by side in one run (JSON on stdout).

1. Cost, after a 64-token prefix, in units of one single-token decode (median and min of --repeats, the variants
   interleaved so that load drifts hit them alike): a chain of n tokens (``eval``), a tree pass of n nodes
   (``eval_tree`` + ``keep_path`` of the first branch, and of another branch, which re-lays the cache).
2. τ (tokens per target pass), greedy, on prompts of scripts/prompts (chat template applied): plain
   decoding, the n-gram chain at fixed γ (``speculative.steps``) and the n-gram tree (``speculative.steps(trees=True)``,
   ≤ --nodes drafted nodes). Every run must emit plain decoding's tokens (checked; a mismatch is reported).

    PYTHONPATH=$PWD python scripts/bench_tree.py smollm2-135m-instruct > docs/bench-tree-smollm2.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from ondevice.backends import open_backend
from ondevice.chat import render
from ondevice.drafters import NgramDrafter, TreeNgram
from ondevice.policy import FixedGamma
from ondevice.sampling import SamplingParams
from ondevice.speculative import steps
from ondevice.store import lookup
from ondevice.tree import Tree

PROMPTS = Path(__file__).resolve().parent / "prompts"
FILLER = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n" * 4


def tree_of(n: int) -> list[int]:
    """Parents of an n-node tree shaped like an n-gram tree: a first branch of depth ≤ 4 from the root, the
    other nodes as second branches hanging off the root and the first branch's nodes."""
    first = min(n - 1, 4)
    parents = [-1] + list(range(first))
    at = 0
    while len(parents) < n:
        parents.append(at)
        at = (at + 1) % (first + 1)
    return parents


def costs(b, sizes: list[int], repeats: int) -> dict:
    ids = b.tokenize(FILLER)[:64]
    b.rollback(0)
    b.eval(ids)
    base = b.n_past
    toks = [int(t) for t in ids[1:33]]

    def decode():
        b.eval(toks[:1])
        b.rollback(base)

    def chain(n):
        b.eval(toks[:n])
        b.rollback(base)

    def tree(n, branch: bool):
        parents = tree_of(n)
        b.eval_tree(toks[:n], parents)
        last = n - 1 if branch else 0  # the last node sits on another branch: keeping it re-lays the cache
        b.keep_path(Tree(toks[:n], parents).path(last))
        b.rollback(base)

    runs = {"decode": decode}
    for n in sizes:
        runs[f"chain{n}"] = lambda n=n: chain(n)
        runs[f"tree{n}"] = lambda n=n: tree(n, False)
        runs[f"tree{n}_other_branch"] = lambda n=n: tree(n, True)
    for f in runs.values():
        f()  # warm up
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(repeats):
        for k, f in runs.items():
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    low = {k: min(v) for k, v in times.items()}  # the least disturbed run: robust when other jobs share the CPU
    d = med["decode"]
    return {"decode_seconds": d, "cost_in_decodes": {k: round(v / d, 3) for k, v in med.items()},
            "cost_in_decodes_min": {k: round(v / low["decode"], 3) for k, v in low.items()},
            "sizes": sizes, "tree_shapes": {n: tree_of(n) for n in sizes}, "repeats": repeats}


def run(b, ids: list[int], n_tokens: int, mode: str, gamma: int, nodes: int, depth: int) -> tuple[list[int], dict]:
    params = SamplingParams(temperature=0.0)
    b.rollback(0)
    b.eval(ids[:-1])
    ctx = list(ids)
    rng = np.random.default_rng(0)
    if mode == "tree":
        it = steps(b, TreeNgram(max_nodes=nodes, max_depth=depth), ctx, params, FixedGamma(nodes), rng, trees=True,
                   max_nodes=nodes)
    else:
        it = steps(b, NgramDrafter() if mode == "chain" else None, ctx, params, FixedGamma(gamma), rng)
    passes = accepted = drafted = 0
    t0 = time.perf_counter()
    while len(ctx) - len(ids) < n_tokens:
        s = next(it)
        passes, accepted, drafted = passes + 1, accepted + s.accepted, drafted + s.drafted
        if any(b.is_eog(t) for t in s.tokens):
            break
    out = ctx[len(ids) :]
    cut = next((i for i, t in enumerate(out) if b.is_eog(t)), len(out))
    out = out[: min(cut + 1, n_tokens)]
    return out, {"passes": passes, "tokens": len(ctx) - len(ids), "tau": (len(ctx) - len(ids)) / passes,
                 "drafted": drafted, "accepted": accepted, "seconds": time.perf_counter() - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default="smollm2-135m-instruct")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--per-class", type=int, default=3)
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--depths", default="3,4,6", help="tree depths to run (each with --nodes nodes)")
    ap.add_argument("--cost-only", action="store_true", help="measure the cost curve only (no τ runs)")
    a = ap.parse_args()
    path = lookup.resolve(a.model)
    b = open_backend(path, n_ctx=2048, threads=a.threads)
    report = {"model": a.model, "file": Path(path).name, "threads": a.threads, "machine": platform.machine(),
              "cost": costs(b, [2, 4, 8, 16], a.repeats)}
    print(json.dumps(report["cost"]["cost_in_decodes"]), file=sys.stderr)
    if a.cost_only:
        b.close()
        print(json.dumps(report, indent=1))
        return
    configs = {"plain": ("plain", 0, 0, 0), **{f"chain{g}": ("chain", g, 0, 0) for g in (3, 4, 8)},
               **{f"tree{a.nodes}_depth{d}": ("tree", 0, a.nodes, int(d)) for d in a.depths.split(",")}}
    rows = []
    for cls in ("code", "chat", "edit", "summary"):
        lines = (PROMPTS / f"{cls}.jsonl").read_text().splitlines()[: a.per_class]
        for line in lines:
            item = json.loads(line)
            text = render(b.chat_template, [{"role": "user", "content": item["prompt"]}])
            ids = b.tokenize(text, add_bos=True, special=True)
            row = {"id": item["id"], "class": cls, "prompt_tokens": len(ids)}
            ref = None
            for name, (mode, g, nodes, depth) in configs.items():
                out, st = run(b, ids, a.tokens, mode, g, nodes, depth)
                ref = out if ref is None else ref
                st["same_tokens_as_plain"] = out == ref
                row[name] = st
            rows.append(row)
            print(json.dumps({k: (v["tau"] if isinstance(v, dict) else v) for k, v in row.items()}), file=sys.stderr)
    summary = {}
    for cls in ("code", "chat", "edit", "summary", "all"):
        sel = [r for r in rows if cls in ("all", r["class"])]
        summary[cls] = {name: round(sum(r[name]["tokens"] for r in sel) / sum(r[name]["passes"] for r in sel), 3)
                        for name in configs}
        summary[cls]["seconds"] = {name: round(sum(r[name]["seconds"] for r in sel), 2) for name in configs}
    report["tau_by_class"] = summary
    report["all_outputs_equal_plain"] = all(r[n]["same_tokens_as_plain"] for r in rows for n in configs)
    report["prompts"] = rows
    b.close()
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
