"""``CallStream``: content passed through, calls parsed by the family's regions, whole or in pieces."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from ondevice.toolcalls.base import Region, RegionFactory, Sink, partial, skip_ws
from ondevice.toolcalls.json_calls import JsonCall

FENCE = "```"
# a bare opener followed by what no call has next: a JSON call's first key is a string; a pythonic call a name
_NO_CALL = {"{": re.compile(r'\{[ \t\r\n]*[^ \t\r\n"}]'), "[": re.compile(r"\[\s*[^\sA-Za-z0-9_.\-]")}


@dataclass(frozen=True)
class Family:
    """A tool-call format.

    Attributes:
        name: the family's name (``ondevice.toolcalls.FAMILIES``).
        openers: marker → region parser; the marker opens a call anywhere in the text.
        bare: opening character ('{' or '[') → region parser, for calls written without a marker: they open
            only at the start of a line.
        id_style: 'openai' or 'mistral' (the ids the family's template accepts).
    """

    name: str
    openers: dict[str, RegionFactory]
    bare: dict[str, RegionFactory] = field(default_factory=dict)
    id_style: str = "openai"

    def opener_re(self) -> re.Pattern:
        alts = [re.escape(m) for m in sorted(self.openers, key=len, reverse=True)]
        starts = "".join(re.escape(c) for c in self.bare) + "`"
        alts.append(rf"(?<=\n)[ \t]*[{starts}]")  # line-start openers (and fences: ``` at a line start)
        return re.compile("|".join(alts))


class _Fence(Region):
    """A markdown code fence (```lang) around the family's call(s): the calls are parsed, the fence dropped."""

    def __init__(self, b: str, start: int, opener: str, sink: Sink, family: Family) -> None:
        super().__init__(b, start, opener, sink)
        self.family, self.inner, self.phase = family, None, "lang"

    def advance(self, b: str, final: bool) -> tuple[str, int] | None:
        if self.phase == "lang":
            nl = b.find("\n", self.pos, self.pos + 33)
            if nl < 0:
                return None if len(b) < self.pos + 33 and not final else self.reject()
            if not re.fullmatch(r"[\w+.-]*[ \t]*", b[self.pos:nl]):
                return self.reject()
            inner = self._inner(b, skip_ws(b, nl + 1), final)
            if inner is None:
                return None
            if inner is False:
                return self.reject()
            self.inner, self.phase = inner, "inner"
        while True:
            if self.phase == "inner":
                r = self.inner.advance(b, final)
                if r is None:
                    return None
                if r[0] == "reject":  # text after the fence's calls, or no call at all
                    return ("done", self.inner.start) if self.started else self.reject()
                self.started, self.pos, self.phase = True, r[1], "close"
            i = skip_ws(b, self.pos)  # the closing fence, or another call
            if b.startswith(FENCE, i):
                return "done", i + len(FENCE)
            if not final and FENCE.startswith(b[i:i + 3]):
                return None
            inner = self._inner(b, i, final)
            if inner is None:
                return None
            if inner is False:
                return "done", self.pos
            self.inner, self.phase = inner, "inner"

    def _inner(self, b: str, i: int, final: bool) -> Region | None | bool:
        """The call region starting at ``i``; None: more text may tell; False: no call starts there."""
        rest = b[i:i + 64]
        opener = next((m for m in self.family.openers if rest.startswith(m)), None)
        if opener is not None:
            return self.family.openers[opener](b, i, opener, self.sink)
        if not final and (i >= len(b) or any(m.startswith(rest) for m in self.family.openers)):
            return None
        if rest[:1] in self.family.bare:
            return self.family.bare[rest[0]](b, i, "", self.sink)
        if rest[:1] == "{":  # a JSON call object in a fence, whatever the family's own format
            return JsonCall(b, i, "", self.sink)
        return False

    def reject(self) -> tuple[str, int]:
        return "reject", self.start + len(FENCE)


class CallStream:
    """Streamed parse of a model's answer into content and OpenAI tool calls.

    ``feed(piece)`` returns the OpenAI ``delta`` objects that may be sent now, in order: ``{"content": s}``
    or ``{"tool_calls": [{"index", "id", "type", "function": {"name", "arguments"}}]}`` for a call's start
    and ``{"tool_calls": [{"index", "function": {"arguments": s}}]}`` for more of its arguments.
    ``finish()`` returns the rest; then ``content`` (str) and ``calls`` (complete OpenAI calls) hold the whole.

    Args:
        family: the format (``ondevice.toolcalls.family``).
        tools: the request's tools; only calls to these names are calls.
    """

    def __init__(self, family: Family, tools: Sequence[dict] | None) -> None:
        self.family = family
        self.sink = Sink(tools, family.id_style)
        self.opener = family.opener_re()
        self.markers = tuple(family.openers)
        self.buf = "\n"  # one character of context before the unread text: the output starts a line
        self.p = 1  # where the unread text starts in buf
        self.region: Region | None = None
        self.done = self.cut = False

    @property
    def content(self) -> str:
        return "".join(self.sink.content)

    @property
    def calls(self) -> list[dict]:
        return self.sink.calls()

    def feed(self, piece: str) -> list[dict]:
        """Add generated text; return the deltas that may be sent now."""
        b, self.buf = self.buf, ""
        b += piece  # a local with one reference: CPython appends in place, so long calls stay linear
        return self._run(b, final=False)

    def finish(self, cut: bool = False) -> list[dict]:
        """The deltas held back until the end (a call cut short keeps the arguments written so far).

        Args:
            cut: the output was cut by the token limit: a start of a call marker at its very end (``<tool_c``),
                or a marked call cut before its name and arguments began, was a call, not content: it is dropped.
        """
        if self.done:
            return []
        self.done, self.cut = True, cut
        if cut and self.region is None:
            b, p = self.buf, self.p
            self.buf = b[:len(b) - partial(b[max(p, len(b) - 64):], self.markers)]
        return self._run(self.buf, final=True)

    def _run(self, b: str, final: bool) -> list[dict]:
        p, sink = self.p, self.sink

        while p < len(b) or (final and self.region is not None):
            if self.region is None:
                m = self.opener.search(b, p)
                if m is None:
                    keep = 0 if final else self._hold(b, p)
                    sink.text(b[p:len(b) - keep])
                    p = len(b) - keep
                    break
                g = m.group()
                i = m.start() if g in self.family.openers else m.end() - 1
                sink.text(b[p:i])
                p = i
                if g in self.family.openers:
                    self.region = self.family.openers[g](b, i, g, sink)
                elif b[i] != "`":
                    if _NO_CALL[b[i]].match(b, i):  # what the region would reject at once, without one
                        sink.text(b[i])
                        p = i + 1
                        continue
                    self.region = self.family.bare[b[i]](b, i, "", sink)
                elif b.startswith(FENCE, i):
                    self.region = _Fence(b, i, FENCE, sink, self.family)
                elif not final and FENCE.startswith(b[i:]):
                    break  # '`' or '``' at the end so far: a fence may follow
                else:
                    sink.text(b[i])
                    p = i + 1
                    continue
            r = self._cut_call(b) if final and self.cut else self.region.advance(b, final)
            if r is None:
                if not final:
                    break
                r = ("done", len(b)) if self.region.started else self.region.reject()  # regions decide at the end
            self.region = None
            if r[0] == "reject":
                sink.text(b[p:r[1]])
            p = r[1]
        if self.region is None:  # nothing holds indices into the buffer: drop what was read
            b, p = b[p - 1:], 1
        self.buf, self.p = b, p
        return sink.take()

    def _cut_call(self, b: str) -> tuple[str, int] | None:
        """The region's end when the token limit ended the output: a marked call that was still waiting for
        its name and arguments (more text would have told) was cut before it began and is dropped, not
        content; otherwise the region decides at the end as always."""
        region = self.region
        if region.started or region.opener not in self.family.openers:
            return region.advance(b, True)
        r = region.advance(b, False)
        if r is None:
            return ("done", len(b)) if not region.started else region.advance(b, True)
        return r

    def _hold(self, b: str, p: int) -> int:
        """How much of the end of ``b`` to hold back: a start of a marker, or a line's leading blanks (a
        bare call or a fence may follow them)."""
        keep = partial(b[max(p, len(b) - 64):], self.markers)
        nl = b.rfind("\n", p - 1)
        if nl >= 0 and len(b) - nl - 1 < 64 and b[nl + 1:].strip(" \t") == "":
            keep = max(keep, len(b) - nl - 1)
        return keep
