"""Shape-true random-weight models (``ondevice bench --synthetic``): build one as GGUF, measure its draft cost
ratio c and verify curve cost(k) on this machine, and print the speedups they *predict* for a range of
acceptance rates (a way to judge a machine where no real model can be brought)."""

from __future__ import annotations

import time
from pathlib import Path

from ondevice.errors import OndeviceError

# Shape-true configs (weights random): for measuring c and cost(k) where no real model can be brought.
SYNTHETIC = {
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1024, tie_word_embeddings=True),
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
}


def synthetic_gguf(name: str, out_dir: Path, quant: str = "q4_k_m") -> Path:
    """Build (once) a random-weight GGUF with the shapes of ``name``; returns its path."""
    from converters import convert
    from ondevice.testing import make_tiny_hf

    if name not in SYNTHETIC:
        raise OndeviceError(f"--synthetic {name}: unknown; choose one of {', '.join(SYNTHETIC)}")
    final = out_dir / f"{name}-{quant}" / "model.gguf"
    if final.is_file():
        return final
    hf = out_dir / f"{name}-hf"
    if not (hf / "model.safetensors").is_file():
        cfg = dict(SYNTHETIC[name])
        vocab = cfg.pop("vocab_size")
        make_tiny_hf(hf, "qwen2", vocab_size=vocab, tokenizer_vocab=512, n_layers=cfg.pop("num_hidden_layers"),
                     tie_word_embeddings=cfg.pop("tie_word_embeddings"), **cfg)
    convert(hf, to="gguf", out=final.parent, quant=quant, progress=False, verify=False)  # timing-only weights
    return final


def synthetic_costs(config: str, *, draft_config: str | None = None, threads: int | None = None, device: str | None = None,
                    alphas=(0.5, 0.7, 0.8, 0.9, 0.95), cache_dir: Path | None = None) -> dict:
    """Costs (c, cost(k)) on shape-true random-weight models, and the speedups they *predict*.

    Acceptance does not depend on the hardware: combine these costs with α measured on real
    models (``alphas``) to predict the speedup on this machine. Labelled as a prediction.
    """
    from ondevice.backends import open_backend
    from ondevice.bench.run import machine
    from ondevice.costs import measure, speedup_bound
    from ondevice.store import catalog

    cache_dir = cache_dir or catalog.home() / "synthetic"
    t0 = time.perf_counter()
    target_path = synthetic_gguf(config, cache_dir)
    draft_path = synthetic_gguf(draft_config, cache_dir) if draft_config else None
    build = time.perf_counter() - t0
    target = open_backend(target_path, n_ctx=1024, threads=threads, device=device)
    draft = open_backend(draft_path, n_ctx=1024, threads=threads, device=device) if draft_path else None
    costs = measure(target, draft, ks=tuple(range(1, 17)))
    target.close()
    if draft:
        draft.close()
    c = costs.draft_cost_ratio if draft else 0.0
    predictions = []
    for a in alphas:
        by_gamma = {g: speedup_bound(a, g, c, costs.verify_cost(g + 1)) for g in range(1, 17)}
        best = max(by_gamma, key=by_gamma.get)
        predictions.append({"alpha": a, "best_gamma": best, "predicted_speedup": by_gamma[best],
                            "predicted_speedup_by_gamma": {str(g): v for g, v in by_gamma.items()}})
    return {"machine": machine(), "synthetic": {"target": config, "draft": draft_config, "device": device or "default",
            "build_seconds": build}, "costs": costs.to_json(), "prediction": predictions,
            "note": "speedups are predictions from measured costs and assumed acceptance, not measurements"}
