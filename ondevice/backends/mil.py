"""The Core ML package's own program, run by the MIL interpreter (``device="mil"``): any OS, slow, exact
to the program.

Same host logic as ``CoreMLBackend`` (``StaticCacheBackend``: write position, prefill/decode plan,
padding, rollback); the calls go to ``ondevice.formats.mil.MILProgram`` with one state dict shared by
``prefill`` and ``decode`` — as one ``MLState`` is on macOS.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ondevice.backends.coreml import package_dir, read_manifest
from ondevice.backends.static import StaticCacheBackend
from ondevice.errors import OndeviceError


class MILBackend(StaticCacheBackend):
    """A converted Core ML decoder interpreted with numpy (see ``ondevice.backends.Backend``).

    Args:
        path: the directory ``ondevice convert --to coreml`` wrote, or its model.mlpackage.
        n_ctx: context asked by the runtime (at most the converted ``--context``).
    """

    def __init__(self, path: str | Path, *, n_ctx: int | None = None) -> None:
        from ondevice.formats.mil import MILProgram

        directory, package = package_dir(Path(path))
        manifest = read_manifest(directory)
        super().__init__(directory, tokenizer_dir=directory, context=manifest["context"], chunk=manifest["prefill_chunk"],
                         vocab_size=manifest["vocab_size"], n_ctx=n_ctx)
        self.program = MILProgram(package)
        missing = {"decode", "prefill"} - set(self.program.functions)
        if missing:
            raise OndeviceError(f"{package}: no {', '.join(sorted(missing))} function; reconvert with `ondevice convert --to coreml`")
        self.state = self.program.new_state()

    def _run(self, function: str, ids: np.ndarray, position: int) -> np.ndarray:
        inputs = {"input_ids": ids.reshape(1, -1), "position": np.array([position], dtype=np.int32)}
        return np.asarray(self.program.run(function, inputs, self.state)["logits"], dtype=np.float32)[0]

    def close(self) -> None:
        self.state = {}
