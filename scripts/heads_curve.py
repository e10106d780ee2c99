"""Learning curve of heads: held-out τ (greedy chain of K, best-first trees) against training tokens. JSON.

    OPENBLAS_NUM_THREADS=2 PYTHONPATH=$PWD python scripts/heads_curve.py MODEL --tokens 2500,10000,30000,60000 \
        --json docs/bench-heads-curve-MODEL.json

Every point is ``train_heads(MODEL, tokens=N)`` into a scratch folder (the recorded answers are shared:
the first N tokens of them, so the points differ only in how much data the fit saw), then τ on the
held-out answers recorded by ``scripts/record_heads.py MODEL --part heldout`` (prompts never used in
training, nor close to any prompt the target wrote itself), next to n-gram on the same answers.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from ondevice.bench.tools import emit_json
from ondevice.drafters.heads import HeadsDrafter
from ondevice.heads import data, fit, store
from ondevice.heads.train import train_heads
from ondevice.store import catalog, lookup

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_heads import ngram_tau  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--tokens", default="2500,10000,30000,60000")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--rank", type=int, default=256)
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--tree-nodes", default="4,8")
    ap.add_argument("--store", action="store_true", help="store the last point's heads for the model (the default heads file)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    path = lookup.resolve(a.model)
    work = catalog.home() / "heads" / "work" / store.target_sha256(path)[:16]
    recs = [data.load_record(p) for p in sorted((work / "heldout").glob("rec-*.npz"))]
    if not recs:
        raise SystemExit(f"no held-out answers in {work / 'heldout'}: run scripts/record_heads.py {a.model} --part heldout")
    points = []
    sizes = [int(x) for x in a.tokens.split(",")]
    for n in sizes:
        with tempfile.TemporaryDirectory() as out:
            t0 = time.perf_counter()
            last = a.store and n == sizes[-1]
            r = train_heads(path, tokens=n, out=None if last else out, vocab=a.vocab, rank=a.rank, epochs=a.epochs, quiet=True)
            heads, meta = store.load(r["path"], path)
        inv = heads.index(int(meta["target_vocab_size"]))
        row = {"tokens": n, "training_tokens": meta["training_tokens"], "fit_seconds": meta["fit_seconds"],
               "wall_seconds": round(time.perf_counter() - t0, 1), "classes": {}}
        for cls in sorted({x.cls for x in recs}) + ["all"]:
            sub = [x for x in recs if cls in ("all", x.cls)]
            flat = fit.Flat.of(sub)
            ans = np.concatenate([x.tokens[1:] for x in sub])
            row["classes"][cls] = {
                "chain": fit.offline_tau(hits := fit.chain_hits(heads, flat, inv), flat)["tau"],
                "chain_with_copies": fit.offline_tau_copy(hits, flat, sub, heads.K, HeadsDrafter.COPY_MIN)["tau"],
                **{f"tree_{t}": fit.offline_tau(fit.tree_hits(heads, flat, inv, int(t)), flat)["tau"]
                   for t in a.tree_nodes.split(",")},
                "ngram": ngram_tau(sub, heads.K)["tau"],
                "draft_vocab_coverage": round(float(np.mean(np.isin(ans, heads.vocab))), 4)}
        points.append(row)
        print(row, flush=True)
        emit_json({"model": path.name, "vocab": a.vocab, "rank": a.rank, "epochs": a.epochs, "K": heads.K,
                   "heldout_answers": len(recs), "points": points}, a.json, indent=1)


if __name__ == "__main__":
    main()
