"""Reading an EAGLE-3 draft checkpoint (safetensors only) in either published layout, checked on its own.

SafeAILab / SpecForge: ``midlayer.*``, a llama config with ``num_hidden_layers: 1`` and ``draft_vocab_size``;
RedHat speculators: ``layers.0.*``, the layer config nested in ``transformer_layer_config``. Both become one
canonical naming (the decoder layer under ``layer.``). A pickle checkpoint is refused unread.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from converters.lazy import DTYPES, as_float32
from ondevice.errors import OndeviceError

LAYER = ("input_layernorm", "hidden_norm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
         "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
# our canonical name (layer tensors under "layer.") → GGUF name, as llama.cpp's conversion names them
GGUF_NAMES = {
    "layer.input_layernorm.weight": "blk.0.attn_norm.weight",
    "layer.hidden_norm.weight": "blk.0.attn_norm_2.weight",
    "layer.post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
    "layer.self_attn.q_proj.weight": "blk.0.attn_q.weight",
    "layer.self_attn.k_proj.weight": "blk.0.attn_k.weight",
    "layer.self_attn.v_proj.weight": "blk.0.attn_v.weight",
    "layer.self_attn.o_proj.weight": "blk.0.attn_output.weight",
    "layer.mlp.gate_proj.weight": "blk.0.ffn_gate.weight",
    "layer.mlp.up_proj.weight": "blk.0.ffn_up.weight",
    "layer.mlp.down_proj.weight": "blk.0.ffn_down.weight",
    "fc.weight": "fc.weight",
    "norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "embed_tokens.weight": "token_embd.weight",
    "input_norm.weight": "enc.output_norm.weight",
}
PICKLES = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "model.pth", "training_args.bin")


def config_names(path: str | Path, key: str) -> bool:
    """Whether directory ``path`` has a config.json (valid JSON) that names ``key``."""
    cfg = Path(path) / "config.json"
    if not cfg.is_file():
        return False
    try:
        return key in json.loads(cfg.read_text(encoding="utf-8"))
    except ValueError:
        return False


def is_eagle3(path: str | Path) -> bool:
    """Whether directory ``path`` holds an EAGLE-3 draft (its config.json has ``draft_vocab_size``)."""
    return config_names(path, "draft_vocab_size")


def read_config(cfg_path: Path) -> dict:
    """A checkpoint's config.json, parsed; invalid JSON is refused in one line naming the file."""
    try:
        return json.loads(cfg_path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise OndeviceError(f"{cfg_path}: not valid JSON ({e})") from e


def safetensors_files(path: Path, how_to_convert: str) -> list[Path]:
    """The ``*.safetensors`` files of checkpoint directory ``path``, sorted. None: refused in one line, a PyTorch
    pickle checkpoint (never opened) with ``how_to_convert`` it appended to the refusal."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        pickles = [p for p in PICKLES if (path / p).is_file()] or [p.name for p in path.glob("*.bin")]
        if pickles:
            raise OndeviceError(
                f"{path / pickles[0]}: a PyTorch pickle checkpoint, refused (loading one runs arbitrary code); "
                f"convert it to safetensors where you trust it{how_to_convert}")
        raise OndeviceError(f"{path}: no *.safetensors files")
    return files


def check_shapes(src: DraftSource, want: dict[str, tuple[int, ...]], cfg_path: Path, missing: str) -> None:
    """Refuse, in one line, a tensor of ``want`` (canonical name → shape) absent from ``src`` (the error:
    "PATH: tensor NAME ``missing``") or of another shape than the config implies."""
    for name, shape in want.items():
        if name not in src.names:
            raise OndeviceError(f"{src.path}: tensor {name} {missing}")
        got = src.tensors.shape(src.names[name])
        if got != shape:
            raise OndeviceError(f"{src.path}: tensor {src.names[name]} has shape {list(got)}, {cfg_path.name} implies "
                                f"{list(shape)}")


class _Safetensors:
    """Every tensor of some safetensors files, memory-mapped; BOOL (``t2d``) included, unlike
    ``converters.lazy.SafetensorsMap``."""

    def __init__(self, files: list[Path]) -> None:
        self.index: dict[str, tuple[Path, str, tuple[int, ...], int]] = {}
        for f in files:
            try:
                with open(f, "rb") as fh:
                    n = struct.unpack("<Q", fh.read(8))[0]
                    header = json.loads(fh.read(n))
            except (OSError, ValueError, struct.error) as e:
                raise OndeviceError(f"{f}: unreadable safetensors header ({e}); re-download or re-export it") from e
            size = f.stat().st_size
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                if info["dtype"] not in (*DTYPES, "BOOL"):
                    raise OndeviceError(f"{f}: tensor {name} has dtype {info['dtype']}, which cannot be read here")
                if 8 + n + info["data_offsets"][1] > size:
                    raise OndeviceError(f"{f}: truncated ({size} bytes, tensor {name} ends beyond); re-download it")
                self.index[name] = (f, info["dtype"], tuple(info["shape"]), 8 + n + info["data_offsets"][0])

    def shape(self, name: str) -> tuple[int, ...]:
        return self.index[name][2]

    def raw(self, name: str) -> np.ndarray:
        path, dtype, shape, offset = self.index[name]
        np_type = np.bool_ if dtype == "BOOL" else DTYPES[dtype]
        if int(np.prod(shape)) == 0:
            return np.zeros(shape, np_type)
        return np.memmap(path, dtype=np_type, mode="r", offset=offset, shape=shape)

    def float32(self, name: str) -> np.ndarray:
        return as_float32(self.raw(name), self.index[name][1])


class DraftSource:
    """What a draft checkpoint read from safetensors answers (``config``, ``names``, ``tensors``): its tensors by
    canonical name and its decoder's sizes from a llama-style config (EAGLE-3 and DFlash drafts share them)."""

    config: dict
    names: dict[str, str]
    tensors: _Safetensors

    def float32(self, name: str) -> np.ndarray:
        """A tensor by canonical name, as float32 in the checkpoint's (HF) layout."""
        return self.tensors.float32(self.names[name])

    def has(self, name: str) -> bool:
        return name in self.names

    @property
    def hidden(self) -> int:
        return int(self.config["hidden_size"])

    @property
    def n_heads(self) -> int:
        return int(self.config["num_attention_heads"])

    @property
    def n_kv_heads(self) -> int:
        return int(self.config.get("num_key_value_heads") or self.n_heads)

    @property
    def head_dim(self) -> int:
        return int(self.config.get("head_dim") or self.hidden // self.n_heads)

    @property
    def eps(self) -> float:
        return float(self.config.get("rms_norm_eps", 1e-6))


@dataclass
class Eagle3Source(DraftSource):
    """An EAGLE-3 checkpoint, read and checked on its own (``open_eagle3``).

    Attributes:
        path: the directory.
        layout: "specforge" or "speculators".
        config: the config with ``transformer_layer_config`` merged in (speculators).
        names: our canonical tensor name (``layer.*`` for the decoder layer) → the file's tensor name.
        tensors: the memory-mapped files.
        d2t: absolute target id of each draft-vocabulary row (int64).
    """

    path: Path
    layout: str
    config: dict
    names: dict[str, str]
    tensors: _Safetensors
    d2t: np.ndarray

    @property
    def target_hidden(self) -> int:
        return int(self.config.get("target_hidden_size") or self.hidden)

    @property
    def norm_before_residual(self) -> bool:
        return bool(self.config.get("norm_before_residual", False))

    @property
    def norm_before_fc(self) -> bool:
        return bool(self.config.get("norm_before_fc", False))


def open_eagle3(path: str | Path) -> Eagle3Source:
    """Open an EAGLE-3 checkpoint directory and check it on its own; every problem is one line naming the file.

    Raises:
        OndeviceError: not a directory, no config.json, not an EAGLE-3 config, a pickle checkpoint (never
            unpickled), missing / misshaped tensors, a ``d2t`` out of range or with duplicates.
    """
    path = Path(path)
    if not path.is_dir():
        raise OndeviceError(f"{path}: not a directory; pass the EAGLE-3 checkpoint directory (config.json + *.safetensors)")
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise OndeviceError(f"{cfg_path}: missing; an EAGLE-3 checkpoint needs its config.json")
    raw = read_config(cfg_path)
    config = {**raw, **(raw.get("transformer_layer_config") or {})}
    if "draft_vocab_size" not in config or int(config.get("num_hidden_layers", 0)) != 1:
        raise OndeviceError(f"{cfg_path}: not an EAGLE-3 draft (needs draft_vocab_size and num_hidden_layers: 1)")
    files = safetensors_files(path, ", e.g. python -c \"import torch; from safetensors.torch import save_file; "
                                    "save_file(torch.load('pytorch_model.bin', weights_only=True), 'model.safetensors')\"")
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise OndeviceError(f"{cfg_path}: hidden_act {act!r} is not supported (llama.cpp's eagle3 graph is SiLU)")
    st = _Safetensors(files)
    layout = "speculators" if any(n.startswith("layers.0.") for n in st.index) else "specforge"
    prefix = "layers.0." if layout == "speculators" else "midlayer."
    names: dict[str, str] = {}
    for file_name in st.index:
        if file_name.startswith(prefix):
            names["layer." + file_name[len(prefix):]] = file_name
        elif file_name.removeprefix("model.") in GGUF_NAMES or file_name in ("d2t", "t2d"):
            names[file_name.removeprefix("model.")] = file_name
    src = Eagle3Source(path, layout, config, names, st, np.zeros(0, np.int64))
    _check_shapes(src, cfg_path)
    if "d2t" in names:
        d2t = np.asarray(st.raw(names["d2t"]), dtype=np.int64).reshape(-1)
        src.d2t = d2t + np.arange(d2t.size, dtype=np.int64)
    else:  # a draft over the whole target vocabulary (llama.cpp: no d2t tensor, logits row i is token i)
        src.d2t = np.arange(int(config["draft_vocab_size"]), dtype=np.int64)
    if np.unique(src.d2t).size != src.d2t.size:
        raise OndeviceError(f"{path}: d2t maps two draft tokens to the same target token; the checkpoint is damaged")
    return src


def _check_shapes(src: Eagle3Source, cfg_path: Path) -> None:
    h, th, nh, nkv, hd = src.hidden, src.target_hidden, src.n_heads, src.n_kv_heads, src.head_dim
    f, dv = int(src.config["intermediate_size"]), int(src.config["draft_vocab_size"])
    want = {
        "layer.input_layernorm.weight": (h,), "layer.hidden_norm.weight": (h,),
        "layer.post_attention_layernorm.weight": (h,),
        "layer.self_attn.q_proj.weight": (nh * hd, 2 * h), "layer.self_attn.k_proj.weight": (nkv * hd, 2 * h),
        "layer.self_attn.v_proj.weight": (nkv * hd, 2 * h), "layer.self_attn.o_proj.weight": (h, nh * hd),
        "layer.mlp.gate_proj.weight": (f, h), "layer.mlp.up_proj.weight": (f, h), "layer.mlp.down_proj.weight": (h, f),
        "fc.weight": (h, 3 * th), "norm.weight": (h,), "lm_head.weight": (dv, h), "d2t": (dv,),
    }
    if "d2t" not in src.names and dv == int(src.config.get("vocab_size") or dv):
        del want["d2t"]  # no vocabulary reduction: nothing to map
    if src.norm_before_fc:
        want["input_norm.weight"] = (3 * th,)
    check_shapes(src, want, cfg_path, f"missing from this {src.layout} EAGLE-3 checkpoint; re-download or re-export it")
    extra = sorted(n for n in src.tensors.index if n not in src.names.values() and not n.endswith("rotary_emb.inv_freq"))
    if extra:
        raise OndeviceError(f"{src.path}: tensor {extra[0]} is not part of an EAGLE-3 draft llama.cpp runs; "
                            "refusing rather than dropping it")


@dataclass
class Target:
    """What a draft must match in its target: hidden size, layer count, vocabulary (``target_info``)."""

    path: Path
    arch: str
    hidden: int
    n_layers: int
    vocab: object  # converters.tokenizer.Vocab


def check_vocab(src: DraftSource, target: Target) -> None:
    """Refuse, in one line, a draft whose config names a vocabulary size other than ``target``'s."""
    n_vocab = len(target.vocab.tokens)
    cfg_vocab = int(src.config.get("vocab_size") or n_vocab)
    if cfg_vocab != n_vocab:
        raise OndeviceError(f"{src.path}: made for a vocabulary of {cfg_vocab} tokens, {target.path.name} has "
                            f"{n_vocab}; this draft was made for another target")


def target_info(path: str | Path) -> Target:
    """Read a target's hidden size, layer count and vocabulary from an HF checkpoint directory or a GGUF."""
    from converters.tokenizer import read_gguf_vocab, read_hf_vocab

    path = Path(path)
    if path.is_dir() and (path / "model.gguf").is_file() and not (path / "config.json").is_file():
        path = path / "model.gguf"
    if path.suffix == ".gguf":
        from ondevice.formats.gguf import GGUFFile

        g = GGUFFile(path)
        cfg = g.config()
        return Target(path, g.arch, int(cfg["hidden_size"]), int(cfg["num_hidden_layers"]), read_gguf_vocab(g))
    from converters.hf import open_checkpoint

    ckpt = open_checkpoint(path, quantized=True)  # config and tokenizer only: a 4-bit MLX target is one too
    return Target(path, ckpt.arch, int(ckpt.config["hidden_size"]), int(ckpt.config["num_hidden_layers"]),
                  read_hf_vocab(ckpt.path, ckpt.vocab_size, ckpt.config))


def rope_factors(config: dict) -> np.ndarray | None:
    """llama-3 rope scaling as llama.cpp applies it: one frequency divisor per rotary pair (``rope_freqs``);
    None without llama3 scaling. Other scalings are refused."""
    scaling = config.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return None
    if kind != "llama3":
        raise OndeviceError(f"rope_scaling {kind!r} is not supported for EAGLE-3 drafts (default, llama3)")
    dim = int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
    base = float(config.get("rope_theta", 10000.0))
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    factor = float(scaling.get("factor", 8.0))
    low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
    old = float(scaling.get("original_max_position_embeddings", 8192))
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)
