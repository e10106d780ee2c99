"""Reading a DFlash draft checkpoint (HF layout, safetensors only), checked on its own (``open_dflash``); the
layout is described in ``converters.dflash``. A pickle checkpoint is refused unread.

Variants (``DFlashSource.variant``), as llama.cpp's conversion/qwen.py names them: ``dflash`` (DFlashDraftModel),
``dflash2`` (DFlash2DraftModel: ``dflash_config`` ``conv_kernel_size`` / ``conv_group_size`` / ``selector_rank`` /
``selector_top_k``; per layer ``attention_conv`` / ``mlp_conv`` ``base_kernel`` [2, kernel, hidden] and
``kernel_projection`` [2 · kernel · hidden / group, hidden]; ``candidate_selector.{predecessor,successor}_codebook``
[vocab, rank] and ``hidden_projection`` [rank, hidden]) and ``dspark`` (DSparkDraftModel / Qwen3DSparkModel:
``markov_head.markov_w1`` [vocab, rank], ``markov_w2`` [vocab, rank], optional ``confidence_head.proj``
[1, hidden + rank] + bias; ``target_layer_ids`` / ``mask_token_id`` / ``block_size`` may sit at the config's top
level; ``sample_from_anchor``, default true). The other DSpark families llama.cpp knows (DeepSeek-V4, Gemma4,
LFM2, Ling, EAGLE-3-style speculators) are refused in one line naming the architecture.
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
       "embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight",
       # DSpark (Markov head, optional confidence head)
       "markov_head.markov_w1.weight": "markov_w1.weight", "markov_head.markov_w2.weight": "markov_w2.weight",
       "confidence_head.proj.weight": "conf_proj.weight", "confidence_head.proj.bias": "conf_proj.bias",
       # DFlash2 (candidate selector)
       "candidate_selector.predecessor_codebook": "selector_predecessor.weight",
       "candidate_selector.successor_codebook": "selector_successor.weight",
       "candidate_selector.hidden_projection.weight": "selector_hidden.weight"}
CONV = {"attention_conv.base_kernel": "attn_conv_base", "attention_conv.kernel_projection.weight": "attn_conv_proj.weight",
        "mlp_conv.base_kernel": "ffn_conv_base", "mlp_conv.kernel_projection.weight": "ffn_conv_proj.weight"}
DSPARK_ARCHS = ("DSparkDraftModel", "Qwen3DSparkModel")
REFUSED_ARCHS = {"DeepseekV4DSparkModel": "DeepSeek-V4", "Gemma4DSparkModel": "Gemma4",
                 "Lfm2DSparkDraftModel": "LFM2", "LingDSparkModel": "Ling", "DSparkSpeculator": "EAGLE-3-style"}
DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def is_dflash(path: str | Path) -> bool:
    """Whether directory ``path`` holds a DFlash-family draft (its config.json has ``dflash_config``, or names a
    DFlash / DSpark architecture: those this converter refuses are claimed too, to be refused by name)."""
    if config_names(path, "dflash_config"):
        return True
    cfg = Path(path) / "config.json"
    if not cfg.is_file():
        return False
    try:
        archs = read_config(cfg).get("architectures") or []
    except OndeviceError:
        return False
    return any(a in DSPARK_ARCHS or a in REFUSED_ARCHS or a.startswith("DFlash") for a in archs)


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

    @property
    def variant(self) -> str:
        """dflash | dflash2 (conv + selector) | dspark (Markov head)."""
        if "markov_head.markov_w1.weight" in self.names or set(self.config.get("architectures") or []) & set(DSPARK_ARCHS):
            return "dspark"
        return "dflash2" if "conv_kernel_size" in self.dflash else "dflash"

    @property
    def sample_from_anchor(self) -> bool:
        """DSpark: the anchor's own row is the first draft's (true, DFlash-lineage) or a bonus slot (false)."""
        return bool(self.config.get("sample_from_anchor", True))

    def conv(self, key: str) -> int:
        """A DFlash2 ``dflash_config`` integer (``DFLASH2_KEYS``)."""
        return int(self.dflash[key])


def open_dflash(path: str | Path) -> DFlashSource:
    """Open a DFlash checkpoint directory and check it on its own; every problem is one line naming the file."""
    path = Path(path)
    cfg_path = path / "config.json"
    if not path.is_dir() or not cfg_path.is_file():
        raise OndeviceError(f"{path}: not a DFlash checkpoint directory (config.json + *.safetensors)")
    config = read_config(cfg_path)
    archs = config.get("architectures") or []
    for a in archs:
        if a in REFUSED_ARCHS:
            raise OndeviceError(f"{cfg_path}: architecture {a} ({REFUSED_ARCHS[a]} DSpark) is not converted here; the "
                                "Qwen-family DFlash, DFlash2 and DSpark drafts are")
    if "transformer_layer_config" in config or "aux_hidden_state_layer_ids" in config:
        raise OndeviceError(f"{cfg_path}: an EAGLE-3-style DSpark export ({archs[0] if archs else 'no architecture'}) "
                            "is not converted here; the Qwen-family DFlash, DFlash2 and DSpark drafts are")
    if "dflash_config" not in config and set(archs) & set(DSPARK_ARCHS):  # DSpark keeps these at the top level
        config = {**config, "dflash_config": {k: config[k] for k in ("target_layer_ids", "mask_token_id", "block_size")
                                              if k in config}}
    if config.get("markov_head_type", "vanilla") != "vanilla":
        raise OndeviceError(f"{cfg_path}: markov_head_type {config['markov_head_type']!r} is not supported (vanilla)")
    if int(config.get("draft_vocab_size") or config.get("vocab_size", 0)) != int(config.get("vocab_size", 0)):
        raise OndeviceError(f"{cfg_path}: draft_vocab_size {config['draft_vocab_size']} < vocab_size (a d2t draft "
                            "vocabulary) is not converted here")
    files = safetensors_files(path, " (torch.load(..., weights_only=True) + safetensors save_file)")
    if config.get("hidden_act", "silu") != "silu":
        raise OndeviceError(f"{cfg_path}: hidden_act {config['hidden_act']!r} is not supported here (silu)")
    src = DFlashSource(path, config, {}, _Safetensors(files))
    unsupported = [k for k in ("attention_value_scale", "output_multiplier", "final_logit_softcapping",
                               "input_embedding_scale", "use_swa") if k in src.dflash]
    unsupported += [k for k in ("use_sliding_window", "rope_scaling") if config.get(k)]
    if unsupported or config.get("rope_is_neox_style", True) is False:
        raise OndeviceError(f"{cfg_path}: {(unsupported or ['rope_is_neox_style'])[0]} is not supported by this "
                            "converter")
    if src.dflash.get("mask_token_id") is None:
        raise OndeviceError(f"{cfg_path}: dflash_config has no mask_token_id; the draft cannot form a block")
    if not src.layer_ids:
        raise OndeviceError(f"{cfg_path}: dflash_config has no target_layer_ids")
    for file_name in src.tensors.index:
        name = file_name.removeprefix("model.")
        if name.endswith("rotary_emb.inv_freq") or name == "t2d":  # t2d: unused at run time (llama.cpp drops it)
            continue
        src.names[name] = file_name
    if src.variant == "dflash2":
        missing = [k for k in DFLASH2_KEYS if k not in src.dflash]
        if missing:
            raise OndeviceError(f"{cfg_path}: dflash_config has conv_kernel_size but no {missing[0]} (DFlash2)")
        h, g, k = src.hidden, src.conv("conv_group_size"), src.conv("selector_top_k")
        if min(src.conv(x) for x in DFLASH2_KEYS) <= 0 or h % g or h < k * (k + 1):
            raise OndeviceError(f"{cfg_path}: DFlash2 needs hidden {h} divisible by conv_group_size {g} and ≥ "
                                f"selector_top_k·(top_k + 1) = {k * (k + 1)} (llama.cpp's selector lattice row)")
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
    v = int(src.config["vocab_size"])
    if src.variant == "dflash2":
        kern, rank = src.conv("conv_kernel_size"), src.conv("selector_rank")
        proj = 2 * kern * h // src.conv("conv_group_size")
        shapes.update({"attention_conv.base_kernel": (2, kern, h), "mlp_conv.base_kernel": (2, kern, h),
                       "attention_conv.kernel_projection.weight": (proj, h),
                       "mlp_conv.kernel_projection.weight": (proj, h)})
        want.update({"candidate_selector.predecessor_codebook": (v, rank),
                     "candidate_selector.successor_codebook": (v, rank),
                     "candidate_selector.hidden_projection.weight": (rank, h)})
    optional = ["embed_tokens.weight", "lm_head.weight"]
    if src.variant == "dspark":
        if "markov_head.markov_w1.weight" not in src.names:
            raise OndeviceError(f"{src.path}: tensor markov_head.markov_w1.weight missing from this DSpark checkpoint")
        rank = src.tensors.shape(src.names["markov_head.markov_w1.weight"])[-1]
        want.update({"markov_head.markov_w1.weight": (v, rank), "markov_head.markov_w2.weight": (v, rank)})
        if "confidence_head.proj.weight" in src.names:
            want.update({"confidence_head.proj.weight": (1, h + rank), "confidence_head.proj.bias": (1,)})
    for i in range(src.n_layers):
        want.update({f"layers.{i}.{k}": s for k, s in shapes.items()})
    check_shapes(src, want, cfg_path, f"missing from this {src.variant} checkpoint; re-download it")
    extra = sorted(n for n in src.names if n not in want and n not in optional)
    if extra:
        raise OndeviceError(f"{src.path}: tensor {extra[0]} is not part of a {src.variant} draft converted here; "
                            "refusing rather than dropping it")
