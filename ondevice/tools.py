"""Tool calls: OpenAI ``tools`` checked, and the constrained call of ``tool_choice`` 'required' or a named
function.

"auto" lets the model choose and parses what it wrote in its template's family format
(``ondevice.toolcalls``); "required" or a named function constrains the answer to one call whose arguments
follow the function's JSON schema (llguidance's Lark with an embedded ``%json`` schema), in one of two
formats (``call_format``), which parse as the toolcalls families of the same names:
  - ``hermes``: when the chat template mentions ``<tool_call>``:
    ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``;
  - ``json``: any other template: the answer is one ``{"name": ..., "arguments": {...}}`` object.
"none" leaves the tools out.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from ondevice.constrain import JSON_OPTIONS
from ondevice.errors import OndeviceError

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def check_tools(tools: Any) -> list[dict]:
    """OpenAI ``tools`` ([{"type": "function", "function": {"name", "parameters"?, "description"?}}]), checked.

    Raises:
        OndeviceError: naming the entry and what is wrong.
    """
    if not isinstance(tools, list) or not tools:
        raise OndeviceError("tools must be a non-empty list of {'type': 'function', 'function': {...}} objects")
    names = set()
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, Mapping) else None
        if not isinstance(t, Mapping) or t.get("type") != "function" or not isinstance(fn, Mapping):
            raise OndeviceError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': {{...}}}}}}")
        name = fn.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
            raise OndeviceError(f"tools[{i}].function.name must be 1-64 letters, digits, '_', '.' or '-'")
        if name in names:
            raise OndeviceError(f"tools[{i}].function.name {name!r} is given twice")
        names.add(name)
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, Mapping):
            raise OndeviceError(f"tools[{i}].function.parameters must be a JSON schema object")
        from ondevice.constrain import json_grammar

        try:
            json_grammar(params)
        except OndeviceError as e:
            raise OndeviceError(f"tools[{i}].function.parameters: {e}") from None
    return list(tools)


def choice_of(tool_choice: Any, tools: Sequence[dict]) -> str:
    """'auto' | 'none' | 'required' | a function's name, from OpenAI's ``tool_choice`` (default 'auto')."""
    if tool_choice is None:
        return "auto"
    if tool_choice in ("auto", "none", "required"):
        return tool_choice
    fn = tool_choice.get("function") if isinstance(tool_choice, Mapping) else None
    name = fn.get("name") if isinstance(fn, Mapping) else None
    if not isinstance(tool_choice, Mapping) or tool_choice.get("type") != "function" or not isinstance(name, str):
        raise OndeviceError("tool_choice must be 'auto', 'none', 'required' or {'type': 'function', 'function': {'name': ...}}")
    if name not in {t["function"]["name"] for t in tools}:
        raise OndeviceError(f"tool_choice names {name!r}, which is not among the tools")
    return name


def call_format(chat_template: str | None) -> str:
    """'hermes' when the template writes ``<tool_call>`` blocks (Qwen2.5, Hermes), else 'json'."""
    return "hermes" if chat_template and HERMES_OPEN in chat_template else "json"


def _call_schema(tools: Sequence[dict], choice: str) -> dict:
    """JSON schema of one call: {"name": const, "arguments": the function's parameters}, any allowed function."""
    options = []
    for t in tools:
        fn = t["function"]
        if choice in ("required", fn["name"]):
            options.append({"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                            "properties": {"name": {"const": fn["name"]},
                                           "arguments": fn.get("parameters") or {"type": "object", "properties": {}}}})
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, "x-guidance": JSON_OPTIONS}


def call_grammar(tools: Sequence[dict], choice: str, fmt: str) -> str:
    """The Lark grammar (llguidance dialect) of an answer that is one call, for 'required' or a named function."""
    schema = json.dumps(_call_schema(tools, choice))
    if fmt == "hermes":
        return f'start: "{HERMES_OPEN}\\n" call "\\n{HERMES_CLOSE}"\ncall: %json {schema}'
    return f"start: call\ncall: %json {schema}"


def template_messages(messages: Sequence[dict], family: str = "json") -> list[dict]:
    """OpenAI messages as ``family``'s chat template expects them: ``ondevice.toolcalls.template_messages``."""
    from ondevice import toolcalls

    return toolcalls.template_messages(messages, family)


def parse_calls(text: str, family: str, tools: Sequence[dict]) -> tuple[str | None, list[dict]]:
    """Split a model's whole answer into (content, OpenAI ``tool_calls``) in ``family``'s format ('hermes',
    'json' or any of ``ondevice.toolcalls.FAMILIES``): ``ondevice.toolcalls.parse``.

    Returns:
        (the text outside the calls, stripped, or None when empty; the calls, in order).
    """
    from ondevice import toolcalls

    return toolcalls.parse(text, family, tools)
