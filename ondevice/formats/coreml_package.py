"""Reading a converted Core ML package without Core ML's runtime (works on Linux): functions, states, weights."""

from __future__ import annotations

import contextlib
import io
import logging
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """coremltools prints tqdm bars and, off macOS, 'Failed to load _MLModelProxy' warnings: keep them
    off the terminal."""
    log = logging.getLogger("coremltools")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        log.setLevel(level)


def describe_package(package: str | Path) -> dict:
    """Read a converted package without Core ML's runtime (works on Linux): per function its inputs,
    states and outputs ([dtype, shape]), op counts and how its weight matrices are stored."""
    from collections import Counter

    with quiet():
        import coremltools as ct
        from coremltools.converters.mil.frontend.milproto.load import load as milproto_load
        from coremltools.converters.mil.mil import types

        model = ct.models.MLModel(str(package), skip_model_load=True)
        spec = model.get_spec()
        prog = milproto_load(model_spec=spec, specification_version=spec.specificationVersion,
                             file_weights_dir=model.weights_dir)

    def typed(v) -> list:
        return [types.builtin_to_string(v.dtype), list(v.shape)]

    out: dict = {"default_function": spec.description.defaultFunctionName, "functions": {}}
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
