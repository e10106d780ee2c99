"""The vocabulary half of the ``Backend`` protocol over an HF fast tokenizer (MLX and Core ML backends)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from ondevice.backends.base import Backend
from ondevice.errors import OndeviceError


def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable-character ↔ byte table, inverted (byte-level BPE tokens → raw bytes)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


class HFVocab(Backend):
    """Mixin: tokenize, token_bytes, vocab_tokens, is_eog; needs ``vocab_size`` set by the backend."""

    vocab_size: int

    def _init_vocab(self, hf_tokenizer, eog_ids: Iterable[int]) -> None:
        self._hf = hf_tokenizer
        self.bos_id = hf_tokenizer.bos_token_id
        # What the HF tokenizer does with its specials (its post-processor, which add_bos_token updates):
        # PreTrainedTokenizerFast has no add_bos_token attribute yet adds BOS for SentencePiece models.
        self.add_bos = self.bos_id is not None and hf_tokenizer.encode("a", add_special_tokens=True)[:1] == [self.bos_id]
        self.chat_template = getattr(hf_tokenizer, "chat_template", None)
        self._eog = frozenset(int(t) for t in eog_ids)
        self._pieces: dict[int, bytes] | None = None

    def is_eog(self, token: int) -> bool:
        return int(token) in self._eog

    def tokenize(self, text: str, *, add_bos: bool = True, special: bool = True) -> list[int]:
        ids = self._hf.encode(text, add_special_tokens=False, split_special_tokens=not special)
        if add_bos and self.add_bos and (not ids or ids[0] != self.bos_id):
            ids.insert(0, self.bos_id)
        return list(ids)

    def _build_pieces(self) -> dict[int, bytes]:
        dec = _byte_decoder()
        special = set(self._hf.all_special_ids)
        added = {i: t.content for i, t in self._hf.added_tokens_decoder.items()}
        pieces = {}
        for text, i in self._hf.get_vocab().items():
            if i in special or (i in added and getattr(self._hf.added_tokens_decoder[i], "special", False)):
                pieces[i] = b""
            elif i in added:
                pieces[i] = added[i].encode("utf-8")
            else:
                try:
                    pieces[i] = bytes(dec[c] for c in text)
                except KeyError:  # not a byte-level token (e.g. SentencePiece): fall back to its text
                    pieces[i] = text.replace("▁", " ").encode("utf-8")
        return pieces

    def token_bytes(self, token: int) -> bytes:
        if self._pieces is None:
            self._pieces = self._build_pieces()
        return self._pieces.get(int(token), b"")

    def vocab_tokens(self) -> list[str]:
        inv = {i: t for t, i in self._hf.get_vocab().items()}
        return [inv.get(i, f"[PAD{i}]") for i in range(self.vocab_size)]


def no_remote_code(directory: Path, load):
    """``load(trust_remote_code=False)``: an HF tokenizer load that never runs code from the model folder
    (an ``auto_map`` is not followed); a tokenizer that exists only as such code is a one-line error."""
    try:
        return load(trust_remote_code=False)
    except ValueError as e:
        if "trust_remote_code" not in str(e) and "custom code" not in str(e):
            raise
        raise OndeviceError(f"{Path(directory).name}: its tokenizer exists only as Python code in the model folder "
                            "(auto_map); ondevice never runs a model's code, so it cannot load this model") from None


def load_tokenizer(directory: Path) -> tuple[object, set[int]]:
    """``directory``'s HF fast tokenizer and its end-of-generation ids (config, generation config, tokenizer).
    No code from the folder runs (``no_remote_code``)."""
    if not (directory / "tokenizer.json").is_file():
        raise OndeviceError(f"{directory / 'tokenizer.json'}: missing; the model directory needs its tokenizer")
    from transformers import AutoTokenizer

    tok = no_remote_code(directory, lambda **kw: AutoTokenizer.from_pretrained(str(directory), **kw))
    eog: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        f = directory / name
        if f.is_file():
            e = json.loads(f.read_text()).get("eos_token_id")
            eog.update([e] if isinstance(e, int) else (e or []))
    if tok.eos_token_id is not None:
        eog.add(int(tok.eos_token_id))
    return tok, eog
