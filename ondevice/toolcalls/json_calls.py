"""Call regions whose arguments are JSON, streamed as written: Hermes / Qwen, Llama 3.x, Mistral (both
forms), DeepSeek (R1 and V3.1) and gpt-oss harmony."""

from __future__ import annotations

import re

from ondevice.toolcalls.base import MAX_HEAD, ObjectScan, Region, Sink, json_str, skip_ws, value_text

_NAME = r"[A-Za-z0-9_.\-]{1,64}"


def _closers(b: str, i: int, closers: tuple[str, ...], final: bool) -> int | None:
    """Consume optional closing markers in order (blanks between them); None: wait for more text."""
    for lit in closers:
        j = skip_ws(b, i)
        if b.startswith(lit, j):
            i = j + len(lit)
        elif not final and (j >= len(b) or (lit.startswith(b[j:j + len(lit)]) and j + len(lit) > len(b))):
            return None
        elif final and j < len(b) and lit.startswith(b[j:]):  # the output ends inside the closer: cut there
            return len(b)
    return i


class _Args:
    """Streams one call's arguments (a JSON value starting at ``start``) into the sink as they arrive."""

    def __init__(self, sink: Sink, name: str) -> None:
        self.sink, self.index, self.sent = sink, sink.start(name), None

    def send(self, b: str, span: list, upto: int) -> None:
        """``span`` = [value start, value end or None]; ``upto``: how far the text has been read."""
        if b[span[0]] in "{[":
            end = span[1] if span[1] is not None else upto
            start = span[0] if self.sent is None else self.sent
            self.sink.add_args(self.index, b[start:end])
            self.sent = end
        elif span[1] is not None and self.sent is None:  # a string or a literal: sent whole, decoded
            raw = value_text(b, span)
            s = json_str(raw)
            self.sink.add_args(self.index, "{}" if raw == "null" else (s if s is not None else raw))
            self.sent = span[1]


class JsonCall(Region):
    """``opener`` (or none), then one ``{"name": ..., "arguments" | "parameters": {...}}`` object, then the
    optional ``closers`` (Hermes / Qwen ``<tool_call>``, Llama 3.x, Mistral's list entries, bare JSON)."""

    closers: tuple[str, ...] = ()
    arg_keys = ("arguments", "parameters")

    def __init__(self, b: str, start: int, opener: str, sink: Sink) -> None:
        super().__init__(b, start, opener, sink)
        self.scan: ObjectScan | None = None
        self.name: str | None = None
        self.out: _Args | None = None

    def advance(self, b: str, final: bool) -> tuple[str, int] | None:
        if self.scan is None:
            i = skip_ws(b, self.pos)
            if i >= len(b):
                return None if not final else self.reject()
            if b[i] != "{":
                return self.reject()
            self.scan = ObjectScan(i)
        sc = self.scan
        if sc.end is None:
            sc.advance(b)  # the commit below depends only on the text before any bad character: cut-invariant
            if self.name is None and (raw := value_text(b, sc.members.get("name"))) is not None:
                name = json_str(raw)
                if name is None or not self.sink.known(name):
                    return self.reject()
                self.name = name
            key = next((k for k in self.arg_keys if k in sc.members), None)
            if self.name is not None and key is not None:
                if self.out is None:
                    self.out, self.started = _Args(self.sink, self.name), True
                self.out.send(b, sc.members[key], sc.pos)
            if sc.bad:
                return self.reject() if not self.started else ("done", sc.pos)
            if sc.end is None:
                if not final:
                    return None
                return ("done", len(b)) if self.started else self.reject()
            if self.name is None:
                return self.reject()
            if self.out is None:  # a call without arguments
                self.out, self.started = _Args(self.sink, self.name), True
                self.sink.add_args(self.out.index, "{}")
            self.pos = sc.end
        end = _closers(b, self.pos, self.closers, final)
        return None if end is None else ("done", end)


class HermesCall(JsonCall):
    closers = ("</tool_call>",)


class HeadArgs(Region):
    """A header that names the function (matched whole by ``head``, group 'name'), then the arguments
    object, then optional ``closers``: Mistral ``name[ARGS]{...}``, DeepSeek, harmony."""

    head: re.Pattern
    closers: tuple[str, ...] = ()

    def __init__(self, b: str, start: int, opener: str, sink: Sink) -> None:
        super().__init__(b, start, opener, sink)
        self.scan: ObjectScan | None = None
        self.out: _Args | None = None

    def advance(self, b: str, final: bool) -> tuple[str, int] | None:
        if self.scan is None:
            j = b.find("{", self.pos, self.pos + MAX_HEAD)
            if j < 0:
                return None if not final and len(b) < self.pos + MAX_HEAD else self.reject()
            m = self.head.fullmatch(b, self.pos, j)
            name = next((g for g in m.groups() if g), None) if m else None
            if not name or not self.sink.known(name):
                return self.reject()
            self.scan, self.obj = ObjectScan(j), j
            self.out, self.started = _Args(self.sink, name), True
        sc = self.scan
        if sc.end is None:
            sc.advance(b)
            self.out.send(b, [self.obj, sc.end], sc.pos)  # up to a bad character too: cut-invariant
            if sc.bad:
                return "done", sc.pos
            if sc.end is None:
                return ("done", len(b)) if final else None
            self.pos = sc.end
        end = _closers(b, self.pos, self.closers, final)
        return None if end is None else ("done", end)


class Drop(Region):
    """A marker that carries nothing (DeepSeek's ``<｜tool▁calls▁begin｜>``): dropped from content."""

    def advance(self, b: str, final: bool) -> tuple[str, int] | None:
        return "done", self.pos


class MistralCalls(Region):
    """``[TOOL_CALLS]`` then a JSON list of call objects (Mistral v0.3, Nemo) or ``name[ARGS]{...}``
    (``name[CALL_ID]id[ARGS]{...}`` in Mistral Small 3.2; Ministral / Magistral / Devstral)."""

    class Named(HeadArgs):
        head = re.compile(rf"\s*({_NAME})(?:\[CALL_ID\][A-Za-z0-9]{{1,64}})?\[ARGS\]\s*")

    def __init__(self, b: str, start: int, opener: str, sink: Sink) -> None:
        super().__init__(b, start, opener, sink)
        self.inner: Region | None = None
        self.listing = False

    def advance(self, b: str, final: bool) -> tuple[str, int] | None:
        while True:
            if self.inner is None:
                i = skip_ws(b, self.pos)
                if i >= len(b):
                    return None if not final else (("done", self.pos) if self.started else self.reject())
                if not self.listing and b[i] == "[":
                    self.listing, self.pos = True, i + 1
                    continue
                if self.listing:
                    if b[i] == "]" and self.started:
                        return "done", i + 1
                    if b[i] == "," and self.started:
                        self.pos = i + 1
                        continue
                    self.inner = JsonCall(b, i, "", self.sink)
                else:
                    self.inner = self.Named(b, self.pos, "", self.sink)
            r = self.inner.advance(b, final)
            if r is None:
                return None
            start, self.inner = self.inner.start, None
            if r[0] == "reject":  # text after the calls so far (or no call at all)
                return ("done", start) if self.started else self.reject()
            self.started, self.pos = True, r[1]
            if not self.listing:
                return r


class DeepSeekCall(HeadArgs):
    """``<｜tool▁call▁begin｜>`` then R1's ``function<｜tool▁sep｜>name\n```json\n{...}\n```<｜tool▁call▁end｜>``
    or V3.1's ``name<｜tool▁sep｜>{...}<｜tool▁call▁end｜>``."""

    head = re.compile(rf"\s*(?:function<｜tool▁sep｜>({_NAME})\s*```(?:json)?\s*|({_NAME})<｜tool▁sep｜>\s*)")
    closers = ("```", "<｜tool▁call▁end｜>")


class HarmonyCall(HeadArgs):
    """gpt-oss: ``<|channel|>commentary to=functions.name <|constrain|>json<|message|>{...}<|call|>`` or the
    recipient first, ``to=functions.name<|channel|>commentary json<|message|>{...}<|call|>`` (as
    ``ondevice.reasoning`` passes a tool message through)."""

    head = re.compile(rf"(?:<\|channel\|>\w+\s+)?(?:to=functions\.({_NAME}))\s*(?:<\|channel\|>\w+)?\s*"
                      r"(?:<\|constrain\|>)?\s*(?:json)?\s*<\|message\|>\s*")
    closers = ("<|call|>",)

    def __init__(self, b: str, start: int, opener: str, sink: Sink) -> None:
        super().__init__(b, start, opener, sink)
        self.pos = start  # the header includes the opener
