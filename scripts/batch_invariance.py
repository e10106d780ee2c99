"""Where is llama.cpp batch-invariant on this machine? A row's logits computed inside a batch of k rows against the
same row from single-token decodes, by batch size, context length, thread count and kernel set. JSON.

    PYTHONPATH=$PWD python scripts/batch_invariance.py MODEL [--contexts 200 600] [--threads 1 2] [--json OUT]

Kernel sets: "default" (llama.cpp's own choice: the REPACK kernels where the CPU has them) and "plain"
(``use_extra_bufts=False``: no repacked weight buffers), each in a fresh child process (llama.cpp reads the model
parameters at load). Greedy speculative decoding equals plain decoding token for token only where every verify
batch shape it uses reads max |Δ| = 0 here (``ondevice.bench.ties`` explains the flips elsewhere).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import numpy as np

SIZES = (1, 2, 4, 6, 7, 8, 12, 16, 32)


def measure(path: str, kernels: str, n_pre: int, threads: int) -> dict:
    """max |logit(row in a batch of k) − logit(same row, single decodes)| for each k in SIZES."""
    import llama_cpp

    from ondevice.backends.llama import LlamaBackend
    from ondevice.backends.llama_ext import without_extra_bufts

    if kernels == "plain":
        llama_cpp.llama_model_default_params = without_extra_bufts(llama_cpp.llama_model_default_params)
    b = LlamaBackend(path, n_ctx=max(1024, n_pre + 64), threads=threads)
    try:
        text = " ".join(f"def f{i}(x):\n    return x * {i} + {i * i}\n" for i in range(400))
        ids = b.tokenize(text)[: n_pre + max(SIZES)]
        if len(ids) < n_pre + max(SIZES):
            raise SystemExit(f"the probe text is only {len(ids)} tokens")
        head, tail = ids[:n_pre], ids[n_pre:]
        b.eval(head)
        single = np.array([b.eval([t])[-1] for t in tail])
        out = {}
        for k in SIZES:
            b.rollback(n_pre + len(tail) - k)
            got = b.eval(tail[-k:])
            out[str(k)] = round(float(np.abs(got - single[-k:]).max()), 4)
        return out
    finally:
        b.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--contexts", type=int, nargs="+", default=[200, 600])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--kernels", nargs="+", default=["default", "plain"])
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", nargs=3, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    from ondevice.store import lookup

    path = lookup.resolve(a.model)
    path = str(path / "model.gguf" if path.is_dir() else path)
    if a.child:
        print(json.dumps(measure(path, a.child[0], int(a.child[1]), int(a.child[2]))))
        return
    import llama_cpp

    rows = []
    for kernels in a.kernels:
        for n_pre in a.contexts:
            for threads in a.threads:
                got = subprocess.run([sys.executable, __file__, a.model, "--child", kernels, str(n_pre), str(threads)],
                                     capture_output=True, text=True, check=True)
                rows.append({"kernels": kernels, "context": n_pre, "threads": threads,
                             "max_abs_logit_diff_by_batch": json.loads(got.stdout.strip().splitlines()[-1])})
                print(json.dumps(rows[-1]), file=sys.stderr)
    from ondevice.bench.tools import emit_json

    emit_json({"model": path, "system_info": llama_cpp.llama_print_system_info().decode(), "rows": rows}, a.json)


if __name__ == "__main__":
    main()
