"""Core ML backend (Neural Engine drafts): a package written by ``ondevice convert --to coreml``.

Prediction needs macOS 15 (stateful models); conversion works everywhere. The host logic — write
position, prefill/decode planning, padding, rollback — is ``StaticCacheBackend``'s, shared with the numpy
reference that the tests run on every platform.
"""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path

import numpy as np

from ondevice.backends.static import StaticCacheBackend
from ondevice.errors import OndeviceError

COMPUTE_UNITS = {"cpu": "CPU_ONLY", "gpu": "CPU_AND_GPU"}


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


class CoreMLBackend(StaticCacheBackend):
    """A converted Core ML decoder on macOS (see ``ondevice.backends.Backend``).

    Args:
        path: the directory ``ondevice convert --to coreml`` wrote, or its model.mlpackage.
        n_ctx: context asked by the runtime (at most the converted ``--context``).
        device: None (the compute units chosen at conversion, CPU_AND_NE by default), 'cpu' or 'gpu'.
    """

    def __init__(self, path: str | Path, *, n_ctx: int | None = None, device: str | None = None) -> None:
        directory, package = package_dir(Path(path))
        if sys.platform != "darwin":
            raise OndeviceError(f"{package}: Core ML runs on macOS only; use the GGUF or MLX form of this model here")
        major = int((platform.mac_ver()[0] or "0").split(".")[0])
        if major < 15:
            raise OndeviceError(f"{package}: stateful Core ML models need macOS 15 or later (this is {platform.mac_ver()[0]})")
        manifest = read_manifest(directory)
        # context, tokenizer and n_ctx are checked before the (slow) Core ML load
        super().__init__(package, tokenizer_dir=directory, context=manifest["context"], chunk=manifest["prefill_chunk"],
                         vocab_size=manifest["vocab_size"], n_ctx=n_ctx)
        import coremltools as ct

        units = getattr(ct.ComputeUnit, COMPUTE_UNITS.get(device or "", manifest.get("compute_units", "CPU_AND_NE")))
        try:
            self._fn = {f: ct.models.MLModel(str(package), compute_units=units, function_name=f) for f in manifest["functions"]}
        except Exception as e:  # Core ML raises plain RuntimeErrors for unloadable packages
            raise OndeviceError(f"{package}: Core ML could not load it ({e}); reconvert it") from e
        self._state = self._fn["decode"].make_state()  # one KV state, shared by both functions

    def _run(self, function: str, ids: np.ndarray, position: int) -> np.ndarray:
        inputs = {"input_ids": ids.reshape(1, -1), "position": np.array([position], dtype=np.int32)}
        out = self._fn[function].predict(inputs, state=self._state)["logits"]
        return np.asarray(out, dtype=np.float32)[0]

    def close(self) -> None:
        self._fn, self._state = {}, None
