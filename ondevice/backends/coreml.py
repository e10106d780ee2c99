"""Core ML backend (Neural Engine drafts): a package written by ``ondevice convert --to coreml``.

Prediction needs macOS 15 (stateful models); conversion works everywhere, and ``device="mil"``
(``ondevice.backends.mil``) runs the package's program anywhere. The host logic — write position,
prefill/decode planning, padding, rollback — is ``StaticCacheBackend``'s.

Loading follows Apple's and coremltools' documentation:

- the package is compiled once (``coremltools.utils.compile_model``, Core ML's ``compileModel(at:)``) into
  ``$ONDEVICE_HOME/coreml/<digest>/model.mlmodelc`` and every later load reads the compiled model
  (``MLModel(path.mlpackage)`` would recompile into a temp dir on each load);
- each function is loaded from it with ``CompiledMLModel(path, compute_units, function_name=...)``
  (multifunction models, iOS 18 / macOS 15);
- one ``make_state()`` serves both functions: ``prefill`` and ``decode`` declare the same states, and a
  state is passed to ``predict`` by reference (coremltools' stateful-models guide);
- where the installed coremltools has it, ``MLComputePlan`` reports each op's planned device.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import sys
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np

from ondevice.backends.static import StaticCacheBackend
from ondevice.errors import OndeviceError

COMPUTE_UNITS = {"cpu": "CPU_ONLY", "gpu": "CPU_AND_GPU", "ne": "CPU_AND_NE"}
DEVICE_NAMES = {"MLCPUComputeDevice": "CPU", "MLGPUComputeDevice": "GPU", "MLNeuralEngineComputeDevice": "ANE"}


def package_dir(path: Path) -> tuple[Path, Path]:
    """A converted directory or its model.mlpackage → (directory, package)."""
    path = Path(path)
    if path.suffix == ".mlpackage":
        return path.parent, path
    return path, path / "model.mlpackage"


def read_manifest(directory: Path) -> dict:
    f = directory / "manifest.json"
    try:
        m = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise OndeviceError(f"{f}: missing or unreadable; reconvert with `ondevice convert MODEL --to coreml`") from e
    if m.get("format") != "coreml" or "context" not in m:
        raise OndeviceError(f"{f}: not a Core ML conversion manifest; reconvert with `ondevice convert MODEL --to coreml`")
    return m


def package_digest(package: Path) -> str:
    """sha256 over the package's files (relative name + content): the compiled model's cache key."""
    h = hashlib.sha256()
    for f in sorted(p for p in package.rglob("*") if p.is_file()):
        h.update(str(f.relative_to(package)).encode() + b"\x00")
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 20):
                h.update(chunk)
    return h.hexdigest()[:24]


def compiled_path(package: Path) -> Path:
    """The package's compiled ``.mlmodelc``, compiled on first use and cached under ``$ONDEVICE_HOME/coreml``.

    The compile goes to a temp dir beside the cache entry and is renamed into place, so an interrupted
    compile leaves nothing a later load would trust.
    """
    import coremltools as ct

    from ondevice.store.catalog import home

    dest = home() / "coreml" / package_digest(package) / "model.mlmodelc"
    if dest.is_dir():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".compile.", dir=dest.parent))
    try:
        out = Path(ct.utils.compile_model(str(package), str(tmp / "model.mlmodelc")))
        try:
            os.replace(out, dest)
        except OSError:
            if not dest.is_dir():  # another process may have won the race; that copy is as good
                raise
    except Exception as e:  # Core ML reports compile failures as plain RuntimeErrors
        raise OndeviceError(f"{package}: Core ML could not compile it ({e}); reconvert it") from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def op_devices(compiled: Path, units, functions) -> dict[str, dict[str, int]] | None:
    """Function → {device: op count} from ``MLComputePlan`` (coremltools ≥ 8 on macOS 14.4+), else None."""
    try:
        from coremltools.models.compute_plan import MLComputePlan

        plan = MLComputePlan.load_from_path(str(compiled), compute_units=units)
    except Exception:  # an older coremltools or macOS has no compute plan: nothing to report
        return None
    program = plan.model_structure.program
    if program is None:
        return None
    out = {}
    for name in functions:
        count = Counter()
        for op in program.functions[name].block.operations:
            if op.operator_name in ("const", "constexpr_blockwise_shift_scale", "constexpr_lut_to_dense"):
                continue
            usage = plan.get_compute_device_usage_for_mlprogram_operation(op)
            dev = type(usage.preferred_compute_device).__name__ if usage is not None else "unplanned"
            count[DEVICE_NAMES.get(dev, dev)] += 1
        out[name] = dict(count)
    return out


class CoreMLBackend(StaticCacheBackend):
    """A converted Core ML decoder on macOS (see ``ondevice.backends.Backend``).

    Args:
        path: the directory ``ondevice convert --to coreml`` wrote, or its model.mlpackage.
        n_ctx: context asked by the runtime (at most the converted ``--context``).
        device: None (the compute units chosen at conversion, CPU_AND_NE by default), 'cpu', 'gpu' or 'ne'
            (CPU_AND_NE: a draft is pinned there whatever device its target uses).
        plan_devices: also read the compute plan into ``self.op_devices`` (a second, slower load).
    """

    def __init__(self, path: str | Path, *, n_ctx: int | None = None, device: str | None = None,
                 plan_devices: bool = False) -> None:
        directory, package = package_dir(Path(path))
        if sys.platform != "darwin":
            raise OndeviceError(f"{package}: Core ML runs on macOS only; use device='mil' (--device mil) to run its "
                                "program in the MIL interpreter, or the GGUF or MLX form of this model")
        major = int((platform.mac_ver()[0] or "0").split(".")[0])
        if major < 15:
            raise OndeviceError(f"{package}: stateful Core ML models need macOS 15 or later (this is {platform.mac_ver()[0]})")
        if device not in (None, *COMPUTE_UNITS):
            raise OndeviceError(f"device={device!r}: a Core ML model runs on one of {', '.join(COMPUTE_UNITS)} (or 'mil')")
        manifest = read_manifest(directory)
        # context, tokenizer and n_ctx are checked before the (slow) Core ML load
        super().__init__(directory, tokenizer_dir=directory, context=manifest["context"], chunk=manifest["prefill_chunk"],
                         vocab_size=manifest["vocab_size"], n_ctx=n_ctx)
        import coremltools as ct

        self.compute_units = COMPUTE_UNITS.get(device or "", manifest.get("compute_units", "CPU_AND_NE"))
        units = getattr(ct.ComputeUnit, self.compute_units)
        self.compiled = compiled_path(package)
        try:
            self._fn = {f: ct.models.CompiledMLModel(str(self.compiled), compute_units=units, function_name=f)
                        for f in manifest["functions"]}
        except Exception as e:  # Core ML raises plain RuntimeErrors for unloadable models
            raise OndeviceError(f"{package}: Core ML could not load it ({e}); reconvert it") from e
        self.state = self._fn["decode"].make_state()  # one KV state, passed by reference to both functions
        self.op_devices = op_devices(self.compiled, units, manifest["functions"]) if plan_devices else None

    def _run(self, function: str, ids: np.ndarray, position: int) -> np.ndarray:
        inputs = {"input_ids": ids.reshape(1, -1).astype(np.int32), "position": np.array([position], dtype=np.int32)}
        out = self._fn[function].predict(inputs, state=self.state)["logits"]
        return np.asarray(out, dtype=np.float32)[0]

    def read_state(self, name: str) -> np.ndarray:
        """One state buffer's contents (``MLState.read_state``, coremltools ≥ 9)."""
        return np.asarray(self.state.read_state(name))

    def close(self) -> None:
        self._fn, self.state = {}, None
