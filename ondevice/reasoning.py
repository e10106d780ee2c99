"""Thinking split from the answer: a chat template's reasoning convention and a streaming splitter.

Conventions recognised from the template text (``detect``):
  - ``<think>…</think>`` tags: Qwen3 / 3.5, DeepSeek-R1 distills and V3.1, GLM, SmolLM3;
  - ``[THINK]…[/THINK]``: Magistral / Ministral reasoning models;
  - ``<|channel>thought…<channel|>``: Gemma 4;
  - gpt-oss harmony channels: ``<|channel|>analysis<|message|>…<|end|>`` is thinking, ``final`` is the answer;
    a message addressed to a tool (``to=functions.x``) passes through whole, markers and all, as content for
    the tool-call parser (``ondevice.toolcalls``, family ``harmony``).
A generation prompt that already opens the block (R1-style templates end it with ``<think>\\n``) starts the
splitter inside thinking (``Thinking.opened``).

``Splitter.feed`` takes text pieces and returns (reasoning delta, content delta); a piece that may be the
start of a marker is held back until the next piece decides, so no marker ever reaches content. ``finish``
flushes. ``split`` (a whole text) is the same splitter fed once, so any way of cutting a text into pieces
gives the same two strings. Both strings are the model's text as written, whitespace included, except that
whitespace right after a closing tag is dropped (templates strip it when they render history back).
Work is linear in the text: only a marker-sized tail (or a harmony header, at most ``MAX_HEADER`` chars) is
ever held.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["Thinking", "Splitter", "detect", "split"]

MAX_HEADER = 256  # a longer harmony message header is text, as is thinking opened after more whitespace

# harmony's markers (gpt-oss): a message is [<|start|>role] [to=recipient] <|channel|>name [to=recipient]
# [<|constrain|>type] <|message|> body (<|end|> | <|return|> | <|call|>)
H_START, H_CHANNEL, H_MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
H_ENDS = ("<|end|>", "<|return|>", "<|call|>")
_H_OPEN = re.compile("|".join(map(re.escape, (H_START, H_CHANNEL))))  # literal alternations: no backtracking
_H_END = re.compile("|".join(map(re.escape, H_ENDS)))


@dataclass(frozen=True)
class Thinking:
    """A template's thinking convention.

    Attributes:
        kind: 'tags' (an opening and a closing string) or 'harmony' (gpt-oss channels).
        start, end: the opening and closing strings ('tags'); harmony's analysis header and ``<|end|>``.
        opened: the generation prompt already opened the block: the model's output starts inside thinking.
        forced_end: the text that ends thinking when a budget forces it (fed to the model, then the answer).
    """

    kind: str
    start: str
    end: str
    opened: bool = False
    forced_end: str = ""


_TAGS = (("<think>", "</think>"), ("[THINK]", "[/THINK]"), ("<|channel>thought", "<channel|>"))


def detect(template: str | None, generation_prompt: str = "") -> Thinking | None:
    """The thinking convention of a chat template, or None when it has none.

    Args:
        template: the jinja source (markers are looked for in its text).
        generation_prompt: the rendered prompt's tail (or the whole prompt); when it ends with the opening
            marker, the output starts inside thinking.
    """
    if not template:
        return None
    tail = generation_prompt.rstrip()
    if H_CHANNEL in template:
        analysis = f"{H_CHANNEL}analysis{H_MESSAGE}"
        return Thinking("harmony", analysis, "<|end|>", opened=tail.endswith(analysis),
                        forced_end=f"<|end|>{H_START}assistant{H_CHANNEL}final{H_MESSAGE}")
    for start, end in _TAGS:
        if start in template or end in template:
            return Thinking("tags", start, end, opened=tail.endswith(start),
                            forced_end=f"\n{end}\n\n" if start == "<think>" else end)
    return None


def _partial(buf: str, markers: tuple[str, ...]) -> int:
    """Length of the longest tail of ``buf`` that is a proper start of one of ``markers`` (to hold back)."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(buf)), best, -1):
            if buf.endswith(m[:k]):
                best = k
                break
    return best


class Splitter:
    """Streaming split of a model's output into thinking and answer (see the module docstring).

    Args:
        thinking: the convention (``detect``); None passes everything through as content.
    """

    def __init__(self, thinking: Thinking | None) -> None:
        self.thinking = thinking
        self.buf = ""
        self.reasoning, self.content = [], []  # everything emitted, for ``split``
        if thinking is None:
            self.state = "content"
        elif thinking.kind == "harmony":
            self.state = "body" if thinking.opened else "between"
            self.route = "reasoning"  # where the current harmony body goes: reasoning | content | raw
        else:  # lead: opened by the prompt, yet a model may write the opening tag again (R1 distills do)
            self.state = "lead" if thinking.opened else "start"
        self.strip = False  # drop whitespace at the start of the answer (after a closing tag)

    @property
    def in_thinking(self) -> bool:
        """Whether the text fed so far ends inside a thinking block (for a reasoning budget)."""
        if self.thinking is None:
            return False
        if self.thinking.kind == "harmony":
            return self.state == "body" and self.route == "reasoning"
        return self.state in ("think", "lead")

    def feed(self, piece: str) -> tuple[str, str]:
        """Add generated text; return (reasoning, content) that may be sent now (either may be '')."""
        self.buf += piece
        r, c = [], []
        if self.thinking is not None and self.thinking.kind == "harmony":
            self._harmony(r, c, final=False)
        else:
            self._tags(r, c, final=False)
        return self._out(r, c)

    def finish(self) -> tuple[str, str]:
        """Flush what was held back: an unclosed thinking block is thinking, a partial marker is text."""
        r, c = [], []
        if self.thinking is not None and self.thinking.kind == "harmony":
            self._harmony(r, c, final=True)
        else:
            self._tags(r, c, final=True)
        return self._out(r, c)

    def _out(self, r: list[str], c: list[str]) -> tuple[str, str]:
        rs, cs = "".join(r), "".join(c)
        if self.strip and cs:
            cs = cs.lstrip()
            self.strip = not cs
        self.reasoning.append(rs)
        self.content.append(cs)
        return rs, cs

    def _tags(self, r: list[str], c: list[str], final: bool) -> None:
        t = self.thinking
        while self.buf:
            if self.state == "content":
                c.append(self.buf)
                self.buf = ""
            elif self.state in ("start", "lead"):  # thinking only opens at the very start (after whitespace)
                s = self.buf.lstrip()
                no_tag = "content" if self.state == "start" else "think"  # lead: thinking is open already
                if len(self.buf) - len(s) > MAX_HEADER:
                    self.state = no_tag  # thinking opens near the start or not at all
                elif s.startswith(t.start):
                    self.buf, self.state = s[len(t.start):], "think"
                elif t.start.startswith(s) and not final:
                    return
                else:
                    self.state = no_tag
            else:  # think
                i = self.buf.find(t.end)
                if i >= 0:
                    r.append(self.buf[:i])
                    self.buf, self.state, self.strip = self.buf[i + len(t.end):], "content", True
                    continue
                keep = 0 if final else _partial(self.buf, (t.end,))
                r.append(self.buf[: len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep:]
                return

    def _harmony(self, r: list[str], c: list[str], final: bool) -> None:
        b, p = self.buf, 0  # an index, not slices: many short messages stay linear
        while p < len(b):
            if self.state == "between":  # text outside messages is content, up to the next message
                m = _H_OPEN.search(b, p)
                if m is None:
                    keep = 0 if final else _partial(b[-len(H_CHANNEL):], (H_START, H_CHANNEL))
                    c.append(b[p: len(b) - keep])
                    p = len(b) - keep
                    break
                c.append(b[p: m.start()])
                p, self.state = (m.end() if m.group() == H_START else m.start()), "header"
            elif self.state == "header":
                lim = p + MAX_HEADER + len(H_MESSAGE)  # decided on the same chars however the text is cut
                i = b.find(H_MESSAGE, p, lim)
                if i < 0:
                    if len(b) < lim and not final:
                        break
                    cut = min(p + MAX_HEADER, len(b))  # not a harmony header after all: text
                    c.append(b[p:cut])
                    p, self.state = cut, "between"
                    continue
                header = b[p:i]
                channel = header.split(H_CHANNEL, 1)[1].split() if H_CHANNEL in header else []
                if "to=" in header:
                    self.route = "raw"  # a tool call: the tool parser reads it, header and all
                    start = min(j for j in (header.find(H_CHANNEL), header.find("to=")) if j >= 0)
                    c.append(header[start:] + H_MESSAGE)
                else:
                    self.route = "reasoning" if channel[:1] == ["analysis"] else "content"
                p, self.state = i + len(H_MESSAGE), "body"
            else:  # body, up to its end marker
                m = _H_END.search(b, p)
                out = r if self.route == "reasoning" else c
                if m is None:
                    keep = 0 if final else _partial(b[-len(H_ENDS[1]):], H_ENDS)
                    out.append(b[p: len(b) - keep])
                    p = len(b) - keep
                    break
                out.append(b[p: m.start()] + (m.group() if self.route == "raw" else ""))
                p, self.state = m.end(), "between"
        self.buf = b[p:]


def split(text: str, thinking: Thinking | None) -> tuple[str | None, str]:
    """(thinking or None when there was none, answer) of a whole output; the streaming splitter fed once."""
    s = Splitter(thinking)
    s.feed(text)
    s.finish()
    return "".join(s.reasoning) or None, "".join(s.content)
