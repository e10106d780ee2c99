"""HF decoder architectures → GGUF: hyperparameters and tensors, named by ``gguf``'s own tables.

Tensor names come from ``gguf.get_tensor_name_map`` (the ``TensorNameMap`` llama.cpp's converter
uses) and every written name is checked against ``gguf.MODEL_TENSORS`` for the target arch, so a
tensor llama.cpp would not load is refused here. What is left per architecture is its quirks:

- llama / mistral (GGUF ``llama``): Q/K rows permuted from HF rotate-half to llama.cpp's interleaved rope.
- qwen2: q/k/v biases, NEOX rope (no permutation).
- qwen3: per-head RMSNorm on q and k (``attn_q_norm``/``attn_k_norm``), explicit ``head_dim``.
- gemma3 (HF ``gemma3_text``): RMSNorm weights stored as ``1 + w`` (HF applies ``x·(1 + w)``), q/k norms,
  post-attention and post-FFN norms, sliding-window layers (pattern from ``layer_types``) with their own
  rope base, GELU-tanh MLP, the sqrt(hidden) embedding scale (applied by llama.cpp itself).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ondevice.errors import OndeviceError, shown


@dataclass(frozen=True)
class Arch:
    """How one HF ``model_type`` becomes a GGUF architecture."""

    gguf_arch: str  # gguf.MODEL_ARCH member name
    permute_qk: bool = False  # llama.cpp's llama arch wants interleaved rope rows
    norm_offset: float = 0.0  # added to every RMSNorm weight (Gemma stores w, computes x·(1 + w))
    activation: str = "silu"


ARCHS: dict[str, Arch] = {
    "llama": Arch("LLAMA", permute_qk=True),
    "mistral": Arch("LLAMA", permute_qk=True),
    "qwen2": Arch("QWEN2"),
    "qwen3": Arch("QWEN3"),
    "gemma3_text": Arch("GEMMA3", norm_offset=1.0, activation="gelu_pytorch_tanh"),
}
SUPPORTED_ARCHS = tuple(ARCHS)


def arch_of(config: dict, path: Path | str) -> Arch:
    """The ``Arch`` of a parsed config.json, after refusing what llama.cpp would compute differently."""
    name = config.get("model_type")
    if name not in ARCHS:
        raise OndeviceError(f"{shown(path)}: unsupported architecture {name!r}; supported: {', '.join(SUPPORTED_ARCHS)}")
    arch = ARCHS[name]
    act = config.get("hidden_act") or config.get("hidden_activation") or arch.activation
    if act != arch.activation:
        raise OndeviceError(f"{shown(path)}: {name} with hidden_act {act!r} is not supported ({arch.activation} only)")
    scaling = config.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ("default", "linear"):
        raise OndeviceError(f"{shown(path)}: rope_scaling type {kind!r} is not supported (default, linear)")
    if name == "gemma3_text":
        hd = head_dim(config)
        if float(config.get("query_pre_attn_scalar", hd)) != hd:
            raise OndeviceError(f"{shown(path)}: query_pre_attn_scalar {config['query_pre_attn_scalar']} != head_dim {hd}; "
                                "llama.cpp scales queries by head_dim")
        if config.get("attn_logit_softcapping"):
            raise OndeviceError(f"{shown(path)}: attn_logit_softcapping is not supported for gemma3")
    if name in ("qwen2", "qwen3") and config.get("use_sliding_window"):
        raise OndeviceError(f"{shown(path)}: {name} with use_sliding_window is not supported (llama.cpp ignores it)")
    return arch


def head_dim(config: dict) -> int:
    return int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])


def _swa_layers(config: dict) -> list[bool] | None:
    """Per layer: True for sliding-window attention (gemma3), from ``layer_types`` or the pattern."""
    n = int(config["num_hidden_layers"])
    if config.get("layer_types"):
        return [t == "sliding_attention" for t in config["layer_types"]]
    pattern = config.get("sliding_window_pattern", 6)
    return [(i + 1) % pattern != 0 for i in range(n)] if pattern else None


def write_hparams(w, config: dict, arch: Arch, n_vocab: int) -> None:
    """Write the architecture's hyperparameters into ``gguf.GGUFWriter`` ``w``."""
    import gguf

    n_head = int(config["num_attention_heads"])
    hd = head_dim(config)
    w.add_context_length(int(config.get("max_position_embeddings", 2048)))
    w.add_embedding_length(int(config["hidden_size"]))
    w.add_block_count(int(config["num_hidden_layers"]))
    w.add_feed_forward_length(int(config["intermediate_size"]))
    w.add_head_count(n_head)
    w.add_head_count_kv(int(config.get("num_key_value_heads") or n_head))
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(float(config.get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-6)))
    if hd != int(config["hidden_size"]) // n_head or arch.gguf_arch in ("QWEN3", "GEMMA3"):
        w.add_key_length(hd)
        w.add_value_length(hd)
    scaling = config.get("rope_scaling") or {}
    if scaling.get("rope_type", scaling.get("type")) == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(scaling["factor"]))
    if arch.gguf_arch == "GEMMA3":
        swa = _swa_layers(config)
        if config.get("sliding_window") and swa and any(swa):
            w.add_sliding_window(int(config["sliding_window"]))
            w.add_sliding_window_pattern(swa)
            w.add_rope_freq_base_swa(float(config.get("rope_local_base_freq", 10000.0)))
        if config.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(float(config["final_logit_softcapping"]))
    w.add_vocab_size(n_vocab)


def _permute_qk(t: np.ndarray, n_head: int) -> np.ndarray:
    """HF rotate-half rows → llama.cpp's interleaved rope rows (per head: new 2i = old i, new 2i+1 = old i+d/2)."""
    rows = t.shape[0]
    return t.reshape(n_head, 2, rows // n_head // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)


def gguf_names(ckpt, arch: Arch) -> dict[str, str]:
    """HF tensor name → GGUF tensor name for every tensor of ``ckpt`` (``gguf``'s TensorNameMap).

    Raises:
        OndeviceError: naming the first tensor ``gguf``'s tables have no name for in this architecture,
            or whose name is not among ``gguf.MODEL_TENSORS`` of the target arch (llama.cpp would not load it).
    """
    import gguf

    march = gguf.MODEL_ARCH[arch.gguf_arch]
    n_layers = int(ckpt.config["num_hidden_layers"])
    table = gguf.get_tensor_name_map(march, n_layers)
    allowed = {gguf.TENSOR_NAMES[t].format(bid=b) for t in gguf.MODEL_TENSORS[march] for b in range(n_layers)}
    out = {}
    for hf_name in ckpt.tensor_names():
        if hf_name.endswith("rotary_emb.inv_freq"):
            continue
        name = table.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None or name.rsplit(".", 1)[0] not in allowed:
            raise OndeviceError(f"{shown(ckpt.path)}: tensor {hf_name} has no GGUF name for architecture {ckpt.arch} "
                                "(gguf's TensorNameMap); this checkpoint has parts llama.cpp would not load")
        out[hf_name] = name
    return out


def _heads(config: dict, gguf_name: str) -> int | None:
    """The head count a Q or K tensor's rows are grouped by (for the rope permutation); else None."""
    n_head = int(config["num_attention_heads"])
    if ".attn_q." in gguf_name:
        return n_head
    if ".attn_k." in gguf_name:
        return int(config.get("num_key_value_heads") or n_head)
    return None


def gguf_tensors(ckpt, arch: Arch) -> Iterator[tuple[str, np.ndarray]]:
    """(GGUF name, float32 array in llama.cpp's layout) for every tensor of an HF checkpoint."""
    names = gguf_names(ckpt, arch)
    for hf_name, t in ckpt.tensors():
        if hf_name not in names:
            continue
        name = names[hf_name]
        t = np.asarray(t, dtype=np.float32)
        heads = _heads(ckpt.config, name) if arch.permute_qk else None
        if heads:
            t = _permute_qk(t, heads)
        if arch.norm_offset and name.endswith("norm.weight"):
            t = t + arch.norm_offset
        yield name, t


def from_gguf_layout(config: dict, arch: Arch, gguf_name: str, t: np.ndarray) -> np.ndarray:
    """Inverse of the quirks ``gguf_tensors`` applies: llama.cpp's layout → HF's, for one tensor."""
    from ondevice.formats.gguf import unpermute_rows

    heads = _heads(config, gguf_name) if arch.permute_qk else None
    if heads:
        t = unpermute_rows(t, heads)
    if arch.norm_offset and gguf_name.endswith("norm.weight"):
        t = t - arch.norm_offset
    return t
