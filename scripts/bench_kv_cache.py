"""KV-cache types and the disk prompt cache, measured (#40 items 2, 3). Prints one JSON object.

Per cache type (f16, q8_0, q4_0 for K and V): KV bytes per token (llama.cpp's serialised sequence state after
the prompt, divided by its tokens) and the cache for the whole context at that rate, prompt prefill speed,
single-token decode speed; then the first-token time of a long prompt cold (prefill) vs restored from the
prompt cache by a fresh backend (as after a restart), and the greedy tokens of both (equal: exact).

    python scripts/bench_kv_cache.py [--model smollm2-135m-instruct] [--prompt-tokens 1024] [--decode 32]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ondevice.backends.llama import KV_CACHE_TYPES, LlamaBackend  # noqa: E402
from ondevice.prompt_cache import PromptCache  # noqa: E402
from ondevice.store import lookup  # noqa: E402


def _prompt(backend, n: int) -> list[int]:
    """``n`` tokens of real prose (this repository's README, repeated if short)."""
    text = (ROOT / "README.md").read_text()
    ids = backend.tokenize(text)
    while len(ids) < n:
        ids += backend.tokenize(text, add_bos=False)
    return ids[:n]


def _greedy(backend, first_row, n: int) -> tuple[list[int], float]:
    out, row = [], first_row
    t0 = time.perf_counter()
    for _ in range(n):
        out.append(int(np.argmax(row)))
        row = backend.eval([out[-1]])[-1]
    return out, time.perf_counter() - t0


def bench_type(path, k, v, n_prompt, n_decode, n_ctx, threads) -> dict:
    b = LlamaBackend(path, n_ctx=n_ctx, threads=threads, cache_type_k=k, cache_type_v=v)
    try:
        ids = _prompt(b, n_prompt)
        t0 = time.perf_counter()
        first = b.eval(ids, logits="last")[-1]
        prefill = time.perf_counter() - t0
        state = len(b.save_seq_state())
        _, dt = _greedy(b, first, n_decode)
        return {"cache_type_k": k, "cache_type_v": v, "kv_bytes_per_token": round(state / len(ids), 1),
                "kv_mib_at_n_ctx": round(state / len(ids) * b.n_ctx / 2**20, 2), "n_ctx": b.n_ctx,
                "prefill_tok_s": round(len(ids) / prefill, 1), "decode_tok_s": round(n_decode / dt, 1)}
    finally:
        b.close()


def bench_restore(path, k, v, n_prompt, n_decode, n_ctx, threads) -> dict:
    """First-token time cold vs from the disk cache, each in a backend that has seen nothing."""
    with tempfile.TemporaryDirectory() as d:
        b = LlamaBackend(path, n_ctx=n_ctx, threads=threads, cache_type_k=k, cache_type_v=v)
        try:
            ids = _prompt(b, n_prompt)
            t0 = time.perf_counter()
            b.eval(ids[:-1], logits="last")
            first = b.eval(ids[-1:])[-1]
            cold = time.perf_counter() - t0
            cold_tokens, _ = _greedy(b, first, n_decode)
            b.rollback(len(ids) - 1)
            t0 = time.perf_counter()
            PromptCache(d, b).store(ids[:-1])
            store_s = time.perf_counter() - t0
        finally:
            b.close()
        b = LlamaBackend(path, n_ctx=n_ctx, threads=threads, cache_type_k=k, cache_type_v=v)
        try:
            t0 = time.perf_counter()
            cache = PromptCache(d, b)  # the model's sha256 is memoised in the folder by the store above
            n, restore = cache.lookup(ids)
            restored = restore() if restore else 0
            first = b.eval(ids[restored:])[-1]
            warm = time.perf_counter() - t0
            warm_tokens, _ = _greedy(b, first, n_decode)
            file_bytes = cache.size_bytes()
        finally:
            b.close()
    return {"cache_type_k": k, "cache_type_v": v, "prompt_tokens": len(ids), "cached_tokens": restored,
            "first_token_cold_s": round(cold, 3), "first_token_restored_s": round(warm, 3),
            "ratio": round(warm / cold, 3), "store_s": round(store_s, 3), "file_mib": round(file_bytes / 2**20, 2),
            "same_greedy_tokens": warm_tokens == cold_tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="catalog name or GGUF path")
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--decode", type=int, default=32, help="greedy tokens timed per type")
    ap.add_argument("--n-ctx", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--types", default="f16,q8_0,q4_0", help=f"comma-separated, from {', '.join(KV_CACHE_TYPES)}")
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    a = ap.parse_args()
    path = lookup.resolve(a.model)
    if path.is_dir():
        path = path / "model.gguf"
    types = [t.strip() for t in a.types.split(",") if t.strip()]
    args = (a.prompt_tokens, a.decode, a.n_ctx, a.threads)
    result = {"model": str(path), "prompt_tokens": a.prompt_tokens,
              "types": [bench_type(path, t, t, *args) for t in types],
              "prompt_cache": [bench_restore(path, t, t, *args) for t in types]}
    text = json.dumps(result, indent=2)
    print(text)
    if a.out:
        a.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
