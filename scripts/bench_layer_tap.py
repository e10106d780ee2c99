"""What reading a qwen2 target's layer inputs through ``LlamaBackend``'s cb_eval tap costs: one decode (a token
after a 64-token context) and a 64-token prefill, with the tap taking 3 layers, with an idle tap (installed, no
layers: llama.cpp still asks it about every node), and without one. Passes alternate between the backends (the
machine's load hits each alike); medians and their ratios, as JSON.

    python scripts/bench_layer_tap.py ~/.cache/ondevice/models/qwen2.5-coder-0.5b-instruct/*.gguf --reps 15

Measured here (2 shared CPU cores, 1 thread): decode 34 ms, the tap ×1.05, an idle tap ×1.03 (822 callbacks per
decode, ~1.2 µs each); 64-token prefill 545 ms, the tap ×1.01, idle ×1.00.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np


def main() -> None:
    from ondevice.backends.llama import LlamaBackend

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("target", type=Path)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    kinds = ("plain", "idle_tap", "tap")
    bs = {k: LlamaBackend(args.target, n_ctx=512, threads=args.threads, n_batch=64) for k in kinds}
    n_layer = int(bs["tap"]._lib.llama_model_n_layer(bs["tap"]._model))
    ids = [2, n_layer // 2, n_layer - 3]  # EAGLE-3's usual low / middle / high layers
    bs["tap"].enable_layer_inputs(ids)
    bs["idle_tap"].enable_layer_inputs(ids)
    bs["idle_tap"].enable_layer_inputs([])
    bs["idle_tap"]._layer_ids = None  # no rows read: only llama.cpp's questions to the callback remain
    toks = [int(t) for t in np.random.default_rng(0).integers(100, 20000, size=65)]

    def prefill(b):
        b.rollback(0)
        b.eval(toks[:64], "last")

    def decode(b):
        b.rollback(64)
        b.eval(toks[64:65], "all")

    out = {"target": args.target.name, "layer_ids": ids, "threads": args.threads, "reps": args.reps}
    for name, f in (("prefill64", prefill), ("decode", decode)):
        for b in bs.values():
            prefill(b)
            f(b)  # warm
        t = {k: [] for k in kinds}
        for r in range(args.reps):
            for k in kinds if r % 2 else kinds[::-1]:  # alternate the order: neither side always goes first
                t0 = time.perf_counter()
                f(bs[k])
                t[k].append(time.perf_counter() - t0)
        med = {k: float(np.median(v)) for k, v in t.items()}
        paired = {k: float(np.median(np.array(t[k]) / np.array(t["plain"]))) for k in kinds}  # median of per-rep ratios
        out[name] = {**{f"{k}_ms": round(v * 1e3, 2) for k, v in med.items()},
                     "tap_ratio": round(paired["tap"], 3), "idle_tap_ratio": round(paired["idle_tap"], 3)}
    for b in bs.values():
        b.close()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
