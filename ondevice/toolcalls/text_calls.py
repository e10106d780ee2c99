"""Call regions whose arguments are not JSON as written: Qwen3-Coder / Qwen3.5 XML (streamed a parameter at
a time), Gemma 4 ``call:name{...}`` and pythonic ``[f(a=1)]`` (LFM2, Llama 4), parsed with ``ast``, never
evaluated (each a call at a time)."""

from __future__ import annotations

import ast
import json
import re

from ondevice.toolcalls.base import MAX_HEAD, NAME, Region, Sink, skip_ws
from ondevice.toolcalls.json_calls import HermesCall


def _wait_or(b: str, i: int, lits: tuple[str, ...], final: bool) -> str | None:
    """Which of ``lits`` starts at ``i``; '' when none can; None when more text may tell."""
    for lit in lits:
        if b.startswith(lit, i):
            return lit
    if not final and any(lit.startswith(b[i:i + len(lit)]) for lit in lits) and i + max(map(len, lits)) > len(b):
        return None
    return ""


class XmlCall(Region):
    """``<tool_call>\\n<function=name>\\n<parameter=k>\\nvalue\\n</parameter>\\n</function>\\n</tool_call>``.

    A value is text; it becomes JSON by the parameter's schema type (strings stay strings; others are
    read as JSON when they parse). A JSON object after ``<tool_call>`` is read as Hermes (Qwen3 models
    given this template sometimes write it)."""

    def __init__(self, b: str, start: int, opener: str, sink: Sink) -> None:
        super().__init__(b, start, opener, sink)
        self.phase, self.index, self.n, self.key = "function", 0, 0, ""
        self.hermes: Region | None = None
        self.name = ""
        if opener == "<function=":
            self.pos, self.phase = start, "function"

    def advance(self, b: str, final: bool) -> tuple[str, int] | None:
        if self.hermes is not None:
            return self.hermes.advance(b, final)
        while True:
            i = skip_ws(b, self.pos)
            if self.phase == "function":
                if b.startswith("{", i) and self.opener == "<tool_call>":
                    self.hermes = HermesCall(b, self.start, self.opener, self.sink)
                    return self.hermes.advance(b, final)
                lit = _wait_or(b, i, ("<function=",), final)
                if lit is None:
                    return None
                j = b.find(">", i, i + MAX_HEAD)
                if not lit or j < 0:
                    return None if lit and j < 0 and not final and len(b) < i + MAX_HEAD else self.reject()
                self.name = b[i + len(lit):j]
                if not NAME.fullmatch(self.name) or not self.sink.known(self.name):
                    return self.reject()
                self.index, self.started = self.sink.start(self.name), True
                self.pos, self.phase = j + 1, "param"
            elif self.phase == "param":
                lit = _wait_or(b, i, ("<parameter=", "</function>"), final)
                if lit is None:
                    return None
                if lit == "<parameter=":
                    j = b.find(">", i, i + MAX_HEAD)
                    if j < 0:
                        if not final and len(b) < i + MAX_HEAD:
                            return None
                        return self._close(i)
                    self.key, self.pos, self.phase = b[i + len(lit):j], j + 1, "value"
                    self.search = j + 1
                    continue
                end = _wait_or(b, skip_ws(b, i + len(lit)), ("</tool_call>",), final) if lit else ""
                if end is None:
                    return None
                return self._close(skip_ws(b, i + len(lit)) + len(end) if lit else i)
            else:  # value, up to </parameter>
                j = b.find("</parameter>", self.search)
                if j < 0:
                    self.search = max(self.search, len(b) - len("</parameter>") + 1)
                    return self._close(len(b)) if final else None
                v = b[self.pos:j]
                v = v[1:] if v.startswith("\n") else v
                v = v[:-1] if v.endswith("\n") else v
                self.sink.add_args(self.index, ("{" if self.n == 0 else ", ") + json.dumps(self.key, ensure_ascii=False)
                               + ": " + json.dumps(_typed(self.sink, self.name, self.key, v), ensure_ascii=False))
                self.n += 1
                self.pos, self.phase = j + len("</parameter>"), "param"

    def _close(self, end: int) -> tuple[str, int]:
        self.sink.add_args(self.index, "}" if self.n else "{}")
        return "done", end


def gemma_to_json(text: str, q: str = '<|"|>') -> str:
    """Gemma's argument syntax (bare keys, strings between ``q``: Gemma 4's ``<|"|>``, FunctionGemma's
    ``<escape>``) as JSON text; ValueError if it is not that syntax."""
    out, i, n = [], 0, len(text)
    while i < n:
        if text.startswith(q, i):
            j = text.find(q, i + len(q))
            if j < 0:
                raise ValueError("an unclosed string")
            out.append(json.dumps(text[i + len(q):j], ensure_ascii=False))
            i = j + len(q)
        elif text[i] in "{}[],:":
            out.append(text[i])
            i += 1
        elif text[i].isspace():
            i += 1
        else:
            m = _GEMMA_TOKEN.match(text, i)
            if m is None:
                raise ValueError(f"unexpected {text[i]!r}")
            tok, i = m.group(), m.end()
            if text.startswith(":", skip_ws(text, i)):
                out.append(json.dumps(tok))
            else:
                try:
                    json.loads(tok)
                    out.append(tok)
                except json.JSONDecodeError:
                    out.append(json.dumps(tok))
    return "".join(out)


class GemmaCall(Region):
    """Gemma 4: ``<|tool_call>call:name{key:<|"|>text<|"|>,n:3}<tool_call|>``; sent when complete."""

    END, QUOTE = "<tool_call|>", '<|"|>'

    def __init__(self, b: str, start: int, opener: str, sink: Sink) -> None:
        super().__init__(b, start, opener, sink)
        self.search = self.pos

    def advance(self, b: str, final: bool) -> tuple[str, int] | None:
        j = b.find(self.END, self.search)
        if j < 0:
            self.search = max(self.search, len(b) - len(self.END) + 1)
            return self.reject() if final else None
        m = _GEMMA_CALL.fullmatch(b, self.pos, j)
        if m is None or not self.sink.known(m.group(1)):
            return self.reject()
        try:
            args = json.loads(gemma_to_json(m.group(2), self.QUOTE))
        except (ValueError, RecursionError):
            return self.reject()
        if not isinstance(args, dict):
            return self.reject()
        self.started = True
        self.sink.add_args(self.sink.start(m.group(1)), json.dumps(args, ensure_ascii=False))
        return "done", j + len(self.END)


class FunctionGemmaCall(GemmaCall):
    """FunctionGemma (Gemma 3 270M): ``<start_function_call>call:name{k:<escape>v<escape>}<end_function_call>``."""

    END, QUOTE = "<end_function_call>", "<escape>"


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


def pythonic_calls(src: str) -> list[tuple[str, dict]] | None:
    """``[f(a=1), g(b="x")]`` → [(name, arguments)], read with ``ast`` (literals only, never evaluated);
    None when it is not such a list."""
    try:
        tree = ast.parse(src.strip(), mode="eval").body
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        out = []
        for call in tree.elts:
            name = _dotted(call.func) if isinstance(call, ast.Call) else None
            if name is None or call.args or any(k.arg is None for k in call.keywords):
                return None
            out.append((name, {k.arg: ast.literal_eval(k.value) for k in call.keywords}))
        return out
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return None


_PY_START = re.compile(rf"\[\s*{NAME.pattern}\s*\(")
_PY_PREFIX = re.compile(r"\[\s*[A-Za-z0-9_.\-]{0,64}\s*")  # what may still become _PY_START
_GEMMA_TOKEN = re.compile(r"[^{}\[\],:\s<]+")
_GEMMA_CALL = re.compile(rf"\s*call:({NAME.pattern})(\{{.*\}})\s*", re.DOTALL)


class PythonicCall(Region):
    """``<|tool_call_start|>[f(a=1)]<|tool_call_end|>`` (LFM2) or a bare ``[f(a=1), g(b="x")]`` line
    (LFM2.5, Llama 4); every call must name a tool, or it is all text."""

    END = "<|tool_call_end|>"

    def __init__(self, b: str, start: int, opener: str, sink: Sink) -> None:
        super().__init__(b, start, opener, sink)
        self.search = self.pos

    def advance(self, b: str, final: bool) -> tuple[str, int] | None:
        if self.opener:
            j = b.find(self.END, self.search)
            if j < 0:
                self.search = max(self.search, len(b) - len(self.END) + 1)
                if not final:
                    return None
                j = len(b)
            end = min(j + len(self.END), len(b))
        else:  # bare: one line that starts '[name(' and ends ']'
            if not _PY_START.match(b, self.pos, min(len(b), self.pos + MAX_HEAD)):
                wait = not final and len(b) < self.pos + MAX_HEAD and _PY_PREFIX.fullmatch(b, self.pos)
                return None if wait else self.reject()
            j = b.find("\n", self.search)
            if j < 0:
                self.search = len(b)
                if not final:
                    return None
                j = len(b)
            end = j
        calls = pythonic_calls(b[self.pos:j])
        if not calls or not all(self.sink.known(n) for n, _ in calls):
            return self.reject()
        self.started = True
        for name, args in calls:
            try:
                text = json.dumps(args, ensure_ascii=False)
            except (TypeError, ValueError):  # a set or bytes literal: not JSON
                text = json.dumps({k: repr(v) for k, v in args.items()}, ensure_ascii=False)
            self.sink.add_args(self.sink.start(name), text)
        return "done", end


class GlmCall(Region):
    """GLM-4.5 / 4.6 / 4.7: ``<tool_call>name\\n<arg_key>k</arg_key>\\n<arg_value>v</arg_value>\\n</tool_call>``;
    a value is text, JSON by the parameter's schema type (as ``XmlCall``); streamed a parameter at a time."""

    def __init__(self, b: str, start: int, opener: str, sink: Sink) -> None:
        super().__init__(b, start, opener, sink)
        self.phase, self.index, self.n, self.key, self.name, self.search = "name", 0, 0, "", "", 0

    def advance(self, b: str, final: bool) -> tuple[str, int] | None:
        while True:
            if self.phase == "name":
                m = _GLM_NAME_END.search(b, self.pos, self.pos + MAX_HEAD)
                if m is None:
                    return None if not final and len(b) < self.pos + MAX_HEAD else self.reject()
                self.name = b[self.pos:m.start()].strip()
                if not NAME.fullmatch(self.name) or not self.sink.known(self.name):
                    return self.reject()
                self.index, self.started = self.sink.start(self.name), True
                self.pos, self.phase = m.start(), "key"
                continue
            i = skip_ws(b, self.pos)
            if self.phase == "key":
                lit = _wait_or(b, i, ("<arg_key>", "</tool_call>"), final)
                if lit is None:
                    return None
                if lit != "<arg_key>":
                    return self._close(i + len(lit))
                j = b.find("</arg_key>", i, i + MAX_HEAD)
                if j < 0:
                    return None if not final and len(b) < i + MAX_HEAD else self._close(i)
                self.key, self.pos, self.phase = b[i + len(lit):j].strip(), j + len("</arg_key>"), "value"
            else:
                lit = _wait_or(b, i, ("<arg_value>",), final)
                if lit is None:
                    return None
                if not lit:
                    return self._close(i)
                self.search = max(self.search, i + len(lit))
                j = b.find("</arg_value>", self.search)
                if j < 0:
                    self.search = max(self.search, len(b) - len("</arg_value>") + 1)
                    return self._close(len(b)) if final else None
                v = b[i + len(lit):j]
                self.sink.add_args(self.index, ("{" if self.n == 0 else ", ") + json.dumps(self.key, ensure_ascii=False)
                                   + ": " + json.dumps(_typed(self.sink, self.name, self.key, v), ensure_ascii=False))
                self.n += 1
                self.pos, self.phase, self.search = j + len("</arg_value>"), "key", 0

    def _close(self, end: int) -> tuple[str, int]:
        self.sink.add_args(self.index, "}" if self.n else "{}")
        return "done", end


_GLM_NAME_END = re.compile(r"\n|<arg_key>|</tool_call>")


def _typed(sink: Sink, name: str, key: str, v: str):
    """A parameter's text as its schema type: strings (or no schema) stay text, others are JSON if they parse."""
    spec = ((sink.params.get(name) or {}).get("properties") or {}).get(key)
    if not isinstance(spec, dict) or spec.get("type", "string") == "string":
        return v
    try:
        return json.loads(v)
    except json.JSONDecodeError:
        return v
