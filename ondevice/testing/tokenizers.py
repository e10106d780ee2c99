"""Tiny trained tokenizers for tests, one per family users bring (each as its HF tokenizer.json).

Byte-level BPE families differ in their pre-tokenizer (``gpt-2``, ``smollm``, ``qwen2``, ``llama-bpe``,
``tekken``: the names llama.cpp gives them); SentencePiece families (``llama-spm``: Llama 2 / Mistral 7B /
TinyLlama, space prefix; ``gemma``: no prefix) are BPE with byte fallback, "▁" for spaces, and merges
listing every pair of pieces whose concatenation is a piece, ordered by that piece's id — the layout
HF gives SentencePiece models.
"""

from __future__ import annotations

from ondevice.formats.pretokenizers import IGNORE_MERGES, PRE_TOKENIZERS

BPE_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
SPM_SPECIALS = {"llama-spm": ["<unk>", "<s>", "</s>"], "gemma": ["<pad>", "<eos>", "<bos>", "<unk>"]}

BPE_FAMILIES = tuple(PRE_TOKENIZERS)
FAMILIES = (*BPE_FAMILIES, *SPM_SPECIALS, "spm-model")  # spm-model: a SentencePiece tokenizer.model alone


def specials(family: str) -> list[str]:
    """The special tokens of a family, ids 0, 1, ... (BOS/EOS positions differ: see ``special_ids``)."""
    return SPM_SPECIALS.get("llama-spm" if family == "spm-model" else family, BPE_SPECIALS)


def special_ids(family: str) -> dict[str, int]:
    """bos / eos / pad / unk ids of a family's specials (absent keys: none)."""
    if family in ("llama-spm", "spm-model"):
        return {"unk": 0, "bos": 1, "eos": 2}
    if family == "gemma":
        return {"pad": 0, "eos": 1, "bos": 2, "unk": 3}
    return {"bos": 0, "eos": 2, "pad": 0}


def train(family: str, vocab_size: int = 512):
    """A ``tokenizers.Tokenizer`` of exactly ``vocab_size`` tokens, trained on the test corpus."""
    import json

    from ondevice.testing.corpus import corpus

    if family in SPM_SPECIALS:
        return _train_spm(family, vocab_size)
    if family not in BPE_FAMILIES:
        raise ValueError(f"unknown tokenizer family {family!r}; one of {', '.join(FAMILIES)}")
    from tokenizers import Tokenizer, decoders, pre_tokenizers, trainers

    skeleton = {"version": "1.0", "pre_tokenizer": PRE_TOKENIZERS[family],
                "model": {"type": "BPE", "vocab": {}, "merges": [], "ignore_merges": family in IGNORE_MERGES}}
    tok = Tokenizer.from_str(json.dumps(skeleton))
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=BPE_SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer=trainer)
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"trained {tok.get_vocab_size()} tokens, wanted {vocab_size}")
    return tok


def _train_spm(family: str, vocab_size: int):
    """SentencePiece-style BPE as HF stores it: specials, 256 byte pieces, trained pieces; complete merges."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from ondevice.testing.corpus import corpus

    prefix = family == "llama-spm"
    sp = specials(family)
    n_pieces = vocab_size - len(sp) - 256
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first" if prefix else "never")
    trainer = trainers.BpeTrainer(vocab_size=n_pieces, show_progress=False)
    tok.train_from_iterator(corpus(), trainer=trainer)
    trained = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    if len(trained) != n_pieces:
        raise RuntimeError(f"trained {len(trained)} pieces, wanted {n_pieces}")
    vocab = {t: i for i, t in enumerate(sp)}
    vocab.update({f"<0x{b:02X}>": len(sp) + b for b in range(256)})
    for piece, _ in trained:
        vocab[piece] = len(vocab)
    merges = sorted(((piece[:k], piece[k:]) for piece in vocab if len(piece) > 1 and not piece.startswith("<")
                     for k in range(1, len(piece)) if piece[:k] in vocab and piece[k:] in vocab),
                    key=lambda ab: (vocab[ab[0] + ab[1]], vocab[ab[0]], vocab[ab[1]]))
    ids = special_ids(family)
    bos = sp[ids["bos"]]
    normalizer = {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}
    if prefix:
        normalizer = {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "▁"}, normalizer]}
    decoders = [{"type": "Replace", "pattern": {"String": "▁"}, "content": " "}, {"type": "ByteFallback"}, {"type": "Fuse"}]
    if prefix:
        decoders.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    tj = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True} for i, t in enumerate(sp)],
        "normalizer": normalizer, "pre_tokenizer": None,
        "post_processor": {"type": "TemplateProcessing",
                           "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                           "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                                    {"Sequence": {"id": "B", "type_id": 1}}],
                           "special_tokens": {bos: {"id": bos, "ids": [ids["bos"]], "tokens": [bos]}}},
        "decoder": {"type": "Sequence", "decoders": decoders},
        "model": {"type": "BPE", "dropout": None, "unk_token": sp[ids["unk"]], "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                  "vocab": vocab, "merges": [[a, b] for a, b in merges]},
    }
    return Tokenizer.from_str(json.dumps(tj, ensure_ascii=False))


def train_sentencepiece_model(vocab_size: int = 512) -> bytes:
    """A SentencePiece ``tokenizer.model`` as Llama 2's: BPE, byte fallback, identity normalizer, space prefix."""
    import io

    import sentencepiece

    from ondevice.testing.corpus import corpus

    f = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus()), model_writer=f, model_type="bpe", vocab_size=vocab_size, byte_fallback=True,
        character_coverage=1.0, normalization_rule_name="identity", remove_extra_whitespaces=False,
        add_dummy_prefix=True, split_digits=True, minloglevel=2)
    return f.getvalue()
