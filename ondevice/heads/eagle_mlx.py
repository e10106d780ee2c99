"""What ``train_eagle`` needs from an MLX target (``MLXBackend``) that a GGUF target gives from its file: the
config, the layer inputs (``mlx_layers``, read from the target's own passes), the LM-head and embedding rows, the
final norm's weight. The written drafter GGUF is checked in MLX by the converter (``convert_eagle3(mlx_target=…)``:
``mlx_eagle3.Eagle3MLX``, the runtime that runs it on this target, against a numpy forward of the checkpoint).

The fit itself is the GGUF path's (JAX on the CPU); one model is in memory: the runtime's own target records the
answers, then reads the features, then runs the written file's check.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ondevice.errors import OndeviceError

MEDUSA = "train Medusa heads for it instead: `ondevice train-heads MODEL --kind medusa`"


def config(path: Path) -> dict:
    """The target's decoder config (``config.json``, or its ``text_config``) with the keys ``shape_for`` reads."""
    try:
        cfg = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise OndeviceError(f"{path / 'config.json'}: not a readable model config ({e}); re-convert the model") from None
    cfg = {**cfg, **(cfg.get("text_config") or {})} if isinstance(cfg, dict) else {}
    need = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size")
    missing = [k for k in need if not isinstance(cfg.get(k), int) or cfg[k] < 1]
    if missing:
        raise OndeviceError(f"{path / 'config.json'}: no positive integer {missing[0]}; the EAGLE drafter is sized from "
                            f"it; {MEDUSA}")
    return cfg


def prepare(backend, ids: list[int]):
    """Refuse (one line) a target whose passes cannot hand out the inputs of layers ``ids``, or without a final
    norm to read, before any work; the recording then runs without the layer inputs (``enable_layer_inputs(ids)``
    again before the features). Returns ``backend``."""
    try:
        backend.enable_layer_inputs(ids)
        backend.final_norm()
    except OndeviceError as e:
        raise OndeviceError(f"{e}; {MEDUSA}") from None
    backend.enable_layer_inputs([])
    return backend


def rows(backend, vocab_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, str]:
    """(LM-head rows of ``vocab_ids`` [Vd, h], every token's embedding [V, h], architecture), float32, as
    ``train.target_rows`` reads them from a GGUF (quantized layers dequantized by MLX)."""
    backend.enable_hidden()
    out_rows, _, arch = backend.output_rows(vocab_ids)
    return out_rows, backend.token_table(), arch
