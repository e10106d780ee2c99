"""What one fit step of the EAGLE-style drafter costs on this machine at a target's shape (``train-heads``' JAX fit,
random weights and data of the right shapes): ms per training row, per configuration, and the hours an epoch
takes at a given number of rows. JSON.

    PYTHONPATH=$PWD python scripts/bench_eagle_fit.py MODEL [--vocab 4096,8192] [--depths 3,5] [--ffn-mult 1,3]
        [--rows 195000] [--window 256] [--batch-tokens 1024] [--json OUT]

MODEL: a GGUF (file, directory or catalog name) or an MLX model directory; only its config is read. Rows per
epoch: 150k answer tokens with their prompts make ~195k rows.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import numpy as np

from ondevice.bench.tools import emit_json


def _config(model: str) -> dict:
    from ondevice.backends import detect_format
    from ondevice.formats.gguf import GGUFFile
    from ondevice.heads import eagle_mlx
    from ondevice.store import lookup

    path = lookup.resolve(model)
    if detect_format(path) == "mlx":
        return eagle_mlx.config(path)
    return GGUFFile(path / "model.gguf" if path.is_dir() else path).config()


def step_ms_per_row(shape, depths: int, window: int, batch_tokens: int, reps: int = 3) -> float:
    """Best of ``reps`` jitted AdamW steps (after one to compile) ÷ rows, at one window length."""
    from ondevice.heads import eagle

    rng = np.random.default_rng(0)
    h, V = shape.hidden, shape.draft_vocab
    params = eagle.init(shape, (rng.standard_normal((V, h)) * 0.02).astype(np.float32), np.ones(h, np.float32), 0)
    opt = eagle.zeros_like(params)
    B = max(1, batch_tokens // window)
    step = eagle.make_step(shape, depths, window, lr=1e-3, warmup=10, total=100)
    batch = {"feats": rng.standard_normal((B, window, 3 * h)).astype(np.float32),
             "emb": rng.standard_normal((B, window, h)).astype(np.float32),
             "t_idx": rng.integers(0, V, (B, window, 8)).astype(np.int32),
             "t_pr": np.full((B, window, 8), 1 / 8, np.float32)}
    batch["valid"] = batch["t_pr"][..., 0] > 0
    params, opt, loss, _ = step(params, opt, batch, 0)
    float(loss)
    best = float("inf")
    for i in range(reps):
        t0 = time.perf_counter()
        params, opt, loss, _ = step(params, opt, batch, i + 1)
        float(loss)
        best = min(best, time.perf_counter() - t0)
    return 1e3 * best / (B * window)


def main() -> None:
    from ondevice.heads.eagle_train import shape_for

    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--vocab", default="4096,8192")
    ap.add_argument("--depths", default="3,5")
    ap.add_argument("--ffn-mult", default="1,3", help="MLP width ÷ hidden size (the default drafter: 3, or the target's)")
    ap.add_argument("--rows", type=int, default=195_000)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--batch-tokens", type=int, default=1024)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    cfg = _config(a.model)
    out = []
    for vocab in map(int, a.vocab.split(",")):
        base = shape_for(cfg, vocab)
        for mult in map(int, a.ffn_mult.split(",")):
            shape = dataclasses.replace(base, ffn=min(base.ffn, mult * base.hidden))
            for depths in map(int, a.depths.split(",")):
                ms = step_ms_per_row(shape, depths, a.window, a.batch_tokens)
                out.append({"vocab": vocab, "ffn": shape.ffn, "depths": depths, "ms_per_row": round(ms, 3),
                            "hours_per_epoch": round(ms * a.rows / 3.6e6, 3)})
                print(out[-1], flush=True)
    emit_json({"model": a.model, "hidden": base.hidden, "rows_per_epoch": a.rows, "window": a.window,
               "batch_tokens": a.batch_tokens, "configs": out}, a.json)


if __name__ == "__main__":
    main()
