"""The machinery every tool-call family shares: call ids, the incremental JSON object scanner, the call
sink that writes OpenAI-shaped deltas, and the streaming engine (``CallStream``).

The engine passes text through as content until one of the family's openers (a marker such as
``<tool_call>``, a ``{`` or ``[`` opening a line where the family writes bare calls, or a code fence around
either) may begin; from there a family ``Region`` parser reads the call(s), incrementally, and either
finishes them or rejects the region (it was text after all: it goes out as content). A piece that may be
the start of an opener is held back until the next piece decides. Whole-text parsing is the same engine
fed once, so any cut of a text into pieces gives the same content and the same calls.

A call is committed (its ``id`` / ``name`` delta sent) once its name is a known tool and its arguments have
begun; its arguments then stream as written, piece by piece, the way OpenAI streams
``tool_calls[i].function.arguments``. Arguments that turn out not to be JSON stay as written (OpenAI's
contract: clients validate arguments); anything before the commit that does not parse is content.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Callable, Sequence

MAX_HEAD = 256  # a call's name / header longer than this is not a call header: the region is text
_ALNUM = string.ascii_letters + string.digits
NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")  # tools.check_tools allows these names


def call_id(style: str = "openai") -> str:
    """A fresh call id: 'call_' + 24 hex digits, or 9 letters / digits for Mistral's templates (they check)."""
    if style == "mistral":
        return "".join(secrets.choice(_ALNUM) for _ in range(9))
    return f"call_{secrets.token_hex(12)}"


def partial(tail: str, markers: Sequence[str]) -> int:
    """Length of the longest end of ``tail`` that is a proper start of one of ``markers``."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(tail)), best, -1):
            if tail.endswith(m[:k]):
                best = k
                break
    return best


def skip_ws(b: str, i: int) -> int:
    n = len(b)
    while i < n and b[i] in " \t\r\n":
        i += 1
    return i


class Sink:
    """Collects the stream's output: content, calls, and the OpenAI ``delta`` objects of each run (pieces
    are kept in lists and joined once, so many small pieces stay linear)."""

    def __init__(self, tools: Sequence[dict] | None, id_style: str) -> None:
        self.names = {t["function"]["name"] for t in tools or ()}
        self.params = {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools or ()}
        self.id_style = id_style
        self.content: list[str] = []
        self.heads: list[tuple[str, str]] = []  # (id, name) per call
        self.args: list[list[str]] = []
        self.events: list[tuple] = []  # this run's: ('content', s) | ('start', i) | ('args', i, s)

    def known(self, name: str) -> bool:
        return name in self.names

    def text(self, s: str) -> None:
        if s:
            self.content.append(s)
            self.events.append(("content", s))

    def start(self, name: str) -> int:
        self.heads.append((call_id(self.id_style), name))
        self.args.append([])
        self.events.append(("start", len(self.heads) - 1))
        return len(self.heads) - 1

    def add_args(self, i: int, s: str) -> None:
        if s:
            self.args[i].append(s)
            self.events.append(("args", i, s))

    def calls(self) -> list[dict]:
        return [{"id": cid, "type": "function", "function": {"name": name, "arguments": "".join(a)}}
                for (cid, name), a in zip(self.heads, self.args, strict=True)]

    def take(self) -> list[dict]:
        """This run's events as OpenAI deltas, consecutive pieces of one kind joined."""
        out: list[dict] = []
        k = 0
        ev = self.events
        while k < len(ev):
            e = ev[k]
            if e[0] == "content":
                j = k
                while j < len(ev) and ev[j][0] == "content":
                    j += 1
                out.append({"content": "".join(x[1] for x in ev[k:j])})
            else:
                i = e[1]
                j = k + (e[0] == "start")
                while j < len(ev) and ev[j][0] == "args" and ev[j][1] == i:
                    j += 1
                args = "".join(x[2] for x in ev[k:j] if x[0] == "args")
                tc = {"index": i, "function": {"arguments": args}}
                if e[0] == "start":
                    cid, name = self.heads[i]
                    tc = {"index": i, "id": cid, "type": "function", "function": {"name": name, "arguments": args}}
                out.append({"tool_calls": [tc]})
            k = j
        self.events = []
        return out


_STR_STOP = re.compile(r'["\\]')
_STRUCT = re.compile(r'["{}\[\],:]')


class ObjectScan:
    """Incremental scan of one JSON object from its ``{`` at ``start``: where it ends and where each
    top-level member's value lies. Linear in the text, however it arrives (strings and runs of plain
    characters are skipped with C-level searches). It checks structure, not grammar: a value's text is
    checked with ``json.loads`` by whoever uses it.

    Attributes:
        members: key → [value start, value end or None while open].
        end: the index just past the closing ``}``, once seen.
        bad: the text cannot be a JSON object (a non-string key, a stray character).
    """

    def __init__(self, start: int) -> None:
        self.pos = start + 1
        self.depth = 1
        self.in_str = False
        self.str_start = 0
        self.state = "key"  # at depth 1: key | colon | value | in_value | comma
        self.key = ""
        self.members: dict[str, list] = {}
        self.end: int | None = None
        self.bad = False

    def advance(self, b: str) -> None:
        n, i = len(b), self.pos
        while i < n and self.end is None and not self.bad:
            if self.in_str:
                m = _STR_STOP.search(b, i)
                if m is None:
                    i = n
                    break
                j = m.start()
                if b[j] == "\\":
                    if j + 1 >= n:
                        i = j
                        break
                    i = j + 2
                    continue
                i = j + 1
                self.in_str = False
                if self.depth == 1 and self.state == "key":
                    try:
                        self.key = json.loads(b[self.str_start:i])
                    except json.JSONDecodeError:
                        self.bad = True
                    self.state = "colon"
                elif self.depth == 1 and self.state == "in_value":
                    self._close_value(i)
                continue
            ch = b[i]
            if self.depth == 1 and self.state != "in_value":
                if ch in " \t\r\n":
                    i += 1
                elif self.state == "key" and ch == '"':
                    self.in_str, self.str_start, i = True, i, i + 1
                elif self.state == "key" and ch == "}" and not self.members:
                    self.end = i + 1
                elif self.state == "colon" and ch == ":":
                    self.state, i = "value", i + 1
                elif self.state == "value":
                    self.members[self.key] = [i, None]
                    self.state = "in_value"  # the character is read again as the value's first
                elif self.state == "comma" and ch in ",}":
                    if ch == "}":
                        self.end = i + 1
                    self.state, i = "key", i + 1
                else:
                    self.bad = True
                continue
            # inside a member's value (depth 1) or deeper
            if ch == '"':
                self.in_str, self.str_start, i = True, i, i + 1
            elif ch in "{[":
                self.depth, i = self.depth + 1, i + 1
            elif ch in "}]":
                if self.depth == 1:  # the end of a scalar value, then the object's end
                    self._close_value(i)
                    continue
                self.depth, i = self.depth - 1, i + 1
                if self.depth == 1:
                    self._close_value(i)
            elif ch == "," and self.depth == 1:
                self._close_value(i)
            else:
                m = _STRUCT.search(b, i + 1)  # plain characters (numbers, literals, text): skip them at once
                i = m.start() if m else n
        self.pos = i

    def _close_value(self, i: int) -> None:
        self.members[self.key][1] = i
        self.state = "comma"


def value_text(b: str, span: list | None) -> str | None:
    """The raw text of a closed member value (stripped), or None."""
    if span is None or span[1] is None:
        return None
    return b[span[0]:span[1]].strip()


def json_str(raw: str | None) -> str | None:
    """A JSON string's value, or None when ``raw`` is not one."""
    if not raw or raw[0] != '"':
        return None
    try:
        v = json.loads(raw)
    except json.JSONDecodeError:
        return None
    return v if isinstance(v, str) else None


class Region:
    """A family's parser for the text from an opener on. ``advance`` is called with the whole buffer each
    time more text arrives (and once more with ``final``); it keeps its own position, so work is linear.

    It returns None while it needs more text, or ('done', end) when its call(s) ended at ``end``, or
    ('reject', end) when the text from the opener is not a call (only before it started one): the text up
    to ``end`` is content and openers are looked for again from there.
    """

    def __init__(self, b: str, start: int, opener: str, sink: Sink) -> None:
        self.start, self.opener, self.sink = start, opener, sink
        self.pos = start + len(opener)
        self.started = False

    def advance(self, b: str, final: bool) -> tuple[str, int] | None:
        raise NotImplementedError

    def reject(self) -> tuple[str, int]:
        assert not self.started
        return "reject", self.start + max(1, len(self.opener))


RegionFactory = Callable[[str, int, str, Sink], Region]
