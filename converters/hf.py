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
from ondevice.errors import OndeviceError, shown


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
    _map: object = None  # converters.lazy.SafetensorsMap, opened on first use

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
        """Read one tensor from the memory-mapped file as a new float32 array (bf16 widened exactly)."""
        if self._map is None:
            from converters.lazy import SafetensorsMap

            self._map = SafetensorsMap(self.files)
        return self._map.float32(name)

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


def open_checkpoint(path: str | Path, quantized: bool = False) -> HFCheckpoint:
    """Open and validate an HF checkpoint directory; every problem is one line naming the file. ``quantized``:
    accept already quantized weights (a caller that reads only the config and tokenizer, e.g. an MLX target's)."""
    path = Path(path)
    if not path.is_dir():
        raise OndeviceError(f"{shown(path)}: not a directory; pass an HF checkpoint directory (config.json + *.safetensors)")
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise OndeviceError(f"{shown(cfg_path)}: missing; an HF checkpoint needs config.json beside its safetensors")
    try:
        config = json.loads(cfg_path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise OndeviceError(f"{shown(cfg_path)}: not valid JSON ({e})") from e
    arch_of(config, cfg_path)  # refuses unsupported architectures and quirks llama.cpp would compute differently
    for key in ("quantization", "quantization_config"):  # MLX-quantized (mlx-lm), or GPTQ/AWQ/bitsandbytes
        if config.get(key) and not quantized:
            raise OndeviceError(f"{shown(cfg_path)}: already quantized weights ({key!r}); convert from the original float "
                                "checkpoint (or from a GGUF file)")
    files = sorted(path.glob("model*.safetensors"))
    if not files:
        raise OndeviceError(f"{shown(path)}: no model*.safetensors files (PyTorch .bin checkpoints are not supported)")
    ckpt = HFCheckpoint(path, config, files)
    from safetensors import safe_open

    for f in files:
        try:
            with safe_open(str(f), framework="numpy") as st:
                for name in st.keys():
                    ckpt._index[name] = f
        except Exception as e:  # safetensors raises its own error types for truncated/corrupt headers
            raise OndeviceError(f"{shown(f)}: unreadable safetensors file ({e}); re-download or re-export it") from e
        size = f.stat().st_size
        _check_complete(f, size)
    _check_tensors(ckpt)
    return ckpt


# tensors every decoder layer of every supported architecture has (HF names, after "model.layers.N.")
LAYER_TENSORS = tuple(f"self_attn.{p}_proj.weight" for p in "qkvo") + tuple(
    f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")) + ("input_layernorm.weight", "post_attention_layernorm.weight")


def _check_tensors(ckpt: HFCheckpoint) -> None:
    """Refuse a checkpoint with a missing tensor (a lost shard, a damaged export) before anything is written:
    every layer needs the common tensors and whatever layer 0 has (biases, q/k norms), the model its embedding,
    final norm, and ``lm_head`` unless the config ties it to the embedding."""
    path, names = ckpt.path, set(ckpt._index)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
        except (ValueError, KeyError, AttributeError) as e:
            raise OndeviceError(f"{index}: unreadable shard index ({e}); re-download it") from e
        lost = sorted(s for s in shards if not (path / s).is_file())
        if lost:
            raise OndeviceError(f"{shown(path / lost[0])}: missing ({len(lost)} of {len(shards)} shards named by "
                                f"{index.name}); re-download the checkpoint")
    first = {n.removeprefix("model.layers.0.") for n in names if n.startswith("model.layers.0.")}
    per_layer = (set(LAYER_TENSORS) | first) - {"self_attn.rotary_emb.inv_freq"}
    required = {"model.embed_tokens.weight", "model.norm.weight"}
    required |= {f"model.layers.{i}.{s}" for i in range(int(ckpt.config["num_hidden_layers"])) for s in per_layer}
    if ckpt.config.get("tie_word_embeddings") is False:
        required.add("lm_head.weight")
    missing = sorted(required - names)
    if missing:
        where = ckpt.files[0] if len(ckpt.files) == 1 else path
        raise OndeviceError(f"{shown(where)}: {len(missing)} tensor(s) missing (first: {missing[0]}); the checkpoint is "
                            "incomplete, re-download or re-export it")


def _check_complete(f: Path, size: int) -> None:
    """A truncated safetensors file can still have a readable header: compare data length to the header."""
    with open(f, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(n))
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end > size:
        raise OndeviceError(f"{shown(f)}: truncated ({size} bytes, header promises {8 + n + end}); re-download it")
