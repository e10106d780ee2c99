"""Core ML backend (Neural Engine drafts). Prediction needs macOS; conversion works everywhere."""

from __future__ import annotations

import sys
from pathlib import Path

from ondevice.errors import OndeviceError


class CoreMLBackend:
    """Opens a converted ``.mlpackage``. Runtime prediction is macOS-only."""

    def __init__(self, path: str | Path, *, n_ctx: int = 512) -> None:
        self.path = Path(path)
        if sys.platform != "darwin":
            raise OndeviceError(f"{self.path}: Core ML runs on macOS only; use the GGUF or MLX form of this model here")
        raise OndeviceError(f"{self.path}: the Core ML runtime backend is not built yet; use the GGUF or MLX form of this model")
