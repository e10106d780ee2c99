"""Where a model's vision projector (mmproj GGUF) lives: beside the model, as LM Studio and Hugging Face repos
keep it, or as a layer of the model's manifest in Ollama's store; and the error when there is none."""

from __future__ import annotations

import json
import re
from pathlib import Path

from ondevice.errors import OndeviceError

_OLLAMA_MODEL, _OLLAMA_PROJECTOR = "application/vnd.ollama.image.model", "application/vnd.ollama.image.projector"
_RANK = ("f16", "bf16", "f32", "q8_0")  # which of several mmproj files beside a model to take first


def find_mmproj(model_path: str | Path) -> Path | None:
    """The vision projector kept beside a model, as LM Studio and Hugging Face repos keep it, or in Ollama's
    store (the projector layer of the manifest whose model layer is this blob).

    Args:
        model_path: the model's .gguf file (or Ollama blob).
    Returns:
        A ``*mmproj*.gguf`` file in the same folder (several: F16, then BF16, F32, Q8_0, then by name), the
        Ollama projector blob, or None.
    """
    model = Path(model_path)
    if model.parent.name == "blobs" and re.fullmatch(r"sha256-[0-9a-f]{64}", model.name):
        return _ollama_projector(model)
    try:
        found = [p for p in model.parent.iterdir() if "mmproj" in p.name.lower() and p.suffix.lower() == ".gguf"
                 and p.is_file() and p.resolve() != model.resolve()]
    except OSError:
        return None

    def rank(p: Path) -> tuple[int, str]:
        name = p.stem.lower().replace("-", "_").replace(".", "_").split("_")
        return next((i for i, r in enumerate(_RANK) if r in name), len(_RANK)), p.name

    return min(found, key=rank) if found else None


def _ollama_projector(blob: Path) -> Path | None:
    """The projector blob of the Ollama manifest that lists ``blob`` as its model layer."""
    digest = "sha256:" + blob.name.removeprefix("sha256-")
    for manifest in sorted((blob.parent.parent / "manifests").glob("*/*/*/*"))[:10_000]:
        try:
            layers = json.loads(manifest.read_text())["layers"]
            if not any(x.get("mediaType") == _OLLAMA_MODEL and x.get("digest") == digest for x in layers):
                continue
            proj = [str(x["digest"]) for x in layers if x.get("mediaType") == _OLLAMA_PROJECTOR]
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue  # another model's unreadable manifest is not this model's problem
        for d in proj:
            if re.fullmatch(r"sha256:[0-9a-f]{64}", d) and (p := blob.parent / d.replace(":", "-")).is_file():
                return p
    return None


def missing_projector(model_path: str | Path) -> OndeviceError:
    """The one-line error for an image sent to a model without a projector."""
    name = Path(model_path).name
    return OndeviceError(f"{name}: this model has no vision projector (no mmproj*.gguf beside it), so it cannot read "
                         "images; pass --mmproj FILE (the model's mmproj GGUF) or send text only")
