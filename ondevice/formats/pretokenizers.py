"""Byte-level BPE pre-tokenizers by the name llama.cpp gives them (GGUF ``tokenizer.ggml.pre``).

Each name is one that llama.cpp 0.3.36 accepts: taken from the ``tokenizer_pre == "..."`` branches of
its ``src/llama-vocab.cpp`` (llama.cpp refuses anything else with "unknown pre-tokenizer type"). The
value is the HF ``tokenizer.json`` ``pre_tokenizer`` that splits text the same way; the tests write a
GGUF with each and compare llama.cpp's tokenization with the HF tokenizer's on a multilingual probe.
"""

from __future__ import annotations

QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
TEKKEN_REGEX = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|"
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|"
    r"\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _bytelevel(use_regex: bool) -> dict:
    return {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": use_regex}


def _split(regex: str) -> dict:
    return {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}


# llama.cpp pre-tokenizer name → HF pre_tokenizer JSON.
PRE_TOKENIZERS: dict[str, dict] = {
    "gpt-2": _bytelevel(True),  # GPT-2 and its many small descendants (llama.cpp refuses "gpt2")
    "smollm": {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True}, _bytelevel(True)]},
    "qwen2": {"type": "Sequence", "pretokenizers": [_split(QWEN2_REGEX), _bytelevel(False)]},  # Qwen2, 2.5, 3
    "llama-bpe": {"type": "Sequence", "pretokenizers": [_split(LLAMA3_REGEX), _bytelevel(False)]},  # Llama 3.x
    "tekken": {"type": "Sequence", "pretokenizers": [_split(TEKKEN_REGEX), _bytelevel(False)]},  # Mistral-Nemo
}
# Pre-tokenizers whose BPE model ignores merges for whole-word vocabulary hits (llama-vocab.cpp: ignore_merges).
IGNORE_MERGES = {"llama-bpe", "tekken"}
