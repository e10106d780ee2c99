"""Reading HF checkpoints: config.json, (sharded) model*.safetensors, tokenizer files."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from converters.archs import arch_of
from converters.archs import head_dim as _head_dim
from ondevice.errors import OndeviceError


@dataclass
class HFCheckpoint:
    """An HF causal-LM checkpoint directory, opened lazily.

    Attributes:
        path: the directory.
        config: parsed config.json.
        files: the safetensors files, in order.
    """

    path: Path
    config: dict
    files: list[Path]
    _index: dict[str, Path] = field(default_factory=dict)

    @property
    def arch(self) -> str:
        return self.config["model_type"]

    @property
    def vocab_size(self) -> int:
        return int(self.config["vocab_size"])

    @property
    def head_dim(self) -> int:
        return _head_dim(self.config)

    def tensor_names(self) -> list[str]:
        return list(self._index)

    def tensor(self, name: str) -> np.ndarray:
        """Load one tensor as a numpy array (bf16 is widened to float32)."""
        from safetensors import safe_open

        with safe_open(str(self._index[name]), framework="numpy") as f:
            return f.get_tensor(name)

    def tensors(self) -> Iterator[tuple[str, np.ndarray]]:
        for name in self._index:
            yield name, self.tensor(name)

    def source_sha256(self) -> str:
        """sha256 over the config, weights and tokenizer files (name + content, in name order)."""
        h = hashlib.sha256()
        extra = [self.path / n for n in ("config.json", "tokenizer.json", "tokenizer.model", "tokenizer_config.json")]
        for p in sorted({*self.files, *(e for e in extra if e.is_file())}):
            h.update(p.name.encode() + b"\x00")
            with open(p, "rb") as f:
                while chunk := f.read(1 << 20):
                    h.update(chunk)
        return h.hexdigest()


def open_checkpoint(path: str | Path) -> HFCheckpoint:
    """Open and validate an HF checkpoint directory; every problem is one line naming the file."""
    path = Path(path)
    if not path.is_dir():
        raise OndeviceError(f"{path}: not a directory; pass an HF checkpoint directory (config.json + *.safetensors)")
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise OndeviceError(f"{cfg_path}: missing; an HF checkpoint needs config.json beside its safetensors")
    try:
        config = json.loads(cfg_path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise OndeviceError(f"{cfg_path}: not valid JSON ({e})") from e
    arch_of(config, cfg_path)  # refuses unsupported architectures and quirks llama.cpp would compute differently
    files = sorted(path.glob("model*.safetensors"))
    if not files:
        raise OndeviceError(f"{path}: no model*.safetensors files (PyTorch .bin checkpoints are not supported)")
    ckpt = HFCheckpoint(path, config, files)
    from safetensors import safe_open

    for f in files:
        try:
            with safe_open(str(f), framework="numpy") as st:
                for name in st.keys():
                    ckpt._index[name] = f
        except Exception as e:  # safetensors raises its own error types for truncated/corrupt headers
            raise OndeviceError(f"{f}: unreadable safetensors file ({e}); re-download or re-export it") from e
        size = f.stat().st_size
        _check_complete(f, size)
    return ckpt


def _check_complete(f: Path, size: int) -> None:
    """A truncated safetensors file can still have a readable header: compare data length to the header."""
    with open(f, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(n))
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end > size:
        raise OndeviceError(f"{f}: truncated ({size} bytes, header promises {8 + n + end}); re-download it")
