"""What a conversion wrote, read back one tensor at a time as float32 under HF names, and how far each
tensor is from the source's.

A quantized output cannot match its float source's logits to 2 % (that is what quantizing means), so
its verification splits in two checks that can each be tight:

- every written tensor, dequantized (ggml's own ``to_float``: ``converters.dequant``; ``mx.dequantize``) and put back in HF
  layout, is within its type's rounding error of the same source tensor (a swapped, transposed,
  unpermuted or offset tensor is off by ~100 %, quantization by a few %): ``TensorCheck``;
- the runtime's logits match a float32 forward pass *on those written weights* (what the file says the
  model is), so names, layouts and hyperparameters are checked without quantization noise.

Every reader here returns a ``converters.lazy.LazyWeights``: a tensor is read from the memory-mapped
file, dequantized and handed over when asked for, and not kept, so a check holds one tensor at a time
whatever the model's size.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from converters.lazy import LazyWeights, SafetensorsMap, as_float32
from ondevice.errors import OndeviceError, shown

# bits of a GGUF tensor type (the rounding bound below depends only on this)
GGUF_BITS = {"F32": 32, "F16": 16, "BF16": 16, "Q8_0": 8, "Q8_K": 8, "Q6_K": 6, "Q5_0": 5, "Q5_1": 5, "Q5_K": 5,
             "Q4_0": 4, "Q4_1": 4, "Q4_K": 4, "IQ4_NL": 4, "IQ4_XS": 4, "Q3_K": 3, "Q2_K": 2}
# bits → largest allowed ‖written − source‖ / ‖source‖ per tensor (blockwise rounding of real or random
# weights stays well inside; a wrong tensor is off by ~1.0–1.4)
WEIGHT_BOUND = {32: 1e-3, 16: 5e-3, 8: 0.02, 6: 0.06, 5: 0.12, 4: 0.25, 3: 0.45, 2: 0.8}


def gguf_written(path: Path, ckpt) -> tuple[LazyWeights, dict[str, int]]:
    """A written GGUF's tensors, lazily, as float32 in HF names and layout, and each one's bits."""
    import gguf

    from converters.archs import arch_of, from_gguf_layout, gguf_names
    from converters.dequant import dequantize

    arch = arch_of(ckpt.config, ckpt.path / "config.json")
    inverse = {g: h for h, g in gguf_names(ckpt, arch).items()}
    tensors, bits = {}, {}
    for t in gguf.GGUFReader(str(path)).tensors:  # memory-mapped: t.data is a view of the file
        hf = inverse.get(t.name)
        if hf is None:
            raise OndeviceError(f"{shown(path)}: tensor {t.name} was not written from any source tensor")
        tensors[hf] = t
        bits[hf] = GGUF_BITS.get(t.tensor_type.name, 4)

    def load(name: str) -> np.ndarray:
        t = tensors[name]
        arr = dequantize(t.data, t.tensor_type).reshape([int(d) for d in reversed(t.shape)])
        return from_gguf_layout(ckpt.config, arch, t.name, arr)

    return LazyWeights(list(tensors), load), bits


def gguf_source(g) -> LazyWeights:
    """A GGUF source's tensors (``ondevice.formats.gguf.GGUFFile``), lazily, dequantized to float32
    in HF names and layout (``float_tensors``, one at a time)."""
    from converters.dequant import dequantize
    from ondevice.formats.gguf import hf_name, llama_permuted_heads, unpermute_rows

    cfg = g.config()
    tensors = {hf_name(t.name, g.arch): t for t in g.reader.tensors}

    def load(name: str) -> np.ndarray:
        t = tensors[name]
        arr = dequantize(t.data, t.tensor_type).reshape([int(d) for d in reversed(t.shape)])
        heads = llama_permuted_heads(g, t.name, cfg)
        return unpermute_rows(arr, heads) if heads else arr

    return LazyWeights(list(tensors), load)


def mlx_written(directory: Path) -> tuple[LazyWeights, dict[str, int]]:
    """A written mlx-lm directory's tensors, lazily, as float32 (quantized ones dequantized by
    ``mx.dequantize``, one tensor at a time), and each one's bits."""
    q = json.loads((directory / "config.json").read_text()).get("quantization") or {}
    st = SafetensorsMap(sorted(directory.glob("*.safetensors")))
    names = [n for n in st.names() if not n.endswith((".scales", ".biases"))]
    bits, spec = {}, {}
    for name in names:
        base = name[: -len(".weight")]
        if f"{base}.scales" in st:
            per = q.get(base) if isinstance(q.get(base), dict) else q
            spec[name] = (int(per["bits"]), int(per["group_size"]))
            bits[name] = spec[name][0]
        else:
            bits[name] = 32 if st.dtype(name) == "F32" else 16

    def load(name: str) -> np.ndarray:
        if name not in spec:
            return st.float32(name)
        import mlx.core as mx

        base = name[: -len(".weight")]
        b, gs = spec[name]
        scales, biases = (mx.array(st.float32(f"{base}.{k}")) for k in ("scales", "biases"))
        w = mx.dequantize(mx.array(np.asarray(st.raw(name))), scales, biases, group_size=gs, bits=b)
        return np.array(w.astype(mx.float32))

    return LazyWeights(names, load), bits


def tensor_error(name: str, got: np.ndarray, src: np.ndarray, bits: int, where: Path | str) -> float:
    """‖got − src‖ / ‖src‖ for one tensor; raise (one line) when it is not the source's tensor."""
    if got.shape != src.shape:
        raise OndeviceError(f"{shown(where)}: verification failed: tensor {name} has shape {list(got.shape)} in the output "
                            f"but {list(src.shape)} in the source; nothing was kept")
    rel = float(np.linalg.norm(got - src) / max(float(np.linalg.norm(src)), 1e-12))
    bound = WEIGHT_BOUND[min(WEIGHT_BOUND, key=lambda b: abs(b - bits))]
    if not rel <= bound:  # NaN fails too
        raise OndeviceError(
            f"{shown(where)}: verification failed: tensor {name} differs from the source by {rel:.1%} "
            f"(a {bits}-bit tensor may differ by at most {bound:.1%}); the converter wrote a wrong tensor, "
            "nothing was kept"
        )
    return rel


class TensorCheck:
    """Compares written tensors with the source's one at a time, as they are read.

    Hooked into a ``LazyWeights`` (``on_load``), it checks each tensor the forward pass reads against the
    same source tensor, once; ``finish`` checks those the pass never read and every source tensor that
    was not written at all.

    Args:
        source: the source's ``LazyWeights`` (HF names, float32).
        bits: written name → bits (``gguf_written`` / ``mlx_written``).
        where: the output directory named in errors.
    """

    def __init__(self, source: LazyWeights, bits: dict[str, int], where: Path | str) -> None:
        self.source, self.bits, self.where = source, bits, where
        self.done: dict[str, float] = {}

    def __call__(self, name: str, got: np.ndarray) -> None:
        if name in self.done:
            return
        if name not in self.source:
            raise OndeviceError(f"{shown(self.where)}: tensor {name} was written but the source has no such tensor")
        self.done[name] = tensor_error(name, got, self.source[name], self.bits[name], self.where)

    def finish(self, written: LazyWeights) -> dict:
        """Check the tensors not yet compared; returns {"max_weight_rel_error", "worst_tensor", "tensors"}."""
        for name in self.source:
            if name not in written:
                raise OndeviceError(f"{shown(self.where)}: verification failed: source tensor {name} is missing from the "
                                    "output; nothing was kept")
            if name not in self.done:
                self(name, written[name])
        worst = max(self.done, key=self.done.get) if self.done else None
        return {"max_weight_rel_error": round(self.done[worst], 5) if worst else 0.0, "worst_tensor": worst,
                "tensors": len(self.done)}


__all__ = ["GGUF_BITS", "WEIGHT_BOUND", "TensorCheck", "as_float32", "gguf_source", "gguf_written", "mlx_written",
           "tensor_error"]
