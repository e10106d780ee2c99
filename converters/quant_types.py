"""GGUF tensor types and quantization formats: the names ``--quant`` / ``--output-type`` take, bits per weight,
which types each format's mixture uses on purpose, and reading a file's types back."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np

from ondevice.errors import OndeviceError

# --quant name → llama_ftype (llama.h). f16 is written directly by gguf, never by the quantizer.
FTYPES = {"f16": 1, "q8_0": 7, "q4_0": 2, "iq4_nl": 25, "q4_k_m": 15}
# a format name → the tensor type most of its weights get (q4_1 / q5_0: published files we only read)
MAIN_TYPE = {"f16": "F16", "q8_0": "Q8_0", "q4_0": "Q4_0", "iq4_nl": "IQ4_NL", "q4_k_m": "Q4_K", "q4_1": "Q4_1",
             "q5_0": "Q5_0"}
# Bits per weight of each GGML tensor type (block scales included).
TYPE_BITS = {"F32": 32.0, "F16": 16.0, "BF16": 16.0, "Q8_0": 8.5, "Q6_K": 6.5625, "Q5_1": 6.0, "Q5_0": 5.5,
             "Q5_K": 5.5, "Q4_1": 5.0, "Q4_0": 4.5, "IQ4_NL": 4.5, "Q4_K": 4.5, "IQ4_XS": 4.25, "Q3_K": 3.4375,
             "IQ3_S": 3.4375, "IQ3_XXS": 3.0625, "Q2_K": 2.625, "IQ2_XS": 2.3125, "IQ2_XXS": 2.0625,
             "IQ1_S": 1.5625}
# Nominal bits per weight of the main type of each --quant.
QUANT_BITS = {q: TYPE_BITS[MAIN_TYPE[q]] for q in FTYPES}
LOW_BIT = 6.0  # a source at or below this many bits per weight is "already low-bit"
# ggml tensor types that --output-type / --embedding-type take (llama_cpp.GGML_TYPE_<NAME>); the types below
# 4 bits that need an importance matrix, and the integer / intermediate types, are left out.
TENSOR_TYPES = ("f32", "f16", "bf16", "q8_0", "q6_k", "q5_k", "q5_1", "q5_0", "q4_k", "q4_1", "q4_0", "iq4_nl",
                "iq4_xs", "q3_k", "q2_k")

def check_tensor_types(quant: str, output_type: str | None, embedding_type: str | None) -> tuple[str | None, str | None]:
    """Validate ``--output-type`` / ``--embedding-type`` for ``--quant quant``; returns them lower-cased.

    Raises:
        OndeviceError (one line): an unknown type name (the accepted ones listed), or a type asked for a
            format llama.cpp's quantizer does not write (f16 is written directly, tensor by tensor).
    """
    out = []
    for flag, t in (("--output-type", output_type), ("--embedding-type", embedding_type)):
        if t is not None and t.lower() not in TENSOR_TYPES:
            raise OndeviceError(f"{flag} {t}: unknown tensor type; choose one of {', '.join(TENSOR_TYPES)}")
        out.append(t.lower() if t is not None else None)
    if any(out) and (quant not in FTYPES or quant == "f16"):
        raise OndeviceError(f"--output-type / --embedding-type need a quantized --quant "
                            f"({', '.join(q for q in FTYPES if q != 'f16')}), not {quant}")
    return out[0], out[1]


def tensor_types(path: Path) -> dict[str, str]:
    """GGUF tensor name → type name (e.g. ``Q4_K``)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    return {t.name: t.tensor_type.name for t in reader.tensors}


# Types llama.cpp's own mixture uses on purpose for each --quant (q4_k_m puts Q6_K on the output and on
# some attn_v/ffn_down; every ftype but f16/q8_0 gives the output matrix Q6_K).
INTENDED = {"f16": {"F16"}, "q8_0": {"Q8_0"}, "q4_0": {"Q4_0", "Q6_K"}, "iq4_nl": {"IQ4_NL", "Q5_K", "Q6_K"},
            "q4_k_m": {"Q4_K", "Q5_K", "Q6_K"}}


def fallbacks(types: dict[str, str], quant: str, asked: set[str] = frozenset()) -> dict[str, str]:
    """2-D weight tensors that fell back to a type outside the quant's intended mixture (llama.cpp does
    this when a row length is not a multiple of the block size, e.g. Q5_0 instead of Q4_K); ``asked``: the
    types given to the output / embedding tensors on purpose (upper case), never counted as fallbacks."""
    ok = INTENDED[quant] | {"F32"} | set(asked)
    return {n: t for n, t in types.items() if t not in ok and not n.endswith(".bias")}


def weight_fallbacks(types: dict[str, str], quant: str, asked: set[str] = frozenset()) -> dict[str, str]:
    """``fallbacks`` of weight types only (``TYPE_BITS``): an integer table, such as an EAGLE-3 draft's d2t, is none."""
    return {n: t for n, t in fallbacks(types, quant, asked).items() if t in TYPE_BITS}


def precision(path: Path) -> dict:
    """Bits per weight of a GGUF's 2-D weights (parameter-weighted) and the count of each tensor type."""
    from ondevice.formats.gguf import GGUFFile

    reader = GGUFFile(path).reader  # a truncated or corrupt file: one line naming it
    bits, n, types = 0.0, 0, Counter()
    for t in reader.tensors:
        if len(t.shape) < 2:
            continue
        name = t.tensor_type.name
        types[name] += 1
        size = int(np.prod([int(x) for x in t.shape]))
        bits += TYPE_BITS.get(name, 16.0) * size
        n += size
    bpw = bits / n if n else 0.0
    return {"bits_per_weight": round(bpw, 3), "types": dict(types),
            "quantized": any(k not in ("F32", "F16", "BF16") for k in types)}
