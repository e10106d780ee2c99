"""ondevice: exact speculative decoding on a laptop.

The public API is imported lazily so that ``import ondevice`` stays fast and never pulls in
llama.cpp, MLX or Core ML until a model is loaded.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = [
    "BatchEngine",
    "Chunk",
    "GenerateRequest",
    "OndeviceError",
    "Result",
    "Runtime",
    "SamplingParams",
    "Stats",
    "load",
    "__version__",
]

_LAZY = {
    "load": "ondevice.loader",
    "BatchEngine": "ondevice.batching",
    "Runtime": "ondevice.runtime",
    "Result": "ondevice.results",
    "Chunk": "ondevice.results",
    "Stats": "ondevice.results",
    "SamplingParams": "ondevice.params",
    "GenerateRequest": "ondevice.params",
    "OndeviceError": "ondevice.errors",
}

if TYPE_CHECKING:  # pragma: no cover
    from ondevice.batching import BatchEngine
    from ondevice.errors import OndeviceError
    from ondevice.loader import load
    from ondevice.params import GenerateRequest, SamplingParams
    from ondevice.results import Chunk, Result, Stats
    from ondevice.runtime import Runtime


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ondevice' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value
