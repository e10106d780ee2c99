"""Text assembly: a request's emitted tokens → text chunks, holding back incomplete UTF-8 and anything that may
begin a stop string (the generation steps know nothing about text)."""

from __future__ import annotations

import codecs
from collections.abc import Callable, Sequence

from ondevice.results import Chunk, Stats


class StopMatcher:
    """One stop string matched as the text grows (Knuth–Morris–Pratt): each character is looked at once, so a
    step costs time linear in the new text, whatever the stop's length.

    ``state`` is the length of the longest prefix of the stop the text scanned so far ends with.
    """

    def __init__(self, stop: str) -> None:
        self.stop = stop
        self.fail = fail = [0] * len(stop)  # fail[i]: the longest proper border of stop[: i + 1]
        k = 0
        for i in range(1, len(stop)):
            while k and stop[i] != stop[k]:
                k = fail[k - 1]
            if stop[i] == stop[k]:
                k += 1
            fail[i] = k
        self.state = 0

    def scan(self, text: str, start: int) -> int | None:
        """Advance over ``text[start:]``; where the first occurrence completed there starts, or None."""
        s, fail, k, n = self.stop, self.fail, self.state, len(self.stop)
        for i in range(start, len(text)):
            c = text[i]
            while k and c != s[k]:
                k = fail[k - 1]
            if c == s[k]:
                k += 1
                if k == n:
                    self.state = k
                    return i + 1 - n
        self.state = k
        return None


class TextAssembler:
    """Bytes of tokens → text, holding back incomplete UTF-8 and anything that may begin a stop string."""

    def __init__(self, token_bytes: Callable[[int], bytes], stop: Sequence[str]) -> None:
        self._bytes = token_bytes
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.stop = [s for s in stop if s]
        self._matchers = [StopMatcher(s) for s in self.stop]
        self.text = ""  # everything decoded so far
        self.emitted = 0  # characters of text already released
        self._scanned = 0  # characters of text the stop matchers have seen
        self.stopped = False

    def feed(self, token: int) -> str:
        """Add a token; return newly releasable text (may be empty). Sets ``stopped`` on a stop string."""
        self.text += self._dec.decode(self._bytes(token))
        return self._release(final=False)

    def flush(self) -> str:
        """The end (EOS, a stop, a token limit, a cut): release the rest. An incomplete UTF-8 sequence left at
        the end (a character cut in the middle by ``max_tokens``) is dropped, never shown as U+FFFD."""
        self._dec.reset()
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if not self.stopped:
            start, self._scanned = self._scanned, len(self.text)
            hits = [i for m in self._matchers if (i := m.scan(self.text, start)) is not None]
            if hits:  # cut at the earliest occurrence of any stop string
                self.text = self.text[: min(hits)]
                self.stopped = True
                final = True
        end = len(self.text)
        if not final:  # hold back the longest suffix that could still grow into any stop string
            end -= max((m.state for m in self._matchers), default=0)
        out = self.text[self.emitted : end]
        self.emitted = max(self.emitted, end)
        return out


def step_chunks(step, is_eog: Callable[[int], bool], text: TextAssembler, stats: Stats, max_tokens: int) -> list[Chunk]:
    """One step's tokens → chunks (one per run of draft / target tokens), stopping at EOS, a stop
    string or ``max_tokens`` (recorded in ``stats.stop_reason``)."""
    chunks: list[Chunk] = []
    lps = step.logprobs if step.logprobs is not None else [None] * len(step.tokens)
    for tok, fd, lp in zip(step.tokens, step.from_draft, lps, strict=True):
        if is_eog(tok):
            stats.stop_reason = "eos"
            break
        piece = text.feed(tok)
        if chunks and chunks[-1].from_draft[-1] == fd:
            chunks[-1].tokens.append(tok)
            chunks[-1].from_draft.append(fd)
            chunks[-1].text += piece
        else:
            chunks.append(Chunk(piece, [tok], [fd], [] if step.logprobs is not None else None))
        if step.logprobs is not None:
            chunks[-1].logprobs.append(lp)
        stats.tokens += 1
        if text.stopped:
            stats.stop_reason = "stop"
            break
        if stats.tokens >= max_tokens:
            stats.stop_reason = "length"
            break
    return chunks


def add_tail(chunks: list[Chunk], tail: str) -> None:
    """Append the text released at the end (``TextAssembler.flush``) to the last chunk, or as a chunk of its own."""
    if tail and chunks:
        chunks[-1].text += tail
    elif tail:
        chunks.append(Chunk(tail, [], []))
