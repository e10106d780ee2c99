"""Tokenizer facts shared by the converters: HF tokenizer.json ⇄ GGUF vocab keys.

Byte-level BPE: GGUF stores only the *name* of the pre-tokenizer (``tokenizer.ggml.pre``), and llama.cpp
knows each name by a regex of its own. ``PRE_TOKENIZERS`` (``ondevice.formats.pretokenizers``) maps the
names llama.cpp 0.3.36 accepts to the HF ``pre_tokenizer`` each stands for; it is used both ways: to name
an HF tokenizer when writing GGUF, and to rebuild a ``tokenizer.json`` from a GGUF vocab. SentencePiece
tokenizers (tokenizer.json with byte fallback, or tokenizer.model alone): ``converters/spm.py``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from ondevice.errors import OndeviceError, shown
from ondevice.formats.pretokenizers import IGNORE_MERGES, PRE_TOKENIZERS


def _canon(pre: dict | None) -> str:
    """Canonical form for comparing pre-tokenizers: drop flags that do not change the split."""

    def strip(node):
        if isinstance(node, dict):
            return {k: strip(v) for k, v in sorted(node.items()) if k not in ("trim_offsets", "prepend_scheme")}
        if isinstance(node, list):
            return [strip(v) for v in node]
        return node

    return json.dumps(strip(pre), sort_keys=True)


def pre_tokenizer_name(tokenizer_json: dict, source: Path) -> str:
    """Name an HF byte-level BPE pre-tokenizer the way llama.cpp does, or refuse clearly."""
    pre = _canon(tokenizer_json.get("pre_tokenizer"))
    for name, spec in PRE_TOKENIZERS.items():
        if _canon(spec) == pre:
            return name
    found = tokenizer_json.get("pre_tokenizer")
    raise OndeviceError(
        f"{source}: unknown byte-level pre-tokenizer {_describe(found)}; known: {', '.join(PRE_TOKENIZERS)} "
        "(add it to PRE_TOKENIZERS in ondevice/formats/pretokenizers.py under the name llama.cpp gives it)"
    )


def _describe(pre: dict | None) -> str:
    """A short description of an HF pre_tokenizer for error messages (types and regexes, cut)."""
    if not isinstance(pre, dict):
        return repr(pre)
    if pre.get("type") == "Sequence":
        return "Sequence[" + ", ".join(_describe(p) for p in pre.get("pretokenizers", [])) + "]"
    pattern = (pre.get("pattern") or {}).get("Regex") or (pre.get("pattern") or {}).get("String")
    return pre.get("type", "?") + (f"({pattern[:40]!r}…)" if pattern else "")


@dataclass
class Vocab:
    """A vocabulary as GGUF stores it: byte-level BPE (``model="gpt2"``) or SentencePiece (``"llama"``)."""

    tokens: list[str]
    types: list[int]  # gguf.TokenType values
    merges: list[str]  # "a b" (BPE)
    pre: str | None  # llama.cpp pre-tokenizer name (BPE)
    bos_id: int | None
    eos_id: int | None
    add_bos: bool
    chat_template: str | None
    model: str = "gpt2"
    scores: list[float] = field(default_factory=list)  # SentencePiece merge priority (higher first)
    add_space_prefix: bool = False  # SentencePiece: prepend "▁" to the text
    add_eos: bool = False
    unk_id: int | None = None
    pad_id: int | None = None

    def sha256(self) -> str:
        """Identity of the vocabulary: token text and type, in id order."""
        h = hashlib.sha256()
        for t, ty in zip(self.tokens, self.types, strict=True):
            h.update(t.encode("utf-8", "surrogatepass") + b"\x00" + str(ty).encode() + b"\n")
        return h.hexdigest()


def read_hf_vocab(model_dir: Path, vocab_size: int, config: dict) -> Vocab:
    """Read tokenizer.json (+ tokenizer_config.json) of an HF checkpoint into GGUF form.

    Byte-level BPE becomes GGUF ``gpt2`` with its llama.cpp pre-tokenizer name; BPE with byte fallback
    and a "▁" space (SentencePiece exported to tokenizer.json: Llama 2, Mistral 7B, TinyLlama, Gemma)
    becomes GGUF ``llama`` with scores. Anything else is refused, naming what was found.

    Args:
        model_dir: the checkpoint directory.
        vocab_size: rows of the embedding; the token list is padded with ``[PAD{i}]`` to match.
        config: parsed config.json (for bos/eos ids when tokenizer_config lacks them).
    """
    import gguf

    from converters import spm

    tj_path = model_dir / "tokenizer.json"
    tc_path = model_dir / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text(encoding="utf-8")) if tc_path.is_file() else {}
    if not tj_path.is_file():
        if (model_dir / "tokenizer.model").is_file():
            return _sentencepiece_model_vocab(model_dir / "tokenizer.model", vocab_size, tc)
        raise OndeviceError(f"{shown(tj_path)}: missing; the converter needs the HF tokenizer (tokenizer.json or tokenizer.model)")
    try:
        tj = json.loads(tj_path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise OndeviceError(f"{shown(tj_path)}: not valid JSON ({e})") from e
    model = tj.get("model") or {}
    if model.get("type") != "BPE":
        raise OndeviceError(f"{shown(tj_path)}: tokenizer model {model.get('type')!r} is not supported "
                            "(byte-level BPE, or SentencePiece BPE with byte fallback)")
    sentencepiece = spm.is_sentencepiece(tj)
    pre = None if sentencepiece else pre_tokenizer_name(tj, tj_path)

    by_id: dict[int, tuple[str, int]] = {i: (t, gguf.TokenType.NORMAL) for t, i in model["vocab"].items()}
    if sentencepiece:
        by_id.update(spm.token_types(model))
    for added in tj.get("added_tokens", []):
        ty = gguf.TokenType.CONTROL if added.get("special") else gguf.TokenType.USER_DEFINED
        if sentencepiece and added["content"] == model.get("unk_token"):
            ty = gguf.TokenType.UNKNOWN
        by_id[added["id"]] = (added["content"], ty)
    n = max(vocab_size, max(by_id) + 1)
    if n > vocab_size:
        raise OndeviceError(f"{shown(tj_path)}: tokenizer has {n} tokens but the model's embedding has {vocab_size} rows")
    tokens, types = [], []
    for i in range(n):
        t, ty = by_id.get(i, (f"[PAD{i}]", gguf.TokenType.UNUSED))
        tokens.append(t)
        types.append(int(ty))
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    index = {t: i for i, t in reversed(list(enumerate(tokens)))}

    def special_id(key: str, cfg_key: str | None = None) -> int | None:
        tok = tc.get(key)
        if isinstance(tok, dict):
            tok = tok.get("content")
        if isinstance(tok, str) and tok in index:
            return index[tok]
        v = config.get(cfg_key) if cfg_key else None
        return v[0] if isinstance(v, list) else v

    template = tc.get("chat_template")
    if isinstance(template, list):  # named templates: keep the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    bos_id = special_id("bos_token", "bos_token_id")
    add_bos, add_eos = _adds_special(tj, tc, "bos"), _adds_special(tj, tc, "eos")
    vocab = Vocab(tokens, types, merges, pre, bos_id, special_id("eos_token", "eos_token_id"), add_bos, template,
                  add_eos=add_eos, pad_id=special_id("pad_token"))
    if sentencepiece:
        vocab.model = "llama"
        vocab.scores = spm.scores(model, tokens, merges)
        vocab.add_space_prefix = spm.adds_space_prefix(tj)
        vocab.unk_id = index.get(model.get("unk_token") or "<unk>")
    return vocab


def _sentencepiece_model_vocab(path: Path, vocab_size: int, tc: dict) -> Vocab:
    """A checkpoint with only ``tokenizer.model``: its pieces, scores and types, as llama.cpp's converter reads them."""
    import gguf

    from converters import spm

    m = spm.read_model_file(path)
    n = len(m["tokens"])
    if n > vocab_size:
        raise OndeviceError(f"{shown(path)}: tokenizer has {n} tokens but the model's embedding has {vocab_size} rows")
    pad = range(n, vocab_size)
    template = tc.get("chat_template") if isinstance(tc.get("chat_template"), str) else None
    return Vocab(m["tokens"] + [f"[PAD{i}]" for i in pad], m["types"] + [int(gguf.TokenType.UNUSED)] * len(pad), [], None,
                 m["bos_id"], m["eos_id"], bool(tc.get("add_bos_token", True)), template, model="llama",
                 scores=m["scores"] + [-1e9] * len(pad), add_space_prefix=m["add_space_prefix"],
                 add_eos=bool(tc.get("add_eos_token", False)), unk_id=m["unk_id"], pad_id=m["pad_id"])


def _adds_special(tj: dict, tc: dict, which: str) -> bool:
    """Does the HF tokenizer add BOS (or EOS) by default? ``add_<which>_token`` in tokenizer_config.json
    when present, else the post-processor's template (a special token first for BOS, last for EOS)."""
    if f"add_{which}_token" in tc:
        return bool(tc[f"add_{which}_token"])
    post = tj.get("post_processor") or {}
    steps = post.get("processors", [post]) if post.get("type") == "Sequence" else [post]
    for step in steps:
        single = step.get("single") if step.get("type") == "TemplateProcessing" else None
        if single:
            edge = single[0] if which == "bos" else single[-1]
            return "SpecialToken" in edge
    return False


def read_gguf_vocab(g) -> Vocab:
    """The vocabulary of a ``GGUFFile`` (byte-level BPE only)."""
    tokens = g.tokens
    types = [int(t) for t in (g.get("tokenizer.ggml.token_type") or [1] * len(tokens))]
    merges = list(g.get("tokenizer.ggml.merges") or [])
    pre = str(g.get("tokenizer.ggml.pre") or "default")
    if pre not in PRE_TOKENIZERS:
        raise OndeviceError(
            f"{shown(g.path)}: pre-tokenizer {pre!r} is not in our table ({', '.join(PRE_TOKENIZERS)}); "
            "add it to PRE_TOKENIZERS in ondevice/formats/pretokenizers.py under the name llama.cpp gives it"
        )
    bos, eos = g.get("tokenizer.ggml.bos_token_id"), g.get("tokenizer.ggml.eos_token_id")
    return Vocab(tokens, types, merges, pre, None if bos is None else int(bos), None if eos is None else int(eos),
                 bool(g.get("tokenizer.ggml.add_bos_token", False)), g.get("tokenizer.chat_template"))


def hf_tokenizer_json(v: Vocab) -> dict:
    """A ``tokenizer.json`` equivalent to the GGUF vocabulary ``v``."""
    import gguf

    vocab: dict[str, int] = {}
    added = []
    for i, (t, ty) in enumerate(zip(v.tokens, v.types, strict=True)):
        vocab.setdefault(t, i)
        if ty in (gguf.TokenType.CONTROL, gguf.TokenType.USER_DEFINED):
            added.append({"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": ty == gguf.TokenType.CONTROL})
    post = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    if v.add_bos and v.bos_id is not None:
        bos = v.tokens[v.bos_id]
        post = {"type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                         {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {bos: {"id": bos, "ids": [v.bos_id], "tokens": [bos]}}}
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
        "pre_tokenizer": PRE_TOKENIZERS[v.pre], "post_processor": post,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": v.pre in IGNORE_MERGES, "vocab": vocab, "merges": v.merges},
    }


def write_hf_tokenizer(g, out: Path) -> dict:
    """Write tokenizer.json + tokenizer_config.json for a GGUFFile into ``out``; return facts for the manifest."""
    from tokenizers import Tokenizer

    v = read_gguf_vocab(g)
    tj = hf_tokenizer_json(v)
    text = json.dumps(tj, ensure_ascii=False)
    try:
        Tokenizer.from_str(text)  # validate before writing
    except Exception as e:
        raise OndeviceError(f"{shown(g.path)}: could not rebuild a tokenizer from the GGUF vocabulary ({e})") from e
    (out / "tokenizer.json").write_text(text, encoding="utf-8")
    tc = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": v.tokens[v.bos_id] if v.bos_id is not None else None,
        "eos_token": v.tokens[v.eos_id] if v.eos_id is not None else None,
        "add_bos_token": v.add_bos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(g.get(f"{g.arch}.context_length", 2048)),
    }
    if v.chat_template:
        tc["chat_template"] = v.chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(tc, indent=2, ensure_ascii=False), encoding="utf-8")
    return {"pre": v.pre, "vocab_sha256": v.sha256()}
