"""Constrained decoding: a per-request token matcher (JSON schema, regex, grammar) over the target's vocabulary.

The grammar engine is llguidance (chosen by measurement: docs/constrain.md). A ``Constraint`` walks
the tokens a request emits and says, at every position, which ids may come next. The speculative loop
masks the target's logits of every verified row with the matcher state after the prefix up to that row,
and the drafter's logits with the same masks, so both p and q are the constrained laws

    p_c(x) ∝ p(x)·[x allowed],   q_c(x) ∝ q(x)·[x allowed]

and the rejection sampler (``ondevice.sampling``, unchanged) is exact with respect to p_c. Drafts are
run through the matcher before they are proposed and cut at the first id it refuses; an end-of-generation
id is allowed only where the constraint accepts.

The matcher sees the generated tokens only (not the prompt). Masks are cached per position, so the
rows a model drafter masked are not computed again when the target's rows are masked.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ondevice.errors import OndeviceError

# JSON with fixed separators: a free-whitespace grammar lets a small model emit blank lines forever.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# backend → llguidance.LLTokenizer; dies with its backend (the tokenizer calls the backend's tokenize)
_TOKENIZERS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def grammar_text(response_format: Mapping | None = None, grammar: str | None = None) -> str | None:
    """Translate a request's constraint into an llguidance grammar (None: unconstrained).

    Args:
        response_format: OpenAI's shape: {"type": "text"} | {"type": "json_object"} |
            {"type": "json_schema", "json_schema": {"schema": {...}, "name": ..., "strict": ...}};
            extensions: {"type": "regex", "regex": "..."} and {"type": "grammar", "grammar": "..."}.
        grammar: a Lark or GBNF grammar (llama.cpp's format; told apart by llguidance).
    Returns:
        The grammar string an ``LLMatcher`` takes, or None.
    Raises:
        OndeviceError: an unknown type, a missing schema, or both arguments given.
    """
    import llguidance

    if response_format is not None and grammar is not None:
        raise OndeviceError("give either response_format or grammar, not both")
    if grammar is not None:
        if not isinstance(grammar, str) or not grammar.strip():
            raise OndeviceError("grammar must be a non-empty Lark or GBNF grammar string")
        try:
            return llguidance.grammar_from("grammar", grammar)
        except ValueError as e:
            raise OndeviceError(f"grammar: {e}") from None
    if response_format is None:
        return None
    if not isinstance(response_format, Mapping):
        raise OndeviceError(f"response_format must be an object like {{'type': 'json_object'}}, not {type(response_format).__name__}")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return json_grammar({"type": "object"})
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, Mapping) else None
        if not isinstance(schema, Mapping):
            raise OndeviceError("response_format json_schema needs {'json_schema': {'name': ..., 'schema': {...}}}")
        return json_grammar(schema)
    if kind == "regex":
        rx = response_format.get("regex")
        if not isinstance(rx, str) or not rx:
            raise OndeviceError("response_format regex needs {'type': 'regex', 'regex': 'PATTERN'}")
        return llguidance.LLMatcher.grammar_from_regex(rx)
    if kind == "grammar":
        return grammar_text(grammar=response_format.get("grammar"))
    raise OndeviceError(f"response_format type {kind!r}: choose text, json_object, json_schema, regex or grammar")


def json_grammar(schema: Mapping) -> str:
    """An llguidance grammar for JSON documents valid against ``schema`` (fixed separators)."""
    import llguidance

    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)
    except (ValueError, TypeError) as e:
        raise OndeviceError(f"json schema: {e}") from None
    error = llguidance.LLMatcher.validate_grammar(grammar)  # a bad schema fails here, not at the first token
    if error:
        raise OndeviceError(f"json schema: {error}")
    return grammar


class _Vocab:
    """The object ``llguidance.TokenizerWrapper`` wraps: token bytes, EOS ids and a tokenize function."""

    def __init__(self, backend) -> None:
        V = backend.vocab_size
        texts = backend.vocab_tokens()
        self.tokens: list[bytes] = []
        self.special_token_ids: list[int] = []
        for i in range(V):
            b = backend.token_bytes(i)
            if not b:  # control tokens render as nothing: mark them special (0xFF prefix) so no text matches them
                b = b"\xff" + (texts[i] if i < len(texts) and texts[i] else f"<|special_{i}|>").encode()
                self.special_token_ids.append(i)
            self.tokens.append(b)
        self.eos_ids = [i for i in range(V) if backend.is_eog(i)]
        if not self.eos_ids:
            raise OndeviceError(f"{backend.path}: the model has no end-of-generation token; constrained output needs one")
        self.eos_token_id = self.eos_ids[0]
        self.bos_token_id = backend.bos_id
        self._backend = weakref.ref(backend)  # a strong one would keep the cache entry alive forever

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError("text only")
        return self._backend().tokenize(text, add_bos=False, special=False)


def tokenizer_for(backend):
    """The llguidance tokenizer of ``backend``'s vocabulary (built once per open backend: ~0.7 s for 49k tokens)."""
    import llguidance

    tok = _TOKENIZERS.get(backend)
    if tok is None:
        vocab = _Vocab(backend)
        tok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(vocab), n_vocab=len(vocab.tokens), eos_token=vocab.eos_ids)
        _TOKENIZERS[backend] = tok
    return tok


class Constraint:
    """One request's matcher: which ids may come next, advanced and rolled back with the tokens.

    Args:
        tokenizer: from ``tokenizer_for(target)``.
        grammar: from ``grammar_text``.
    Raises:
        OndeviceError: the grammar does not compile (the library's message).
    """

    def __init__(self, tokenizer, grammar: str) -> None:
        import llguidance

        self.vocab_size = int(tokenizer.vocab_size)
        self.eos_ids = list(tokenizer.eos_tokens)
        self._eos = frozenset(self.eos_ids)
        self._m = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if self._m.is_error():
            raise OndeviceError(f"constraint: {self._m.get_error()}")
        self.n = 0  # tokens consumed
        self._masks: dict[int, np.ndarray] = {}  # position → allowed ids after the first ``position`` tokens

    @classmethod
    def build(cls, target, response_format: Mapping | None = None, grammar: str | None = None) -> Constraint | None:
        """The constraint of a request for ``target`` (None when the request is unconstrained)."""
        text = grammar_text(response_format, grammar)
        return None if text is None else cls(tokenizer_for(target), text)

    # -- state -----------------------------------------------------------------------------------
    def allowed(self) -> np.ndarray:
        """[vocab_size] bool: the ids allowed at the next position (EOS ids only where the constraint accepts)."""
        m = self._masks.get(self.n)
        if m is None:
            self._check()
            bits = np.frombuffer(self._m.compute_bitmask(), dtype=np.uint8)
            m = np.unpackbits(bits, bitorder="little")[: self.vocab_size].astype(bool)
            self._masks[self.n] = m
        return m

    def advance(self, tokens: Sequence[int]) -> None:
        """Consume ``tokens`` (each must be allowed where it stands); what follows an end of generation
        is not output (a step may sample a token after an accepted EOS draft) and is not consumed."""
        for t in tokens:
            if not self._m.consume_token(int(t)):
                raise OndeviceError(f"constraint refused token {int(t)} at position {self.n}: {self._m.get_error()}")
            self.n += 1
            if int(t) in self._eos:
                break

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading ``tokens`` the constraint would accept from here (nothing is consumed)."""
        if not tokens:
            return 0
        return int(self._m.validate_tokens([int(t) for t in tokens]))

    def rollback(self, n: int) -> None:
        """Undo the last ``n`` consumed tokens."""
        if n <= 0:
            return
        if n > self.n or not self._m.rollback(n):
            raise OndeviceError(f"constraint cannot roll back {n} of {self.n} tokens: {self._m.get_error()}")
        self.n -= n
        for k in [k for k in self._masks if k > self.n]:
            del self._masks[k]  # positions past here will hold other tokens

    def checkpoint(self) -> int:
        """A mark ``restore`` returns to (the count of consumed tokens)."""
        return self.n

    def restore(self, mark: int) -> None:
        self.rollback(self.n - mark)

    def is_done(self) -> bool:
        """Nothing but an end-of-generation id may follow (the text is complete)."""
        return bool(self._m.is_stopped())

    def is_accepting(self) -> bool:
        """The text so far is complete (it may also go on)."""
        return bool(self._m.is_accepting())

    def _check(self) -> None:
        if self._m.is_error():
            raise OndeviceError(f"constraint: {self._m.get_error()}")

    # -- masks on logits -------------------------------------------------------------------------
    def mask_row(self, logits: np.ndarray) -> np.ndarray:
        """A copy of one row of logits with −inf wherever the next position forbids (and past the vocabulary)."""
        return apply_mask(logits, self.allowed())

    def mask_rows(self, logits: np.ndarray, draft: Sequence[int]) -> np.ndarray:
        """Mask verify rows: row i with the state after ``draft[:i]`` (the drafts must be valid).

        Args:
            logits: [len(draft) + 1, V] target logits.
        Returns:
            A masked float32 copy; the matcher ends where it started.
        """
        out = np.empty(logits.shape, dtype=np.float32)
        mark = self.n
        ended = False
        try:
            for i in range(logits.shape[0]):
                if ended:  # rows after an EOS draft are never output: any valid law will do
                    out[i] = apply_mask(logits[i], self.eos_mask())
                    continue
                out[i] = apply_mask(logits[i], self.allowed())
                if i < len(draft) and i + 1 < logits.shape[0]:
                    ended = int(draft[i]) in self._eos
                    if not ended:
                        self.advance([draft[i]])
        finally:
            self.restore(mark)
        return out

    def eos_mask(self) -> np.ndarray:
        """[vocab_size] bool: the end-of-generation ids only."""
        m = np.zeros(self.vocab_size, dtype=bool)
        m[self.eos_ids] = True
        return m


def apply_mask(logits: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """``logits`` with −inf where ``allowed`` is False and past its length (a float32 copy)."""
    out = np.array(logits, dtype=np.float32, copy=True)
    n = min(out.shape[-1], allowed.shape[-1])
    row = out[:n]
    row[~allowed[:n]] = -np.inf
    out[n:] = -np.inf
    return out
