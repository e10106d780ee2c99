"""What a DFlash block pass costs against a target decode, on shape-true random weights (docs/mtp.md).

Needs the Qwen3.5-0.8B-shaped target of scripts/bench_mtp.py. Writes a DFlash draft sharing the target's
embeddings and LM head (as published drafts do), hidden 1024, ``--layers`` Qwen3 layers, reading the inputs
of target layers 2, 12, 21, quantized like the target, and times (1 thread, interleaved, median, wall and
CPU): the target decode of 1 token, the draft's block pass drafting k tokens, and its injection of k + 1
verified positions.

    PYTHONPATH=$PWD python scripts/bench_dflash.py --target /tmp/mtp-bench/qwen35-24x1024-v248320-q8_0.gguf
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def main() -> None:
    import llama_cpp

    from ondevice.backends.llama_dflash import DFlashDrafter
    from ondevice.backends.llama_mtp_target import MtpTarget
    from ondevice.testing.dflash import make_tiny_dflash_gguf
    from ondevice.testing.mtp import QWEN35_08B

    ap = argparse.ArgumentParser()
    ap.add_argument("--target", type=Path, required=True)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--reps", type=int, default=9)
    a = ap.parse_args()

    f32 = a.target.parent / f"dflash-{a.layers}l-b{a.block}-f32.gguf"
    q8 = a.target.parent / f"dflash-{a.layers}l-b{a.block}-q8_0.gguf"
    if not q8.exists():
        make_tiny_dflash_gguf(f32, target=QWEN35_08B, target_layers=(2, 12, 21), n_layer=a.layers, n_embd=1024,
                              n_ff=3584, n_head=8, n_head_kv=2, head_dim=128, block_size=a.block, own_head=False)
        p = llama_cpp.llama_model_quantize_default_params()
        p.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0
        if llama_cpp.llama_model_quantize(str(f32).encode(), str(q8).encode(), p) != 0:
            raise SystemExit("quantizing the DFlash draft failed")
    t = MtpTarget(a.target, n_ctx=4096, threads=1, n_batch=64, nextn=False)
    d = DFlashDrafter(q8, t._model, t._ctx, n_ctx=4096, threads=1, n_batch=64)
    try:
        prompt = [(7 * i + 3) % 500 + 10 for i in range(64)]
        t.eval(prompt)
        d.observe(d.features(len(prompt)), 0)

        times: dict[str, list[tuple[float, float]]] = {}

        def timed(name, fn):
            w, c = time.perf_counter(), time.process_time()
            out = fn()
            times.setdefault(name, []).append(((time.perf_counter() - w) * 1e3, (time.process_time() - c) * 1e3))
            return out

        for _ in range(a.reps):  # every case once per repetition, interleaved
            pos0 = t.n_past
            timed("decode", lambda: t.eval([11]))
            timed("inject1", lambda pos0=pos0: d.observe(d.features(1), pos0))
            feats = d.features(1).repeat(4, axis=0)
            timed("inject4", lambda feats=feats: d.observe(feats, d.n_past - 4))  # rewrites the last 4
            timed("block3", lambda: d.draft(11, 3))
            timed(f"block{a.block - 1}", lambda: d.draft(11, a.block - 1))
        res = {"layers": a.layers, "block": a.block, "reps": a.reps,
               "draft_mb": round(q8.stat().st_size / 2**20)}
        for j, kind in ((0, "wall"), (1, "cpu")):
            ms = {k: statistics.median(x[j] for x in v) for k, v in times.items()}
            base = ms["decode"]
            res[kind] = {"ms": {k: round(v, 2) for k, v in ms.items()},
                         "block3_over_decode": round(ms["block3"] / base, 3),
                         f"block{a.block - 1}_over_decode": round(ms[f"block{a.block - 1}"] / base, 3),
                         "inject1_over_decode": round(ms["inject1"] / base, 3),
                         "inject4_over_decode": round(ms["inject4"] / base, 3)}
        print(json.dumps(res, indent=1))
    finally:
        d.close()
        t.close()


if __name__ == "__main__":
    main()
