"""Reading GGUF files: metadata, vocabulary, and an HF-style config for the llama/qwen2 archs."""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from functools import cached_property
from pathlib import Path

import numpy as np

from ondevice.errors import OndeviceError

SUPPORTED = ("llama", "qwen2")
# The HF transformers spelling among the many each GGUF name has in gguf's TensorNameMap.
_HF_SPELLING = re.compile(
    r"^(model\.embed_tokens|model\.norm|lm_head"
    r"|model\.layers\.0\.(self_attn\.[a-z]_(proj|norm)|mlp\.[a-z]+_proj|[a-z_]*layernorm))$"
)


@functools.cache
def _hf_names(arch: str) -> dict[str, str]:
    """GGUF name (block 0 for per-block tensors) → HF name, from gguf's own TensorNameMap for ``arch``."""
    import gguf

    march = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    table = gguf.get_tensor_name_map(march, 1)
    out: dict[str, str] = {}
    for key, (_, gguf_name) in table.mapping.items():
        if gguf_name not in out and _HF_SPELLING.match(key) and table.get_name(key) == gguf_name:
            out[gguf_name] = key
    return out


def hf_name(gguf_name: str, arch: str = "llama") -> str:
    """``blk.3.attn_q.weight`` → ``model.layers.3.self_attn.q_proj.weight`` (via gguf's TensorNameMap)."""
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        base = _hf_names(arch).get(f"blk.0.{parts[2]}")
        if base is None:
            raise KeyError(gguf_name)
        return base.replace("model.layers.0.", f"model.layers.{parts[1]}.", 1) + "." + ".".join(parts[3:])
    base = _hf_names(arch).get(parts[0])
    if base is None:
        raise KeyError(gguf_name)
    return base + "." + ".".join(parts[1:])


class GGUFFile:
    """A GGUF file read with ``gguf``: metadata fields, tensors, and the vocabulary."""

    def __init__(self, path: str | Path) -> None:
        import gguf

        from ondevice.backends.llama import check_gguf_file

        self.path = Path(path)
        check_gguf_file(self.path)
        try:
            self.reader = gguf.GGUFReader(str(self.path))
        except Exception as e:  # gguf raises ValueError/IndexError/struct errors on corrupt files
            raise OndeviceError(f"{self.path}: corrupt GGUF ({type(e).__name__}: {e}); re-download or reconvert it") from e

    def get(self, key: str, default=None):
        field = self.reader.fields.get(key)
        if field is None:
            return default
        return field.contents()

    @cached_property
    def arch(self) -> str:
        return str(self.get("general.architecture"))

    def require_supported(self) -> None:
        if self.arch not in SUPPORTED:
            raise OndeviceError(f"{self.path}: architecture {self.arch!r} is not supported here; supported: {', '.join(SUPPORTED)}")
        model = self.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise OndeviceError(
                f"{self.path}: tokenizer model {model!r} is not supported (only byte-level BPE 'gpt2'; SentencePiece GGUFs such as gemma3 are refused)"
            )

    @cached_property
    def tokens(self) -> list[str]:
        return list(self.get("tokenizer.ggml.tokens") or [])

    def config(self) -> dict:
        """An HF-style config.json for this GGUF (llama / qwen2)."""
        a = self.arch
        names = {t.name for t in self.reader.tensors}
        n_head = int(self.get(f"{a}.attention.head_count"))
        hidden = int(self.get(f"{a}.embedding_length"))
        cfg = {
            "model_type": a,
            "architectures": ["LlamaForCausalLM" if a == "llama" else "Qwen2ForCausalLM"],
            "hidden_size": hidden,
            "intermediate_size": int(self.get(f"{a}.feed_forward_length")),
            "num_hidden_layers": int(self.get(f"{a}.block_count")),
            "num_attention_heads": n_head,
            "num_key_value_heads": int(self.get(f"{a}.attention.head_count_kv", n_head)),
            "rms_norm_eps": float(self.get(f"{a}.attention.layer_norm_rms_epsilon")),
            "rope_theta": float(self.get(f"{a}.rope.freq_base", 10000.0)),
            "max_position_embeddings": int(self.get(f"{a}.context_length", 2048)),
            "vocab_size": len(self.tokens),
            "tie_word_embeddings": "output.weight" not in names,
            "hidden_act": "silu",
        }
        head_dim = self.get(f"{a}.attention.key_length")
        if head_dim and int(head_dim) != hidden // n_head:
            cfg["head_dim"] = int(head_dim)
        bos, eos = self.get("tokenizer.ggml.bos_token_id"), self.get("tokenizer.ggml.eos_token_id")
        if bos is not None:
            cfg["bos_token_id"] = int(bos)
        if eos is not None:
            cfg["eos_token_id"] = int(eos)
        return cfg


def unpermute_rows(a: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of the llama Q/K row permutation (GGUF interleaved rope rows → HF rotate-half rows)."""
    rows = a.shape[0]
    return a.reshape(n_head, rows // n_head // 2, 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)


def llama_permuted_heads(g: GGUFFile, name: str, cfg: dict) -> int | None:
    """For a llama GGUF's Q or K weight, the head count its rows were permuted with; else None."""
    if g.arch == "llama" and (".attn_q." in name or ".attn_k." in name):
        return cfg["num_attention_heads"] if ".attn_q." in name else cfg["num_key_value_heads"]
    return None


def float_tensors(g: GGUFFile) -> Iterator[tuple[str, np.ndarray]]:
    """Every tensor dequantized to float32, in HF layout and under its HF name."""
    import gguf

    cfg = g.config()
    for t in g.reader.tensors:
        arr = np.asarray(gguf.dequantize(t.data, t.tensor_type), dtype=np.float32)
        arr = arr.reshape([int(d) for d in reversed(t.shape)])
        heads = llama_permuted_heads(g, t.name, cfg)
        yield hf_name(t.name, g.arch), unpermute_rows(arr, heads) if heads else arr
