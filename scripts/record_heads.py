"""Record self-distillation answers (with hidden states) for ``train_heads`` and held-out answers for the bench.

    PYTHONPATH=$PWD python scripts/record_heads.py MODEL --tokens N [--heldout-max 128] [--threads 1]

Training answers go where ``ondevice.heads.train.train_heads(MODEL, tokens=N)`` looks for them (so it
resumes from them); held-out answers (prompts never used in training) go to ``<work>/heldout``.
Both are resumable: finished answers are kept, the next run starts at the first missing one.
"""

from __future__ import annotations

import argparse
import json
import time

from ondevice.heads import data, store
from ondevice.heads.train import DEFAULTS
from ondevice.loader import load
from ondevice.store import catalog, lookup


def heldout_prompts() -> list[tuple[str, str]]:
    """(class, text) of the held-out prompts, classes interleaved (any prefix is balanced)."""
    h = data.load_prompts()["heldout"]
    return [(c, h[c][i]) for i in range(max(map(len, h.values()))) for c in sorted(h) if i < len(h[c])]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=10000)
    ap.add_argument("--heldout-max", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--part", choices=("train", "heldout", "both"), default="both")
    a = ap.parse_args()
    path = lookup.resolve(a.model)
    work = catalog.home() / "heads" / "work" / store.target_sha256(path)[:16]
    out = {}
    with load(path, drafter="none", n_ctx=1024, threads=a.threads) as rt:
        for name, prompts, budget, max_new in (
            ("train", data.train_prompts(), a.tokens, DEFAULTS["max_new"]),
            ("heldout", heldout_prompts(), 10**9, a.heldout_max),
        ):
            if a.part not in (name, "both"):
                continue
            t0 = time.perf_counter()
            recs = data.collect(rt, prompts, work / ("records" if name == "train" else "heldout"), budget=budget, max_new=max_new,
                                on_record=lambda total, new, name=name: print(f"{name}: {total} tokens ({time.strftime('%H:%M:%S')})", flush=True))
            out[name] = {"answers": len(recs), "tokens": int(sum(len(r.hidden) for r in recs)),
                         "seconds": round(time.perf_counter() - t0, 1)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
