"""Reading a DFlash draft checkpoint (HF layout, safetensors only), checked on its own (``open_dflash``); the
layout is described in ``converters.dflash``. A pickle checkpoint is refused unread.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from converters.eagle3_source import (
    DraftSource,
    _Safetensors,
    check_shapes,
    config_names,
    read_config,
    safetensors_files,
)
from ondevice.errors import OndeviceError

LAYER = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
         "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
         "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
         "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
         "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
         "mlp.down_proj.weight": "ffn_down.weight"}
TOP = {"fc.weight": "fc.weight", "hidden_norm.weight": "enc.output_norm.weight", "norm.weight": "output_norm.weight",
       "embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight"}


def is_dflash(path: str | Path) -> bool:
    """Whether directory ``path`` holds a DFlash draft (its config.json has ``dflash_config``)."""
    return config_names(path, "dflash_config")


@dataclass
class DFlashSource(DraftSource):
    """A DFlash checkpoint read and checked on its own (``open_dflash``); ``names``: canonical (no ``model.``
    prefix) → the file's tensor name."""

    path: Path
    config: dict
    names: dict[str, str]
    tensors: _Safetensors

    def get(self, key: str, default=None):
        return self.config.get(key, default)

    @property
    def n_layers(self) -> int:
        return int(self.config["num_hidden_layers"])

    @property
    def theta(self) -> float:
        return float(self.config.get("rope_theta", 1e6))

    @property
    def dflash(self) -> dict:
        return self.config.get("dflash_config") or {}

    @property
    def layer_ids(self) -> list[int]:
        return [int(i) for i in self.dflash.get("target_layer_ids", self.config.get("target_layer_ids", []))]

    @property
    def block_size(self) -> int:
        return int(self.dflash.get("block_size", self.config.get("block_size", 16)))


def open_dflash(path: str | Path) -> DFlashSource:
    """Open a DFlash checkpoint directory and check it on its own; every problem is one line naming the file."""
    path = Path(path)
    cfg_path = path / "config.json"
    if not path.is_dir() or not cfg_path.is_file():
        raise OndeviceError(f"{path}: not a DFlash checkpoint directory (config.json + *.safetensors)")
    config = read_config(cfg_path)
    files = safetensors_files(path, " (torch.load(..., weights_only=True) + safetensors save_file)")
    if config.get("hidden_act", "silu") != "silu":
        raise OndeviceError(f"{cfg_path}: hidden_act {config['hidden_act']!r} is not supported here (silu)")
    src = DFlashSource(path, config, {}, _Safetensors(files))
    unsupported = [k for k in ("attention_value_scale", "output_multiplier", "final_logit_softcapping",
                               "input_embedding_scale", "use_swa", "conv_kernel_size") if k in src.dflash]
    unsupported += [k for k in ("use_sliding_window", "rope_scaling") if config.get(k)]
    if unsupported or config.get("rope_is_neox_style", True) is False:
        raise OndeviceError(f"{cfg_path}: {(unsupported or ['rope_is_neox_style'])[0]} is not supported by this "
                            "converter (plain DFlash drafts only)")
    if src.dflash.get("mask_token_id") is None:
        raise OndeviceError(f"{cfg_path}: dflash_config has no mask_token_id; the draft cannot form a block")
    if not src.layer_ids:
        raise OndeviceError(f"{cfg_path}: dflash_config has no target_layer_ids")
    for file_name in src.tensors.index:
        name = file_name.removeprefix("model.")
        if name.endswith("rotary_emb.inv_freq"):
            continue
        src.names[name] = file_name
    _check_shapes(src, cfg_path)
    return src


def _check_shapes(src: DFlashSource, cfg_path: Path) -> None:
    h, nh, nkv, hd, f = src.hidden, src.n_heads, src.n_kv_heads, src.head_dim, int(src.config["intermediate_size"])
    want = {"fc.weight": (h, len(src.layer_ids) * h), "hidden_norm.weight": (h,), "norm.weight": (h,)}
    shapes = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
              "self_attn.q_proj.weight": (nh * hd, h), "self_attn.k_proj.weight": (nkv * hd, h),
              "self_attn.v_proj.weight": (nkv * hd, h), "self_attn.o_proj.weight": (h, nh * hd),
              "self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,), "mlp.gate_proj.weight": (f, h),
              "mlp.up_proj.weight": (f, h), "mlp.down_proj.weight": (h, f)}
    for i in range(src.n_layers):
        want.update({f"layers.{i}.{k}": s for k, s in shapes.items()})
    check_shapes(src, want, cfg_path, "missing from this DFlash checkpoint; re-download it")
    extra = sorted(n for n in src.names if n not in want and n not in ("embed_tokens.weight", "lm_head.weight"))
    if extra:
        raise OndeviceError(f"{src.path}: tensor {extra[0]} is not part of a DFlash draft converted here (DFlash2 / "
                            "DSpark variants are not); refusing rather than dropping it")
