"""Post-processing cost of one verification, after the target has evaluated k tokens.

Evaluates k = 32 tokens once, then times, for k = 1, 4, 16, 32 rows, greedy and sampled:
``verify_logits`` (what the loop runs) against the dense path (``probs_batch`` + one-hot q + ``verify``,
what it runs for an observer), or against ``--baseline-ref``'s sampling.py (e.g. main). Drafts are the
target's own greedy choices, so greedy examines every row (the lazy path's worst case);
both answers must agree.

    python scripts/bench_verify.py qwen2.5-coder-1.5b-instruct:iq4_nl --baseline-ref main
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from ondevice import sampling
from ondevice.backends import open_backend
from ondevice.sampling import SamplingParams, verify_logits
from ondevice.store import lookup

TEXT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n    if n < 2:\n        return n\n' * 3


def _baseline(ref: str | None):
    """The sampling module at git ``ref`` (None: this checkout's)."""
    if ref is None:
        return sampling
    src = subprocess.run(["git", "show", f"{ref}:ondevice/sampling.py"], capture_output=True, text=True, check=True).stdout
    path = Path(tempfile.mkdtemp()) / "baseline_sampling.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("baseline_sampling", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--baseline-ref", default=None, help="git ref whose sampling.py is the baseline (default: dense path)")
    ap.add_argument("--penalty", type=float, default=1.0, help="repetition penalty")
    a = ap.parse_args()
    base = _baseline(a.baseline_ref)
    b = open_backend(lookup.resolve(a.model), n_ctx=512, threads=a.threads)
    ids = b.tokenize(TEXT)[:64]
    b.eval(ids[:-1])
    t0 = time.perf_counter()
    logits = b.eval(ids[-1:] + ids[:31])  # [32, V]
    print(f"V={logits.shape[1]}, eval of 32 tokens {time.perf_counter() - t0:.3f} s", file=sys.stderr)
    ctx = list(ids)

    def dense(draft, rows, params, rng):
        p = base.probs_batch(rows, params, ctx, draft)
        q = np.zeros((len(draft), rows.shape[1]))
        q[np.arange(len(draft)), draft] = 1.0
        return base.verify(draft, q, p, rng)

    def lazy(draft, rows, params, rng):
        return verify_logits(draft, None, rows, params, ctx, rng)

    greedy = SamplingParams(temperature=0, repetition_penalty=a.penalty)
    for name, params in (("greedy", greedy), ("T=0.7", SamplingParams(temperature=0.7, repetition_penalty=a.penalty))):
        for k in (1, 4, 16, 32):
            rows, draft = logits[:k], []
            for i in range(k - 1):
                draft.append(int(np.argmax(sampling.probs(rows[i], greedy, ctx + draft))))
            ms, out = {}, {}
            for _ in range(3 if k >= 16 else 10):  # interleaved
                for label, f in (("baseline", dense), ("verify_logits", lazy)):
                    t = time.perf_counter()
                    out[label] = f(draft, rows, params, np.random.default_rng(0))
                    ms.setdefault(label, []).append((time.perf_counter() - t) * 1e3)
            assert out["baseline"] == out["verify_logits"], out
            o, n = statistics.median(ms["baseline"]), statistics.median(ms["verify_logits"])
            print(f"{name:6s} k={k:2d}: baseline {o:7.2f} ms  verify_logits {n:6.2f} ms  (x{o / n:.0f})")
    b.close()


if __name__ == "__main__":
    main()
