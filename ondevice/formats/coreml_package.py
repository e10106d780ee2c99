"""Reading a converted Core ML package without Core ML's runtime (works on Linux): functions, states, weights."""

from __future__ import annotations

from pathlib import Path


def describe_package(package: str | Path) -> dict:
    """Read a converted package without Core ML's runtime (works on Linux): per function its inputs,
    states and outputs ([dtype, shape]), op counts and how its weight matrices are stored."""
    from collections import Counter

    from ondevice.formats.mil import load_program

    prog, default_function = load_program(package)
    from coremltools.converters.mil.mil import types

    def typed(v) -> list:
        return [types.builtin_to_string(v.dtype), list(v.shape)]

    out: dict = {"default_function": default_function, "functions": {}}
    for name, fn in prog.functions.items():
        ops = Counter(op.op_type for op in fn.operations)
        weights = Counter()
        for op in fn.find_ops(op_type="linear") + fn.find_ops(op_type="gather"):
            src = op.weight.op if op.op_type == "linear" else op.x.op
            if src.op_type == "constexpr_blockwise_shift_scale":
                block = src.data.shape[-1] // src.scale.shape[-1]
                weights[f"{types.builtin_to_string(src.data.dtype)}-block{block}"] += 1
            elif src.op_type == "constexpr_lut_to_dense":
                weights[f"lut{src.lut.shape[-2].bit_length() - 1}"] += 1
            elif src.op_type == "const":
                weights[types.builtin_to_string(src.outputs[0].dtype)] += 1
        out["functions"][name] = {
            "inputs": {k: typed(v) for k, v in fn.inputs.items() if "_cache_" not in k},
            "states": {k: typed(v) for k, v in fn.inputs.items() if "_cache_" in k},
            "outputs": {v.name: typed(v) for v in fn.outputs},
            "ops": dict(ops),
            "weights": dict(weights),
        }
    return out
