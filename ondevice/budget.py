"""A reasoning budget: after N thinking tokens the end of thinking is forced, then the answer follows.

``ThinkingBudget`` has ``ondevice.constrain.Constraint``'s interface, so it runs through the constraint path
of plain and speculative decoding alike. Its mask depends only on the tokens emitted so far:

  - thinking (the template's convention, ``ondevice.reasoning``): every id is allowed (an end of generation
    only where an inner constraint would accept an empty answer);
  - after N thinking tokens, while the model has not closed thinking itself: only the next id of the
    template's forced end (``Thinking.forced_end`` tokenized with specials), one id per position;
  - the answer: the inner constraint's mask (a request's response_format / grammar), or every id.

Because the mask is a function of the emitted prefix, the speculative loop masks p and q with it as with any
constraint and stays exact. The state after every emitted token is kept on a stack, so ``rollback`` is a
truncate (llguidance's own max_tokens cannot roll back). Whether the model closed thinking by itself is read
by a ``reasoning.Splitter`` fed each token's bytes (``piece``).

Where the generation prompt does not open thinking (Qwen3 opens it in the output, or not at all), the output
may start without thinking: then it is all answer. With an inner constraint, the first position allows the
inner constraint's ids and the first id of the opening tag (then the rest of the tag is forced); without
one, every id, and the splitter tells which way the output went.
"""

from __future__ import annotations

import codecs
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ondevice.constrain import apply_mask
from ondevice.errors import OndeviceError
from ondevice.reasoning import Splitter, Thinking, detect

PROMPT_TAIL_TOKENS = 128  # prompt tokens decoded to tell whether the generation prompt opened thinking
_EOS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # backend → its end-of-generation ids
_TEXTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # backend → its tokens' texts (special ones)


@dataclass(frozen=True)
class _State:
    """After some emitted tokens: the phase ('start' | 'open' | 'think' | 'force' | 'answer' | 'end'), the
    index into the forced sequence ('open' / 'force'), thinking tokens counted, tokens the inner constraint
    consumed, and the splitter's and the UTF-8 decoder's state."""

    phase: str
    k: int
    count: int
    inner_n: int
    split: tuple
    decoder: tuple


class ThinkingBudget:
    """A request's reasoning budget (and optional inner constraint on the answer), as a ``Constraint``.

    Args:
        target: the backend (``token_bytes``, ``tokenize``, ``is_eog``, ``vocab_size``).
        thinking: the prompt's thinking convention (``reasoning.detect``).
        budget: thinking tokens allowed (>= 0) before the end is forced.
        inner: the request's ``Constraint`` on the answer, or None.
    """

    def __init__(self, target, thinking: Thinking, budget: int, inner=None) -> None:
        self.target, self.thinking, self.budget, self.inner = target, thinking, int(budget), inner
        self.vocab_size = int(target.vocab_size) if inner is None else max(int(target.vocab_size), inner.vocab_size)
        self.eos_ids = list(inner.eos_ids) if inner is not None else eos_ids(target)
        self._eos = frozenset(self.eos_ids)
        self.end_ids = target.tokenize(thinking.forced_end, add_bos=False, special=True)
        self.open_ids = target.tokenize(thinking.start, add_bos=False, special=True)
        if not self.end_ids or not self.open_ids:
            raise OndeviceError(f"reasoning_budget: the thinking markers of {target.path} tokenize to nothing")
        self._splitter = Splitter(thinking)
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        phase = "think" if thinking.opened else "start"
        if phase == "think" and self.budget == 0:
            phase = "force"
        self._stack = [_State(phase, 0, 0, 0, self._split_state(), self._decoder.getstate())]
        self._all = np.ones(self.vocab_size, dtype=bool)
        self._masks: dict[int, np.ndarray] = {}

    @classmethod
    def for_prompt(cls, target, prompt: Sequence[int], budget: int, inner=None) -> ThinkingBudget:
        """The budget of a request whose prompt is ``prompt`` (ids): the convention read from the target's chat
        template and the prompt's tail. Raises OndeviceError when the template has no thinking convention."""
        tail = b"".join(piece(target, int(t)) for t in prompt[-PROMPT_TAIL_TOKENS:]).decode("utf-8", "replace")
        thinking = detect(target.chat_template, tail)
        if thinking is None:
            raise OndeviceError(f"reasoning_budget: {target.path} has no thinking convention in its chat template "
                                "(no <think> tags or harmony channels); drop reasoning_budget for this model")
        return cls(target, thinking, budget, inner)

    # -- state -----------------------------------------------------------------------------------
    @property
    def n(self) -> int:
        """Tokens consumed."""
        return len(self._stack) - 1

    @property
    def phase(self) -> str:
        return self._stack[-1].phase

    @property
    def thinking_tokens(self) -> int:
        """Thinking tokens counted so far."""
        return self._stack[-1].count

    def _split_state(self) -> tuple:
        s = self._splitter
        return (s.buf, s.state, getattr(s, "route", None), s.strip)

    def _load(self, st: _State) -> None:
        s = self._splitter
        s.buf, s.state, route, s.strip = st.split
        if route is not None:
            s.route = route
        self._decoder.setstate(st.decoder)

    def allowed(self) -> np.ndarray:
        """[vocab_size] bool: the ids allowed at the next position."""
        m = self._masks.get(self.n)
        if m is not None:
            return m
        st = self._stack[-1]
        if st.phase in ("open", "force"):
            m = np.zeros(self.vocab_size, dtype=bool)
            m[(self.open_ids if st.phase == "open" else self.end_ids)[st.k]] = True
        elif st.phase == "answer":
            m = self.inner.allowed() if self.inner is not None else self._all
        elif st.phase == "end":
            m = self.eos_mask()
        elif self.inner is None:  # start / think
            m = self._all
        elif st.phase == "start":
            m = self.inner.allowed().copy()
            m[self.open_ids[0]] = True
        else:  # think, under an inner constraint: an end here is an empty answer
            m = self._all.copy()
            if not self.inner.is_accepting():
                m[self.eos_ids] = False
        self._masks[self.n] = m
        return m

    def advance(self, tokens: Sequence[int]) -> None:
        """Consume ``tokens`` (each must be allowed); nothing after an end of generation is consumed."""
        for t in tokens:
            t = int(t)
            if not self.allowed()[t]:
                raise OndeviceError(f"reasoning budget refused token {t} at position {self.n} ({self.phase})")
            self._stack.append(self._next(self._stack[-1], t))
            if t in self._eos:
                break

    def _next(self, st: _State, t: int) -> _State:
        phase, k, count, inner_n = st.phase, st.k, st.count, st.inner_n
        if t in self._eos:
            if phase == "answer" and self.inner is not None:
                self.inner.advance([t])
                inner_n += 1
            return _State("end", 0, count, inner_n, st.split, st.decoder)
        self._load(st)
        text = self._decoder.decode(piece(self.target, t))
        self._splitter.feed(text)
        self._splitter.reasoning.clear()  # only the state is wanted: the text would grow with the output
        self._splitter.content.clear()
        inside = self._splitter.in_thinking
        if phase == "start":
            if self.inner is not None and t == self.open_ids[0] and len(self.open_ids) > 1:
                phase, k = "open", 1
            elif self.inner is not None and t != self.open_ids[0]:
                self.inner.advance([t])
                phase, inner_n = "answer", inner_n + 1
            elif inside:
                phase = "think"
            elif self._splitter.state == ("body" if self.thinking.kind == "harmony" else "content"):
                phase = "answer"  # the output went straight to the answer
        elif phase == "open":
            k += 1
            if k == len(self.open_ids):
                phase = "think"
        elif phase == "think":
            count += 1
            if not inside:
                phase = "answer"  # the model closed thinking itself
        elif phase == "force":
            k += 1
            if k == len(self.end_ids):
                phase = "answer"
        elif phase == "answer" and self.inner is not None:
            self.inner.advance([t])
            inner_n += 1
        if phase == "think" and count >= self.budget:
            phase, k = "force", 0
        return _State(phase, k, count, inner_n, self._split_state(), self._decoder.getstate())

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading ``tokens`` would be accepted from here (nothing is consumed)."""
        mark = self.n
        try:
            for i, t in enumerate(tokens):
                if self.phase == "answer" and self.inner is not None:
                    return i + self.inner.valid_prefix(list(tokens[i:]))
                if self.phase == "end" or not self.allowed()[int(t)]:
                    return i
                self.advance([t])
            return len(tokens)
        finally:
            self.restore(mark)

    def rollback(self, n: int) -> None:
        """Undo the last ``n`` consumed tokens."""
        if n <= 0:
            return
        if n > self.n:
            raise OndeviceError(f"reasoning budget cannot roll back {n} of {self.n} tokens")
        del self._stack[len(self._stack) - n:]
        st = self._stack[-1]
        if self.inner is not None and self.inner.n > st.inner_n:
            self.inner.rollback(self.inner.n - st.inner_n)
        for k in [k for k in self._masks if k > self.n]:
            del self._masks[k]

    def checkpoint(self) -> int:
        return self.n

    def restore(self, mark: int) -> None:
        self.rollback(self.n - mark)

    def is_done(self) -> bool:
        """Nothing but an end of generation may follow."""
        return self.phase == "end" or (self.phase == "answer" and self.inner is not None and self.inner.is_done())

    def is_accepting(self) -> bool:
        """The text so far is complete (it may also go on): not inside a forced sequence, and the answer (empty
        before it starts) accepted by the inner constraint."""
        if self.phase in ("open", "force"):
            return False
        return self.inner is None or self.inner.is_accepting()

    # -- masks on logits -------------------------------------------------------------------------
    def mask_row(self, logits: np.ndarray) -> np.ndarray:
        return apply_mask(logits, self.allowed())

    def mask_rows(self, logits: np.ndarray, draft: Sequence[int]) -> np.ndarray:
        """Row i masked with the state after ``draft[:i]`` (as ``Constraint.mask_rows``)."""
        out = np.empty(logits.shape, dtype=np.float32)
        mark = self.n
        ended = False
        try:
            for i in range(logits.shape[0]):
                out[i] = apply_mask(logits[i], self.eos_mask() if ended else self.allowed())
                if not ended and i < len(draft) and i + 1 < logits.shape[0]:
                    ended = int(draft[i]) in self._eos
                    if not ended:
                        self.advance([draft[i]])
        finally:
            self.restore(mark)
        return out

    def eos_mask(self) -> np.ndarray:
        m = np.zeros(self.vocab_size, dtype=bool)
        m[self.eos_ids] = True
        return m


def eos_ids(target) -> list[int]:
    """The target's end-of-generation ids (cached per open backend)."""
    ids = _EOS.get(target)
    if ids is None:
        ids = [i for i in range(target.vocab_size) if target.is_eog(i)]
        _EOS[target] = ids
    return ids


def piece(target, token: int) -> bytes:
    """A token's bytes as the splitter reads them: a control token that renders as nothing (harmony's
    ``<|channel|>`` in some GGUFs) as its vocabulary text, so thinking markers are seen whichever way."""
    b = target.token_bytes(token)
    if b:
        return b
    texts = _TEXTS.get(target)
    if texts is None:
        texts = _TEXTS[target] = target.vocab_tokens()
    return texts[token].encode() if token < len(texts) else b""
