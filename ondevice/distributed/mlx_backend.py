"""``MLXBackend`` with its model split over the ranks of an mlx.launch job by mlx-lm (tensor or pipeline)."""

from __future__ import annotations

from pathlib import Path

from ondevice.backends.mlx import MLXBackend, mlx_tokenizer
from ondevice.distributed.world import World, fingerprint
from ondevice.errors import OndeviceError

SHARD_MODES = ("auto", "tensor", "pipeline")


def plan_sharding(model, config: dict, size: int, mode: str, path: Path) -> str:
    """'tensor' or 'pipeline' for ``model`` over ``size`` ranks; a one-line error when mlx-lm cannot."""
    import mlx_lm

    if mode not in SHARD_MODES:
        raise OndeviceError(f"ONDEVICE_SHARD={mode!r}: choose one of {', '.join(SHARD_MODES)}")
    arch = config.get("model_type", "?")
    tensor = hasattr(model, "shard")
    pipeline = hasattr(getattr(model, "model", None), "pipeline")
    if mode == "auto":
        mode = "tensor" if tensor else "pipeline" if pipeline else ""
    if not mode or (mode == "tensor" and not tensor) or (mode == "pipeline" and not pipeline):
        offered = [m for m, ok in (("tensor", tensor), ("pipeline", pipeline)) if ok]
        raise OndeviceError(
            f"{path}: mlx-lm {mlx_lm.__version__} cannot shard a {arch} model"
            + (f" by {mode} parallelism; it offers {' and '.join(offered)} (set ONDEVICE_SHARD)" if offered and mode
               else "; run it on one machine or pick a supported architecture (llama, qwen2, qwen3, ...)"))
    if mode == "tensor":
        need = {"attention heads": config.get("num_attention_heads"),
                "key/value heads": config.get("num_key_value_heads", config.get("num_attention_heads")),
                "MLP width (intermediate_size)": config.get("intermediate_size")}
        for what, n in need.items():
            if isinstance(n, int) and n % size:
                raise OndeviceError(
                    f"{path}: its {n} {what} cannot be split evenly over {size} ranks; use a world size that "
                    f"divides {n}" + (" or ONDEVICE_SHARD=pipeline" if pipeline else ""))
    else:
        import mlx.core as mx
        from mlx.utils import tree_flatten

        n_layers = len(model.model.layers)
        if n_layers < size:
            raise OndeviceError(f"{path}: {n_layers} layers cannot be split over {size} pipeline ranks")
        floats = {str(v.dtype) for _, v in tree_flatten(model.parameters()) if mx.issubdtype(v.dtype, mx.floating)}
        if len(floats) > 1:  # mlx-lm receives activations in the embedding's dtype: mixed dtypes arrive garbled
            raise OndeviceError(
                f"{path}: its weights mix {' and '.join(sorted(floats))}, and mlx-lm's pipeline passes activations "
                "between ranks in the embedding's dtype; use ONDEVICE_SHARD=tensor or weights of one float dtype")
    return mode


class ShardedMLXBackend(MLXBackend):
    """``MLXBackend`` whose model is split over ``world``'s ranks; logits come back whole on every rank.

    Args:
        path: an MLX model directory (the same on every machine).
        world: the job (``ondevice.distributed.world.world()``).
        mode: 'auto' (mlx-lm's choice: tensor when offered), 'tensor' or 'pipeline'.
        checkpoint: called with a fingerprint of config.json and the mode once the plan is made, before
            any weight moves (``ondevice.distributed.sharded.LoadSync``; default: the ranks must agree on it).
    """

    def __init__(self, path, *, world: World, mode: str = "auto", n_ctx: int = 4096, device: str | None = None,
                 checkpoint=None) -> None:
        self.world = world
        self._checkpoint = checkpoint or (lambda fp: world.agree(fp, what="model load"))
        self.shard_mode = mode
        self.collectives_per_forward = 0
        super().__init__(path, n_ctx=n_ctx, device=device)

    def _load_model(self):
        """What mlx-lm's ``sharded_load`` does for a local folder, minus its download filter (which needs a
        weight index file) and its tokenizer load (which trusts the folder's remote code): ours never runs it."""
        import mlx.core as mx
        from mlx_lm.utils import load_model

        w = self.world
        model, config = load_model(self.path, lazy=True, strict=False)
        mode = plan_sharding(model, config, w.size, self.shard_mode, self.path)
        tokenizer = mlx_tokenizer(self.path, config.get("eos_token_id"))
        # every rank must shard the same model the same way before any weight moves
        self._checkpoint(fingerprint((self.path / "config.json").read_text(), mode))
        self.shard_mode = mode
        if mode == "tensor":
            model.shard(w.group)
            self.collectives_per_forward = 2 * len(model.model.layers)  # attention out + MLP down: one all_sum each
        else:
            model.model.pipeline(w.group)
            self.collectives_per_forward = w.size  # a send per stage boundary, then one all_gather
        mx.eval(model.parameters())  # no collective here: LoadSync's next checkpoint brings the ranks in step
        return model, tokenizer
