"""Text assembly: a request's emitted tokens → text chunks, holding back incomplete UTF-8 and anything that may
begin a stop string (the generation steps know nothing about text)."""

from __future__ import annotations

import codecs
from collections.abc import Callable, Sequence

from ondevice.results import Chunk, Stats


class TextAssembler:
    """Bytes of tokens → text, holding back incomplete UTF-8 and anything that may begin a stop string."""

    def __init__(self, token_bytes: Callable[[int], bytes], stop: Sequence[str]) -> None:
        self._bytes = token_bytes
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.stop = [s for s in stop if s]
        self.text = ""  # everything decoded so far
        self.emitted = 0  # characters of text already released
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

    def _stop_prefix(self, s: str) -> int:
        """Length of the longest proper prefix of ``s`` that the text ends with (0 if none)."""
        for k in range(min(len(s) - 1, len(self.text)), 0, -1):
            if self.text.endswith(s[:k]):
                return k
        return 0

    def _release(self, final: bool) -> str:
        hits = [i for s in self.stop if (i := self.text.find(s, max(0, self.emitted - len(s)))) >= 0]
        if hits:  # cut at the earliest occurrence of any stop string
            self.text = self.text[: min(hits)]
            self.stopped = True
            final = True
        end = len(self.text)
        if not final:  # hold back the longest suffix that could still grow into any stop string
            end -= max((self._stop_prefix(s) for s in self.stop), default=0)
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
