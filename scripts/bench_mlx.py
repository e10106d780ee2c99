"""MLX benchmark: our MLX backend vs mlx_lm.generate on the same model, MLX vs GGUF, and a
cross-backend pair (GGUF target + MLX draft). Interleaved repeats; one JSON on stdout.

    python scripts/bench_mlx.py --mlx DIR --gguf FILE [--pair-target GGUF --pair-draft MLXDIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import ondevice

PROMPT = "<|im_start|>user\nWrite a Python function that returns the n-th Fibonacci number.<|im_end|>\n<|im_start|>assistant\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mlx", required=True, help="MLX model directory")
    ap.add_argument("--gguf", required=True, help="the same model as GGUF")
    ap.add_argument("--pair-target", default=None)
    ap.add_argument("--pair-draft", default=None)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--gamma", type=int, default=4)
    a = ap.parse_args()

    from mlx_lm import load, stream_generate
    from mlx_lm.sample_utils import make_sampler

    model, tok = load(a.mlx)
    ours_mlx = ondevice.load(a.mlx, drafter="none")
    ours_gguf = ondevice.load(a.gguf, drafter="none")
    runs = []
    for rep in range(a.repeats):
        t0 = time.perf_counter()
        n = 0
        for resp in stream_generate(model, tok, PROMPT, max_tokens=a.max_tokens, sampler=make_sampler(0.0)):
            n = resp.generation_tokens
        runs.append(dict(mode="mlx_lm.stream_generate", repeat=rep, tokens=n, tokens_per_second=n / (time.perf_counter() - t0)))
        for name, rt in (("ondevice_mlx_plain", ours_mlx), ("ondevice_gguf_plain", ours_gguf)):
            rt.reset()
            r = rt.generate(PROMPT, max_tokens=a.max_tokens, temperature=0, gamma=0)
            runs.append(dict(mode=name, repeat=rep, tokens=r.stats.tokens, tokens_per_second=r.stats.tokens_per_second))
        print(json.dumps(runs[-3:]), file=sys.stderr)
    if a.pair_target and a.pair_draft:
        plain = ondevice.load(a.pair_target, drafter="none")
        pair = ondevice.load(a.pair_target, a.pair_draft)
        for rep in range(a.repeats):
            plain.reset()
            r = plain.generate(PROMPT, max_tokens=a.max_tokens, temperature=0, gamma=0)
            runs.append(dict(mode="pair_target_plain", repeat=rep, tokens=r.stats.tokens, tokens_per_second=r.stats.tokens_per_second))
            pair.reset()
            r = pair.generate(PROMPT, max_tokens=a.max_tokens, temperature=0, gamma=a.gamma)
            runs.append(dict(mode=f"pair_gguf_target_mlx_draft_gamma{a.gamma}", repeat=rep, tokens=r.stats.tokens,
                             tokens_per_second=r.stats.tokens_per_second, acceptance_rate=r.stats.acceptance_rate,
                             mean_accepted_per_forward=r.stats.mean_accepted_per_forward))
            print(json.dumps(runs[-2:]), file=sys.stderr)
    modes = list(dict.fromkeys(r["mode"] for r in runs))
    med = {m: statistics.median(r["tokens_per_second"] for r in runs if r["mode"] == m) for m in modes}
    summary = {m: {"median_tokens_per_second": v} for m, v in med.items()}
    summary["ratio_ondevice_mlx_vs_mlx_lm"] = med["ondevice_mlx_plain"] / med["mlx_lm.stream_generate"]
    summary["ratio_mlx_vs_gguf"] = med["ondevice_mlx_plain"] / med["ondevice_gguf_plain"]
    for m in modes:
        acc = [r["acceptance_rate"] for r in runs if r["mode"] == m and "acceptance_rate" in r]
        if acc:
            summary[m]["acceptance_rate"] = statistics.fmean(acc)
            summary[m]["speedup_vs_target_plain"] = med[m] / med["pair_target_plain"]
    print(json.dumps({"runs": runs, "summary": summary}, indent=2))


if __name__ == "__main__":
    main()
