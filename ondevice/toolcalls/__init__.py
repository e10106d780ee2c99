"""Tool calls in every major family's own format: picked from the chat template, parsed whole or streamed
(arguments streamed as OpenAI streams them), and messages shaped so each family's template renders past
calls and tool results.

Families (``detect`` reads the template text):
  - ``hermes``: Hermes / Qwen2.5 / Qwen3 ``<tool_call>{"name", "arguments"}</tool_call>`` (and the bare
    object a template with special-token tags leaves);
  - ``qwen3_coder``: Qwen3-Coder / Qwen3.5 ``<tool_call><function=f><parameter=k>v</parameter>…``;
  - ``glm``: GLM-4.5 / 4.6 / 4.7 ``<tool_call>f\n<arg_key>k</arg_key>\n<arg_value>v</arg_value></tool_call>``;
  - ``llama3``: Llama 3.x ``{"name", "parameters"}``, bare or after ``<|python_tag|>``;
  - ``mistral``: ``[TOOL_CALLS][{...}, ...]`` (v0.3, Nemo) and ``[TOOL_CALLS]f[ARGS]{...}`` (Small 3.2,
    Ministral, Magistral, Devstral); ids of 9 letters / digits, as their templates require;
  - ``deepseek``: ``<｜tool▁call▁begin｜>`` in R1's and V3.1's forms;
  - ``harmony``: gpt-oss ``<|channel|>commentary to=functions.f <|constrain|>json<|message|>{...}<|call|>``
    (run ``ondevice.reasoning.Splitter`` first: it passes these through and takes the analysis out);
  - ``gemma4``: ``<|tool_call>call:f{k:<|"|>v<|"|>}<tool_call|>``; ``function_gemma`` (FunctionGemma, the
    Gemma 3 tool model): ``<start_function_call>call:f{k:<escape>v<escape>}<end_function_call>`` (Gemma 3's
    own template has no tool format);
  - ``pythonic``: ``[f(a=1), g(b="x")]`` (LFM2 / LFM2.5, Llama 4), read with ``ast``, never evaluated;
  - ``json``: any other template: a bare ``{"name", "arguments"}`` object on its own line.
Every family also finds its calls inside a markdown code fence.

API:
  ``detect(template) -> str``; ``parse(text, family, tools) -> (content or None, calls)``;
  ``CallStream(get(family), tools)``: ``feed(piece) -> [delta]``, ``finish() -> [delta]``, then
  ``.content`` / ``.calls``; ``template_messages(messages, family)``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

from ondevice.toolcalls.base import call_id
from ondevice.toolcalls.engine import CallStream, Family
from ondevice.toolcalls.json_calls import DeepSeekCall, Drop, HarmonyCall, HermesCall, JsonCall, MistralCalls
from ondevice.toolcalls.text_calls import FunctionGemmaCall, GemmaCall, GlmCall, PythonicCall, XmlCall

__all__ = ["FAMILIES", "CallStream", "Family", "call_id", "detect", "get", "parse", "template_messages"]


class _LlamaCall(JsonCall):
    arg_keys = ("parameters", "arguments")


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("hermes", {"<tool_call>": HermesCall}, {"{": JsonCall}),
    Family("qwen3_coder", {"<tool_call>": XmlCall, "<function=": XmlCall}),
    Family("glm", {"<tool_call>": GlmCall}),
    Family("llama3", {"<|python_tag|>": _LlamaCall}, {"{": _LlamaCall}),
    Family("mistral", {"[TOOL_CALLS]": MistralCalls}, id_style="mistral"),
    Family("deepseek", {"<｜tool▁calls▁begin｜>": Drop, "<｜tool▁calls▁end｜>": Drop,
                        "<｜tool▁call▁begin｜>": DeepSeekCall}),
    Family("harmony", {"<|channel|>": HarmonyCall, "to=functions.": HarmonyCall}),
    Family("gemma4", {"<|tool_call>": GemmaCall}),
    Family("function_gemma", {"<start_function_call>": FunctionGemmaCall}),
    Family("pythonic", {"<|tool_call_start|>": PythonicCall}, {"[": PythonicCall}),
    Family("json", {}, {"{": JsonCall}),
)}


def detect(template: str | None) -> str:
    """The tool-call family a chat template speaks, from the markers in its text ('json' when none)."""
    t = template or ""
    if "<|channel|>" in t:
        return "harmony"
    if "<|tool_call>" in t:
        return "gemma4"
    if "<start_function_call>" in t:
        return "function_gemma"
    if "<arg_key>" in t:
        return "glm"
    if "<tool_call>" in t:
        return "qwen3_coder" if "<function=" in t else "hermes"
    if "[TOOL_CALLS]" in t:
        return "mistral"
    if "tool▁call▁begin" in t:
        return "deepseek"
    if "<|tool_call_start|>" in t or "<|tool_list_start|>" in t or "List of tools: [" in t:
        return "pythonic"
    if "<|start_header_id|>" in t and ("<|python_tag|>" in t or "ipython" in t):
        return "llama3"
    return "json"


def get(family: str) -> Family:
    """The family's parser description (``FAMILIES``); KeyError names the known ones."""
    try:
        return FAMILIES[family]
    except KeyError:
        raise KeyError(f"unknown tool-call family {family!r}; known: {', '.join(FAMILIES)}") from None


def parse(text: str, family: str, tools: Sequence[dict] | None) -> tuple[str | None, list[dict]]:
    """A whole answer split into (content stripped, or None when empty; OpenAI ``tool_calls``).

    The streaming parser fed once: what ``CallStream`` gives for any cut of ``text`` into pieces. Text that
    is not a well-formed call to one of ``tools`` stays content; this never raises on model output.
    """
    s = CallStream(get(family), tools)
    s.feed(text)
    s.finish()
    return s.content.strip() or None, s.calls


def _mistral_id(cid: str) -> str:
    if len(cid) == 9 and cid.isalnum():
        return cid
    return hashlib.sha256(cid.encode()).hexdigest()[:9]


def template_messages(messages: Sequence[dict], family: str) -> list[dict]:
    """OpenAI messages as the family's template expects them.

    For all: a missing content is '', a call's arguments are an object (templates ``tojson`` them) and its
    name / arguments are also at the call's top level (Qwen's templates read either). ``mistral``: ids
    mapped to 9 letters / digits, the same in calls and results. ``gemma4``: the tool results after an
    assistant's calls move into that message's ``tool_responses`` (with a following plain answer as its
    content), as Gemma 4's template reads them (llama.cpp does the same).
    """
    out = []
    for m in messages:
        m = dict(m)
        if m.get("content") is None:
            m["content"] = ""
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                fn = dict(c.get("function") or {})
                if isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json.loads(fn["arguments"])
                    except json.JSONDecodeError:
                        pass  # the template shows it as text
                c = {**c, "function": fn, **fn}
                if family == "mistral" and isinstance(c.get("id"), str):
                    c["id"] = _mistral_id(c["id"])
                calls.append(c)
            m["tool_calls"] = calls
        if family == "mistral" and m.get("role") == "tool" and isinstance(m.get("tool_call_id"), str):
            m["tool_call_id"] = _mistral_id(m["tool_call_id"])
        out.append(m)
    return _gemma4_turns(out) if family == "gemma4" else out


def _gemma4_turns(messages: list[dict]) -> list[dict]:
    out, i = [], 0
    while i < len(messages):
        m = messages[i]
        i += 1
        if m.get("role") != "assistant" or not m.get("tool_calls"):
            out.append(m)
            continue
        m, responses = dict(m), []
        while i < len(messages) and messages[i].get("role") == "tool":
            r = messages[i].get("content")
            try:
                r = json.loads(r) if isinstance(r, str) else r
            except json.JSONDecodeError:
                pass
            k = len(responses)
            name = m["tool_calls"][k]["function"].get("name") if k < len(m["tool_calls"]) else None
            responses.append({"name": name or messages[i].get("tool_call_id", ""), "response": r})
            i += 1
        if responses:
            m["tool_responses"] = responses
        nxt = messages[i] if i < len(messages) else None
        if nxt and nxt.get("role") == "assistant" and not nxt.get("tool_calls") and nxt.get("content"):
            m["content"] = nxt["content"]
            i += 1
        out.append(m)
    return out
