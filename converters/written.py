"""What a conversion wrote, read back as float32 weights under HF names, and how far each is from the source.

A quantized output cannot match its float source's logits to 2 % (that is what quantizing means), so
its verification splits in two checks that can each be tight:

- every written tensor, dequantized (``gguf.dequantize`` / ``mx.dequantize``) and put back in HF
  layout, is within its type's rounding error of the same source tensor (a swapped, transposed,
  unpermuted or offset tensor is off by ~100 %, quantization by a few %);
- the runtime's logits match mlx-lm's float32 forward pass *on those written weights* (what the file
  says the model is), so names, layouts and hyperparameters are checked without quantization noise.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ondevice.errors import OndeviceError

# bits of a GGUF tensor type (the rounding bound below depends only on this)
GGUF_BITS = {"F32": 32, "F16": 16, "BF16": 16, "Q8_0": 8, "Q8_K": 8, "Q6_K": 6, "Q5_0": 5, "Q5_1": 5, "Q5_K": 5,
             "Q4_0": 4, "Q4_1": 4, "Q4_K": 4, "IQ4_NL": 4, "IQ4_XS": 4, "Q3_K": 3, "Q2_K": 2}
# bits → largest allowed ‖written − source‖ / ‖source‖ per tensor (blockwise rounding of real or random
# weights stays well inside; a wrong tensor is off by ~1.0–1.4)
WEIGHT_BOUND = {32: 1e-3, 16: 5e-3, 8: 0.02, 6: 0.06, 5: 0.12, 4: 0.25, 3: 0.45, 2: 0.8}


def gguf_written(path: Path, ckpt) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """A written GGUF's tensors as float32 in HF names and layout, and each one's bits."""
    import gguf

    from converters.archs import arch_of, from_gguf_layout, gguf_names

    arch = arch_of(ckpt.config, ckpt.path / "config.json")
    inverse = {g: h for h, g in gguf_names(ckpt, arch).items()}
    weights, bits = {}, {}
    for t in gguf.GGUFReader(str(path)).tensors:
        hf = inverse.get(t.name)
        if hf is None:
            raise OndeviceError(f"{path}: tensor {t.name} was not written from any source tensor")
        arr = np.asarray(gguf.dequantize(t.data, t.tensor_type), np.float32).reshape([int(d) for d in reversed(t.shape)])
        weights[hf] = from_gguf_layout(ckpt.config, arch, t.name, arr)
        bits[hf] = GGUF_BITS.get(t.tensor_type.name, 4)
    return weights, bits


def mlx_written(directory: Path) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """A written mlx-lm directory's tensors as float32 (quantized ones dequantized), and each one's bits."""
    import mlx.core as mx

    q = json.loads((directory / "config.json").read_text()).get("quantization") or {}
    arrays: dict = {}
    for f in sorted(directory.glob("*.safetensors")):
        arrays.update(mx.load(str(f)))
    weights, bits = {}, {}
    for name, a in arrays.items():
        if name.endswith((".scales", ".biases")):
            continue
        base = name[: -len(".weight")]
        if f"{base}.scales" in arrays:
            per = q.get(base) if isinstance(q.get(base), dict) else q
            b, gs = int(per["bits"]), int(per["group_size"])
            a = mx.dequantize(a, arrays[f"{base}.scales"], arrays[f"{base}.biases"], group_size=gs, bits=b)
            bits[name] = b
        else:
            bits[name] = 32 if a.dtype == mx.float32 else 16
        weights[name] = np.array(a.astype(mx.float32))
    return weights, bits


def weight_errors(written: dict[str, np.ndarray], bits: dict[str, int], source, where: Path | str) -> dict:
    """Compare each written tensor with its source tensor; raise naming the first one off by more than its
    type's rounding bound, or a source tensor that was not written at all.

    Args:
        written, bits: from ``gguf_written`` / ``mlx_written``.
        source: (HF name, array) pairs of the source (``HFCheckpoint.tensors()``, ``gguf_reader.float_tensors``).
    Returns:
        {"max_weight_rel_error", "worst_tensor", "tensors"} for the record.
    """
    worst, worst_name = 0.0, None
    n = 0
    for name, src in source:
        if name.endswith("rotary_emb.inv_freq"):
            continue
        if name not in written:
            raise OndeviceError(f"{where}: verification failed: source tensor {name} is missing from the output; "
                                "nothing was kept")
        src = np.asarray(src, np.float32)
        got = written[name]
        if got.shape != src.shape:
            raise OndeviceError(f"{where}: verification failed: tensor {name} has shape {list(got.shape)} in the output "
                                f"but {list(src.shape)} in the source; nothing was kept")
        rel = float(np.linalg.norm(got - src) / max(np.linalg.norm(src), 1e-12))
        bound = WEIGHT_BOUND[min(WEIGHT_BOUND, key=lambda b: abs(b - bits[name]))]
        if rel > bound:
            raise OndeviceError(
                f"{where}: verification failed: tensor {name} differs from the source by {rel:.1%} "
                f"(a {bits[name]}-bit tensor may differ by at most {bound:.1%}); the converter wrote a wrong tensor, "
                "nothing was kept"
            )
        if rel >= worst:
            worst, worst_name = rel, name
        n += 1
    return {"max_weight_rel_error": round(worst, 5), "worst_tensor": worst_name, "tensors": n}
