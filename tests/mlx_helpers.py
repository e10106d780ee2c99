"""mlx-lm as the independent reference the converter tests compare against (float32, HF checkpoints)."""

from __future__ import annotations

import numpy as np


def mlx_float32(hf_dir):
    """mlx-lm's model for an HF checkpoint directory, cast to float32, and its tokenizer."""
    import mlx.core as mx
    from mlx.utils import tree_map
    from mlx_lm import load

    model, tok = load(str(hf_dir))
    model.update(tree_map(lambda x: x.astype(mx.float32), model.parameters()))
    return model, tok


def mlx_logits(model, ids) -> np.ndarray:
    """[len(ids), vocab] float32 logits of one fresh pass."""
    import mlx.core as mx

    return np.array(model(mx.array([ids]))[0].astype(mx.float32))
