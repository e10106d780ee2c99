"""What a model's own MTP head costs on this machine, on shape-true random weights (docs/mtp.md).

Writes a qwen35 target with one MTP block (default: Qwen3.5-0.8B's shape, or ``--scale`` it down), quantizes
it (default Q8_0), and times with llama.cpp, one thread count:

- d = one MTP draft step ÷ one target decode (the drafter's cost per drafted token);
- the verify-pass overhead of MTP: a target pass over k + 1 tokens with the h rows on, plus the head's
  ``observe`` of those k + 1 tokens, against the same pass with them off.

    PYTHONPATH=$PWD python scripts/bench_mtp.py --out /tmp/mtp-bench [--scale 0.5] [--quant q8_0] [--k 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path


def _quantize(src: Path, dst: Path, quant: str, threads: int) -> Path:
    import llama_cpp

    if quant == "f16":
        return src
    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype = {"q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0, "q4_k_m": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M}[quant]
    p.nthread = threads
    if llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), p) != 0:
        raise SystemExit(f"quantizing {src} to {quant} failed")
    return dst


def _timed(fn) -> tuple[float, float]:
    """(wall ms, CPU ms of this process: every thread) of one call. On a shared machine the CPU time is the
    steadier measure of work; the wall time is what a user waits on a quiet one."""
    w, c = time.perf_counter(), time.process_time()
    fn()
    return (time.perf_counter() - w) * 1e3, (time.process_time() - c) * 1e3


def main() -> None:
    from ondevice.backends.llama_mtp_target import MtpTarget
    from ondevice.testing.mtp import QWEN35_08B, make_tiny_mtp_gguf

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("/tmp/mtp-bench"))
    ap.add_argument("--scale", type=float, default=1.0, help="scale n_layer, n_embd, n_ff (vocabulary kept)")
    ap.add_argument("--quant", default="q8_0", choices=("f16", "q8_0", "q4_k_m"))
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()

    s = QWEN35_08B
    if a.scale != 1.0:
        f = a.scale
        s = replace(s, n_layer=max(4, int(round(s.n_layer * f / 4)) * 4), n_embd=int(s.n_embd * f) // 64 * 64,
                    n_ff=int(s.n_ff * f) // 64 * 64)
    tag = f"qwen35-{s.n_layer}x{s.n_embd}-v{s.vocab_size}"
    src = a.out / f"{tag}-f16.gguf"
    if not src.exists():
        make_tiny_mtp_gguf(src, "qwen35", shape=s, dtype="f16")
    path = src if a.quant == "f16" else a.out / f"{tag}-{a.quant}.gguf"
    if not path.exists():
        _quantize(src, path, a.quant, a.threads)

    t = MtpTarget(path, n_ctx=4096, threads=a.threads, n_batch=64, n_rs_seq=a.k + 1)
    plain = MtpTarget(path, n_ctx=4096, threads=a.threads, n_batch=64, nextn=False)  # same weights (mmap)
    try:
        prompt = [(7 * i + 3) % 500 + 10 for i in range(64)]
        t.eval(prompt)
        plain.eval(prompt)
        block = [11, 12, 13, 14, 15, 16, 17, 18][: a.k + 1]
        # every condition once per repetition, interleaved, so load changes hit them alike; forward only
        # (the contexts grow by a few hundred positions)
        cases = {
            "draft_step": lambda: t.head.draft(block[0], 1, lambda q, d: 0),
            "draft_chain": lambda: t.head.draft(block[0], a.k, lambda q, d: 0),
            "decode_nextn": lambda: t.eval(block[:1]),  # with the h row out and the head's observe of it
            "decode": lambda: plain.eval(block[:1]),
            "verify_nextn": lambda: t.eval(block),  # k + 1 tokens, h rows out, observe of k + 1 pairs
            "verify": lambda: plain.eval(block),
        }
        times: dict[str, list[tuple[float, float]]] = {k: [] for k in cases}
        for _ in range(a.reps):
            for name, fn in cases.items():
                times[name].append(_timed(fn))
        res = {"shape": {"n_layer": s.n_layer, "n_embd": s.n_embd, "n_ff": s.n_ff, "vocab": s.vocab_size,
                         "heads": [s.n_head, s.n_head_kv, s.head_dim]},
               "quant": a.quant, "threads": a.threads, "k": a.k, "reps": a.reps,
               "file_mb": round(path.stat().st_size / 2**20)}
        for j, kind in ((0, "wall"), (1, "cpu")):
            ms = {name: statistics.median(x[j] for x in v) for name, v in times.items()}
            res[kind] = {
                "ms": {k: round(v, 2) for k, v in ms.items()},
                "d_step": round(ms["draft_step"] / ms["decode"], 3),
                "d_chain_per_token": round(ms["draft_chain"] / a.k / ms["decode"], 3),
                "verify_overhead": round(ms["verify_nextn"] / ms["verify"] - 1, 3),
                "decode_overhead": round(ms["decode_nextn"] / ms["decode"] - 1, 3),
            }
        print(json.dumps(res, indent=1))
    finally:
        t.close()
        plain.close()


if __name__ == "__main__":
    main()
