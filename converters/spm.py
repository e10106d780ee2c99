"""SentencePiece tokenizers exported to tokenizer.json (Llama 2, Mistral 7B, TinyLlama, Gemma) → GGUF ``llama``.

HF writes a SentencePiece BPE model as a ``BPE`` model with ``byte_fallback`` (pieces ``<0x00>``…``<0xFF>``),
spaces turned into "▁" by a normalizer (``Replace``, with a ``Prepend("▁")`` when SentencePiece adds a
space prefix) or by a ``Metaspace`` pre-tokenizer, and merges listing every pair of pieces whose
concatenation is a piece, in the order of that piece's score. llama.cpp's SentencePiece tokenizer
merges the adjacent pair whose concatenation has the highest score, so a piece's score is minus the
rank of the first merge that makes it: the same order as HF's merges.
"""

from __future__ import annotations

SPACE = "▁"


def is_sentencepiece(tj: dict) -> bool:
    """A BPE tokenizer.json that came from SentencePiece: byte fallback and "▁" for spaces, no ByteLevel."""
    model = tj.get("model") or {}
    if not model.get("byte_fallback"):
        return False
    text = repr(tj.get("pre_tokenizer")) + repr(tj.get("normalizer"))
    return SPACE in text and "ByteLevel" not in text


def adds_space_prefix(tj: dict) -> bool:
    """Does the tokenizer put "▁" before the text (SentencePiece ``add_dummy_prefix``)?"""

    def walk(node) -> bool:
        if isinstance(node, list):
            return any(walk(n) for n in node)
        if not isinstance(node, dict):
            return False
        kind = node.get("type")
        if kind == "Prepend":
            return node.get("prepend") == SPACE
        if kind == "Metaspace":
            return node.get("prepend_scheme", "always" if node.get("add_prefix_space", True) else "never") != "never"
        return walk(node.get("normalizers") or node.get("pretokenizers") or [])

    return walk(tj.get("normalizer")) or walk(tj.get("pre_tokenizer"))


def token_types(model: dict) -> dict[int, tuple[str, int]]:
    """id → (piece, gguf.TokenType) for the pieces whose type is not NORMAL: byte pieces and the unknown piece."""
    import gguf

    out = {}
    unk = model.get("unk_token")
    for piece, i in model["vocab"].items():
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            out[i] = (piece, gguf.TokenType.BYTE)
        elif piece == unk:
            out[i] = (piece, gguf.TokenType.UNKNOWN)
    return out


def scores(model: dict, tokens: list[str], merges: list[str]) -> list[float]:
    """Per token id, llama.cpp's merge priority: −(rank of the first merge producing it); others −(n + id)."""
    first: dict[str, int] = {}
    for rank, m in enumerate(merges):
        a, _, b = m.partition(" ")
        first.setdefault(a + b, rank)
    n = len(merges)
    return [float(-first[t]) if t in first else float(-(n + i)) for i, t in enumerate(tokens)]
