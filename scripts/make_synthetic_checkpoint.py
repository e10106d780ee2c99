"""Write a shape-true random-weight llama-layout HF checkpoint of any size, with bounded memory.

    python scripts/make_synthetic_checkpoint.py OUT_DIR [--params 0.75] [--tokenizer-vocab 512]

The tokenizer (a real byte-level BPE trained by ``ondevice.testing``, SmolLM2's family) and
tokenizer_config.json come from the tiny-model factory; the weights are f16 safetensors written one
tensor at a time (a 7B checkpoint needs no more memory than its largest tensor). Shapes for ``--params``:
hidden 1536, 12 heads of 128, 4 KV heads, MLP 4096, vocabulary 32768 (tied), and as many layers as the
parameter count asks (0.75 → 28 layers, 755M parameters, 1.51 GB).
"""

from __future__ import annotations

import argparse
import json
import shutil
import struct
import tempfile
import zlib
from pathlib import Path

import numpy as np


def shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """HF tensor name → shape for a llama config (tied embeddings: no lm_head)."""
    h, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = h // cfg["num_attention_heads"]
    qd, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = (h,)
        for name, shape in (("self_attn.q_proj", (qd, h)), ("self_attn.k_proj", (kv, h)), ("self_attn.v_proj", (kv, h)),
                            ("self_attn.o_proj", (h, qd)), ("mlp.gate_proj", (f, h)), ("mlp.up_proj", (f, h)),
                            ("mlp.down_proj", (h, f))):
            out[p + name + ".weight"] = shape
        out[p + "post_attention_layernorm.weight"] = (h,)
    out["model.norm.weight"] = (h,)
    if not cfg.get("tie_word_embeddings", True):
        out["lm_head.weight"] = (v, h)
    return out


def draw(name: str, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """One tensor: norms near 1, the embedding at 0.02, linear layers at 1/sqrt(fan-in) (stable activations)."""
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    if len(shape) == 1:
        return (1.0 + 0.05 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float16)
    scale = 0.02 if "embed" in name else 1.0 / np.sqrt(shape[1])
    return (rng.standard_normal(shape, dtype=np.float32) * scale).astype(np.float16)


def write_safetensors(path: Path, cfg: dict, seed: int) -> int:
    """Stream the tensors into ``path`` (header first, then one tensor at a time); returns the byte size."""
    table = shapes(cfg)
    header, offset = {}, 0
    for name, shape in table.items():
        n = int(np.prod(shape)) * 2
        header[name] = {"dtype": "F16", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    header["__metadata__"] = {"format": "pt"}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for name, shape in table.items():
            f.write(draw(name, shape, seed).tobytes())
    return path.stat().st_size


def config_for(params_b: float, vocab: int = 32768) -> dict:
    """A llama config with about ``params_b`` billion parameters (layers chosen to fit)."""
    h, f = 1536, 4096
    per_layer = 2 * h * h + 2 * (h // 3) * h + 3 * h * f + 2 * h
    layers = max(1, round((params_b * 1e9 - vocab * h) / per_layer))
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": h, "intermediate_size": f,
            "num_hidden_layers": layers, "num_attention_heads": 12, "num_key_value_heads": 4, "vocab_size": vocab,
            "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "hidden_act": "silu",
            "tie_word_embeddings": True, "torch_dtype": "float16"}


def make(out: Path, params_b: float = 0.75, tokenizer_vocab: int = 512, seed: int = 0, vocab: int = 32768) -> dict:
    """Write the checkpoint into a new ``out``; returns its config plus ``n_params`` and ``f16_bytes``."""
    from ondevice.testing import make_tiny_hf

    out.mkdir(parents=True, exist_ok=False)
    with tempfile.TemporaryDirectory() as tmp:  # the tokenizer files of the factory (weights tiny, thrown away)
        tiny = make_tiny_hf(Path(tmp) / "t", "llama", n_layers=1, vocab_size=vocab, tokenizer_vocab=tokenizer_vocab)
        for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            shutil.copy2(tiny / name, out / name)
        special = json.loads((tiny / "config.json").read_text())
    cfg = config_for(params_b, vocab)
    cfg.update(bos_token_id=special["bos_token_id"], eos_token_id=special["eos_token_id"])
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    size = write_safetensors(out / "model.safetensors", cfg, seed)
    n_params = sum(int(np.prod(s)) for s in shapes(cfg).values())
    return {**cfg, "n_params": n_params, "f16_bytes": size}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--params", type=float, default=0.75, help="billions of parameters (default 0.75)")
    ap.add_argument("--tokenizer-vocab", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=32768, help="embedding rows (the token list is padded)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    info = make(a.out, a.params, a.tokenizer_vocab, a.seed, a.vocab)
    print(json.dumps({k: info[k] for k in ("num_hidden_layers", "n_params", "f16_bytes")}))
