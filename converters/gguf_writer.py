"""Writing GGUF from an HF checkpoint with ``gguf``, then quantizing with llama.cpp's own quantizer."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from converters.hf import HFCheckpoint
from converters.quantize import FTYPES
from converters.tokenizer import Vocab
from ondevice.errors import OndeviceError

QUANTS = FTYPES  # --quant name → llama_ftype (llama.h); f16 is written directly by gguf
MAIN_TYPE = {"f16": "F16", "q8_0": "Q8_0", "q4_0": "Q4_0", "iq4_nl": "IQ4_NL", "q4_k_m": "Q4_K"}


def _permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF rotate-half rows → llama.cpp's interleaved rope rows (per head: new 2i = old i, new 2i+1 = old i+d/2)."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(
    ckpt: HFCheckpoint, vocab: Vocab, out: Path, *, on_tensor: Callable[[str], None] | None = None
) -> dict[str, int]:
    """Write ``ckpt`` as an F16 GGUF (norms and biases F32) at ``out``.

    Returns:
        Parameter count per GGUF tensor name.
    """
    import gguf

    cfg = ckpt.config
    arch = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2}[ckpt.arch]
    n_layers = int(cfg["num_hidden_layers"])
    n_head = int(cfg["num_attention_heads"])
    n_kv = int(cfg.get("num_key_value_heads", n_head))
    names = gguf.get_tensor_name_map(arch, n_layers)

    w = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[arch])
    w.add_name(cfg.get("_name_or_path") or ckpt.path.name)
    w.add_context_length(int(cfg.get("max_position_embeddings", 2048)))
    w.add_embedding_length(int(cfg["hidden_size"]))
    w.add_block_count(n_layers)
    w.add_feed_forward_length(int(cfg["intermediate_size"]))
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_rope_dimension_count(ckpt.head_dim)
    w.add_rope_freq_base(float(cfg.get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-6)))
    if ckpt.arch == "llama" and cfg.get("head_dim"):
        w.add_key_length(ckpt.head_dim)
        w.add_value_length(ckpt.head_dim)
    w.add_vocab_size(len(vocab.tokens))
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)

    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(vocab.pre)
    w.add_token_list(vocab.tokens)
    w.add_token_types(vocab.types)
    w.add_token_merges(vocab.merges)
    if vocab.bos_id is not None:
        w.add_bos_token_id(vocab.bos_id)
    if vocab.eos_id is not None:
        w.add_eos_token_id(vocab.eos_id)
    w.add_add_bos_token(vocab.add_bos)
    if vocab.chat_template:
        w.add_chat_template(vocab.chat_template)

    counts: dict[str, int] = {}
    for hf_name, t in ckpt.tensors():
        if hf_name.endswith("rotary_emb.inv_freq"):
            continue
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise OndeviceError(f"{ckpt.path}: tensor {hf_name} has no GGUF name for arch {ckpt.arch}")
        t = np.asarray(t, dtype=np.float32)
        if ckpt.arch == "llama" and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            t = _permute_qk(t, n_head)
        elif ckpt.arch == "llama" and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            t = _permute_qk(t, n_kv)
        t = t.astype(np.float16) if t.ndim >= 2 else t  # llama.cpp wants 1-D tensors in F32
        w.add_tensor(name, np.ascontiguousarray(t))
        counts[name] = int(t.size)
        if on_tensor:
            on_tensor(name)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return counts


def quantize(src: Path, dst: Path, quant: str, threads: int = 0) -> None:
    """Quantize GGUF ``src`` to ``dst`` with llama.cpp's ``llama_model_quantize``."""
    from converters.quantize import llama_quantize

    llama_quantize(src, dst, quant, threads=threads)


def tensor_types(path: Path) -> dict[str, str]:
    """GGUF tensor name → type name (e.g. ``Q4_K``)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    return {t.name: t.tensor_type.name for t in reader.tensors}


# Types llama.cpp's own mixture uses on purpose for each --quant (q4_k_m puts Q6_K on the output and on
# some attn_v/ffn_down; every ftype but f16/q8_0 gives the output matrix Q6_K).
INTENDED = {"f16": {"F16"}, "q8_0": {"Q8_0"}, "q4_0": {"Q4_0", "Q6_K"}, "iq4_nl": {"IQ4_NL", "Q5_K", "Q6_K"},
            "q4_k_m": {"Q4_K", "Q5_K", "Q6_K"}}


def fallbacks(types: dict[str, str], quant: str) -> dict[str, str]:
    """2-D weight tensors that fell back to a type outside the quant's intended mixture (llama.cpp does
    this when a row length is not a multiple of the block size, e.g. Q5_0 instead of Q4_K)."""
    return {n: t for n, t in types.items() if t not in INTENDED[quant] | {"F32"} and not n.endswith(".bias")}
