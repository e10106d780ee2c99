"""SentencePiece tokenizers (Llama 2, Mistral 7B, TinyLlama, Gemma) → GGUF ``llama``: from tokenizer.json or,
when a checkpoint has only that, from ``tokenizer.model`` itself (read with ``sentencepiece``).

HF writes a SentencePiece BPE model as a ``BPE`` model with ``byte_fallback`` (pieces ``<0x00>``…``<0xFF>``),
spaces turned into "▁" by a normalizer (``Replace``, with a ``Prepend("▁")`` when SentencePiece adds a
space prefix) or by a ``Metaspace`` pre-tokenizer, and merges listing every pair of pieces whose
concatenation is a piece, in the order of that piece's score. llama.cpp's SentencePiece tokenizer
merges the adjacent pair whose concatenation has the highest score, so a piece's score is minus the
rank of the first merge that makes it: the same order as HF's merges.
"""

from __future__ import annotations

from pathlib import Path

from ondevice.errors import OndeviceError, shown

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


def read_model_file(path: Path) -> dict:
    """A SentencePiece ``tokenizer.model`` (BPE, byte fallback, identity normalizer) as GGUF vocabulary facts.

    Returns:
        {"tokens", "types", "scores", "add_space_prefix", "bos_id", "eos_id", "unk_id", "pad_id"}.
    Raises:
        OndeviceError: for a model llama.cpp's SentencePiece tokenizer would not reproduce.
    """
    try:
        import sentencepiece
        from sentencepiece import sentencepiece_model_pb2
    except ImportError as e:
        raise OndeviceError(f"{shown(path)}: reading tokenizer.model needs sentencepiece (pip install sentencepiece)") from e
    import gguf

    proto = sentencepiece_model_pb2.ModelProto()
    try:
        proto.ParseFromString(path.read_bytes())
    except Exception as e:  # protobuf's DecodeError and friends
        raise OndeviceError(f"{shown(path)}: not a SentencePiece model ({e})") from e
    norm = proto.normalizer_spec
    kind = sentencepiece_model_pb2.TrainerSpec.ModelType.Name(proto.trainer_spec.model_type)
    if kind != "BPE" or not proto.trainer_spec.byte_fallback:
        raise OndeviceError(f"{shown(path)}: SentencePiece {kind} model{'' if proto.trainer_spec.byte_fallback else ' without byte fallback'}"
                            " is not supported (BPE with byte_fallback, as Llama 2 / Mistral / Gemma)")
    if norm.name not in ("identity", "") or norm.remove_extra_whitespaces:
        raise OndeviceError(f"{shown(path)}: SentencePiece normalizer {norm.name!r} (remove_extra_whitespaces="
                            f"{norm.remove_extra_whitespaces}) is not reproduced by llama.cpp; identity only")
    sp = sentencepiece.SentencePieceProcessor(model_proto=path.read_bytes())
    types = []
    for i in range(sp.vocab_size()):
        types.append(int(gguf.TokenType.UNKNOWN if sp.is_unknown(i) else gguf.TokenType.CONTROL if sp.is_control(i)
                         else gguf.TokenType.UNUSED if sp.is_unused(i) else gguf.TokenType.BYTE if sp.is_byte(i)
                         else gguf.TokenType.NORMAL))
    ids = {k: getattr(sp, f"{k}_id")() for k in ("bos", "eos", "unk", "pad")}
    return {"tokens": [sp.id_to_piece(i) for i in range(sp.vocab_size())], "types": types,
            "scores": [float(sp.get_score(i)) for i in range(sp.vocab_size())],
            "add_space_prefix": bool(norm.add_dummy_prefix), **{f"{k}_id": (v if v >= 0 else None) for k, v in ids.items()}}


def encode(path: Path, text: str) -> list[int]:
    """``tokenizer.model``'s own ids for ``text`` (no BOS/EOS)."""
    import sentencepiece

    return list(sentencepiece.SentencePieceProcessor(model_file=str(path)).encode(text))
