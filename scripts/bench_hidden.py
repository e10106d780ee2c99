"""What returning hidden states costs a llama.cpp decode: the same passes with and without, interleaved. JSON.

    PYTHONPATH=$PWD python scripts/bench_hidden.py MODEL [--rounds 4] [--n 12] [--threads 1] [--json OUT]

Each round times ``n`` single-token decodes and ``n`` verify passes of 4 tokens (all rows' logits, as
the speculative loop asks) with hidden states off, then the same with them on (``enable_hidden``), on
the same cache positions; the medians over rounds and their ratio (on ÷ off) are reported.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from ondevice.backends.llama import LlamaBackend
from ondevice.bench.tools import emit_json
from ondevice.store import lookup

PROMPT = "Write a Python function that checks whether a string is a palindrome, with a docstring and tests."


def _time(b: LlamaBackend, base: int, toks: list[int], width: int, n: int) -> float:
    """Median seconds of ``n`` passes of ``width`` tokens, each at position ``base`` (rolled back after)."""
    ts = []
    for i in range(n):
        b.rollback(base)
        t0 = time.perf_counter()
        b.eval(toks[i : i + width], logits="all")
        ts.append(time.perf_counter() - t0)
    b.rollback(base)
    return float(np.median(ts))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--n", type=int, default=12)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    path = lookup.resolve(a.model)
    b = LlamaBackend(path, n_ctx=512, threads=a.threads)
    try:
        ids = b.tokenize(PROMPT)
        b.eval(ids, logits="last")
        base = b.n_past
        toks = [int(t) for t in b.tokenize(" def is_palindrome(s: str) -> bool:\n    return s == s[::-1]\n" * 2, add_bos=False)]
        rows = {"decode": {"off": [], "on": []}, "verify4": {"off": [], "on": []}}
        for _ in range(a.rounds):
            for mode in ("off", "on"):
                if mode == "on":
                    b.enable_hidden()
                else:
                    b._set_emb(False)  # the bench toggles llama.cpp's flag directly, on the same context
                    b._hidden_on = False
                rows["decode"][mode].append(_time(b, base, toks, 1, a.n))
                rows["verify4"][mode].append(_time(b, base, toks, 4, a.n))
        out = {"model": path.name, "threads": a.threads, "rounds": a.rounds, "passes_per_round": a.n}
        for k, v in rows.items():
            off, on = float(np.median(v["off"])), float(np.median(v["on"]))
            out[k] = {"off_ms": round(off * 1e3, 2), "on_ms": round(on * 1e3, 2), "ratio_on_off": round(on / off, 3),
                      "per_round_ratio": [round(x / y, 3) for x, y in zip(v["on"], v["off"], strict=True)]}
    finally:
        b.close()
    emit_json(out, a.json, indent=1)


if __name__ == "__main__":
    main()
