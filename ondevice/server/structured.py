"""OpenAI's structured-output fields: ``response_format``, ``grammar``, ``tools`` / ``tool_choice``,
``logprobs`` / ``top_logprobs``, ``chat_template_kwargs``, ``reasoning_format``, ``reasoning_budget`` /
``reasoning_effort``.

Request side: one function per field group (``chat_logprobs_args``, ``completion_logprobs_args``,
``response_format_args``, ``grammar_args``, ``tool_args``, ``no_tool_args``, ``template_args``,
``reasoning_args``, ``budget_args``) validates it
(``ApiError`` 400 in OpenAI's shape, naming the field) into a ``Structured``: what the runtime and the reply
need; each dialect calls the ones it speaks. Response side: ``Answer`` splits the output into thinking,
content and tool calls (in the template's family format), whole or streamed; ``split_answer`` for a whole text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from ondevice import toolcalls as TC
from ondevice import tools as T
from ondevice.constrain import grammar_text
from ondevice.errors import OndeviceError
from ondevice.params import MAX_TOP_LOGPROBS
from ondevice.reasoning import Splitter, Thinking
from ondevice.server.errors import FINISH, ApiError

MAX_SCHEMA_CHARS = 200_000  # JSON of a response_format schema, or of all tools: about 1 s to compile on a laptop
MAX_TOOLS = 128  # as OpenAI


@dataclass
class Structured:
    """What a request's structured fields ask for.

    Attributes:
        run: extra keyword arguments for ``Runtime.stream`` (response_format / grammar, logprobs, top_logprobs).
        tools: the checked tools to render into the prompt (None: no tools, or tool_choice 'none').
        family: the template's tool-call family (``ondevice.toolcalls.detect``): how past calls render.
        forced: 'hermes' | 'json' when tool_choice forces one call (``ondevice.tools.call_grammar``'s format,
            which is also how it parses), else None.
        logprobs: whether the reply carries logprobs.
        variables: template variables from ``chat_template_kwargs``.
        thinking: the template's thinking convention for this prompt (``ondevice.reasoning.detect``).
        split_thinking: False when the request asks for thinking left in the content (``reasoning_format``).
    """

    run: dict = field(default_factory=dict)
    tools: list | None = None
    family: str = "json"
    forced: str | None = None
    logprobs: bool = False
    variables: dict = field(default_factory=dict)
    thinking: Thinking | None = None
    split_thinking: bool = True

    @property
    def call_family(self) -> str:
        """The family the answer's calls are parsed with."""
        return self.forced or self.family


def _bad(param: str, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, f"'{param}': {message}", param=param, code=code)


def chat_logprobs_args(body: dict, out: Structured) -> None:
    """Chat's ``logprobs`` (a boolean) and ``top_logprobs`` (an integer 0-20, needs logprobs)."""
    lp, top = body.get("logprobs"), body.get("top_logprobs")
    if lp not in (None, True, False):
        raise _bad("logprobs", "must be a boolean")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS):
        raise _bad("top_logprobs", f"must be an integer in [0, {MAX_TOP_LOGPROBS}]")
    if top and not lp:
        raise _bad("top_logprobs", "needs 'logprobs': true")
    _logprobs(out, bool(lp), top or 0)


def completion_logprobs_args(body: dict, out: Structured) -> None:
    """A text completion's ``logprobs``: an integer 0-5, the alternatives per token."""
    lp = body.get("logprobs")
    if lp is not None and (isinstance(lp, bool) or not isinstance(lp, int) or not 0 <= lp <= 5):
        raise _bad("logprobs", "must be an integer in [0, 5] (alternatives per token)")
    _logprobs(out, lp is not None, lp or 0)


def _logprobs(out: Structured, on: bool, n_top: int) -> None:
    out.logprobs = on
    if on:
        out.run.update(logprobs=True, top_logprobs=n_top)


def response_format_args(body: dict, out: Structured) -> None:
    """``response_format``: text, json_object or json_schema (compiled here: a bad schema is a 400)."""
    rf = body.get("response_format")
    if rf is None:
        return
    if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
        raise _bad("response_format", "must be {'type': 'text' | 'json_object' | 'json_schema', ...}")
    if rf["type"] == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict):
            raise _bad("response_format", "json_schema needs {'name': ..., 'schema': {...}, 'strict': true}")
        rf = {"type": "json_schema", "json_schema": {**js, "schema": js.get("schema", {})}}
        _cap_size("response_format", "the schema", rf["json_schema"]["schema"])
    if rf["type"] != "text":
        try:
            grammar_text(rf)  # a bad schema is a 400 naming response_format, before any decoding
        except OndeviceError as e:
            raise _bad("response_format", str(e)) from None
        out.run["response_format"] = rf


def tool_args(body: dict, chat_template: str | None, out: Structured) -> None:
    """``tools`` and ``tool_choice``: the tools to render and, for 'required' or a named function, the grammar
    of one call (``chat_template``: the model's template, which says the call format)."""
    out.family = TC.detect(chat_template)
    tools = body.get("tools")
    if tools is None:
        if body.get("tool_choice") not in (None, "none", "auto"):
            raise _bad("tool_choice", "needs 'tools'")
        return
    if isinstance(tools, list) and len(tools) > MAX_TOOLS:
        raise _bad("tools", f"{len(tools)} tools given; the limit is {MAX_TOOLS} per request")
    _cap_size("tools", "the list of tools", tools)
    try:
        tools = T.check_tools(tools)
        choice = T.choice_of(body.get("tool_choice"), tools)
    except OndeviceError as e:
        raise _bad("tools" if "tool_choice" not in str(e) else "tool_choice", str(e)) from None
    if choice != "none":
        out.tools = tools
        if choice != "auto":
            if "response_format" in out.run or "grammar" in out.run:
                raise _bad("tool_choice", f"{choice!r} forces a tool call; it cannot be combined with "
                           f"{'response_format' if 'response_format' in out.run else 'grammar'}")
            out.forced = T.call_format(chat_template)
            out.run["grammar"] = T.call_grammar(tools, choice, out.forced)


def grammar_args(body: dict, out: Structured) -> None:
    """``grammar`` (an extension, as llama-server's): a Lark or GBNF grammar the answer must follow."""
    g = body.get("grammar")
    if g is None:
        return
    if not isinstance(g, str) or not g.strip():
        raise _bad("grammar", "must be a non-empty string (a Lark or GBNF grammar)")
    if "response_format" in out.run:
        raise _bad("grammar", "give either response_format or grammar, not both")
    if len(g) > MAX_SCHEMA_CHARS:
        raise _bad("grammar", f"is {len(g):,} characters; the limit is {MAX_SCHEMA_CHARS:,}")
    out.run["grammar"] = g


_OWN_VARIABLES = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token")


_FLAGS = ("enable_thinking", "thinking")  # template switches the families test with `if` (booleans only)


def template_args(body: dict, out: Structured) -> None:
    """``chat_template_kwargs`` (as vLLM and llama-server take it): extra variables for the chat template,
    e.g. ``{"enable_thinking": false}``."""
    kw = body.get("chat_template_kwargs")
    if kw is None:
        return
    if not isinstance(kw, dict) or not all(isinstance(k, str) and k.isidentifier() for k in kw):
        raise _bad("chat_template_kwargs", "must be an object of template variables, e.g. {'enable_thinking': false}")
    own = [k for k in kw if k in _OWN_VARIABLES]
    if own:
        raise _bad("chat_template_kwargs", f"{own[0]!r} is set by the server; give it in its own field")
    kw = {k: v for k, v in kw.items() if not (k in _FLAGS and v is None)}  # null: the template's default
    flag = next((k for k in _FLAGS if k in kw and not isinstance(kw[k], bool)), None)
    if flag is not None:  # Jinja takes any non-empty string as true: "false" would turn thinking on
        raise _bad("chat_template_kwargs", f"{flag} must be true or false (a JSON boolean), not {kw[flag]!r}")
    _cap_size("chat_template_kwargs", "the variables", kw)
    out.variables = dict(kw)


def reasoning_args(body: dict, out: Structured) -> None:
    """``reasoning_format`` (llama-server's): 'auto' (default) or 'deepseek' split thinking into
    ``reasoning_content``; 'none' leaves it, tags and all, in the content."""
    fmt = body.get("reasoning_format", "auto")
    if fmt not in ("auto", "deepseek", "none"):
        raise _bad("reasoning_format", "must be 'auto', 'deepseek' or 'none'")
    out.split_thinking = fmt != "none"


# OpenAI's reasoning_effort as thinking-token budgets (``GenerateRequest.reasoning_budget``)
EFFORT_BUDGETS = {"none": 0, "minimal": 64, "low": 256, "medium": 1024, "high": 4096}


def budget_args(body: dict, thinking: Thinking | None, default: int | None, out: Structured) -> None:
    """``reasoning_budget`` (llama-server's: thinking tokens at most, -1 = unbounded) or OpenAI's
    ``reasoning_effort`` (``EFFORT_BUDGETS``), else the server's ``--reasoning-budget``, into ``out.run``.

    Args:
        thinking: the prompt's thinking convention: an explicit budget on a model without one is a 400;
            ``reasoning_effort`` and the server's default are ignored there (as for any non-thinking model).
        default: the server's budget (None: unbounded).
    """
    budget, effort = body.get("reasoning_budget"), body.get("reasoning_effort")
    if budget is not None and effort is not None:
        raise _bad("reasoning_budget", "give either reasoning_budget or reasoning_effort, not both")
    if budget is not None:
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < -1:
            raise _bad("reasoning_budget", "must be an integer >= 0 (thinking tokens), or -1 for unbounded")
        if thinking is None and budget >= 0:
            raise _bad("reasoning_budget", "this model's chat template has no thinking convention; drop "
                       "reasoning_budget", code="unsupported_value")
        budget = None if budget < 0 else budget
    elif effort is not None:
        if effort not in EFFORT_BUDGETS:
            raise _bad("reasoning_effort", f"must be one of {', '.join(EFFORT_BUDGETS)}")
        budget = EFFORT_BUDGETS[effort]
    else:
        budget = default
    if budget is not None and thinking is not None:
        out.run["reasoning_budget"] = budget


def _cap_size(param: str, what: str, obj) -> None:
    n = len(json.dumps(obj, ensure_ascii=False))
    if n > MAX_SCHEMA_CHARS:
        raise _bad(param, f"{what} is {n:,} characters of JSON; the limit is {MAX_SCHEMA_CHARS:,} (a grammar is "
                   "compiled from it for every request): send a smaller one")


def no_tool_args(body: dict) -> None:
    """An API without tools: refuse ``tools`` and a ``tool_choice`` that asks for a call."""
    if body.get("tools") is not None:
        raise _bad("tools", "tools are for /v1/chat/completions", code="unsupported_parameter")
    if body.get("tool_choice") not in (None, "none", "auto"):
        raise _bad("tool_choice", "needs 'tools'")


class Answer:
    """A model's output as OpenAI chat deltas, whole or streamed: thinking split off first
    (``ondevice.reasoning.Splitter``), then tool calls parsed from the answer in the family's format
    (``ondevice.toolcalls.CallStream``), arguments streamed as they are written. ``feed`` / ``finish``
    return the deltas to send; ``result`` is the whole answer (the same pipeline, so whole == streamed).

    Args:
        st: the request's ``Structured`` (thinking convention, tools, call family, forced call).
    """

    def __init__(self, st: Structured) -> None:
        self.splitter = Splitter(st.thinking)
        self.calls = TC.CallStream(TC.get(st.call_family), st.tools) if st.tools else None
        self.forced = st.forced  # the whole answer is a call: nothing is content
        self.reasoning: list[str] = []
        self.content: list[str] = []

    def feed(self, piece: str) -> list[dict]:
        """Add generated text; return the deltas that may be sent now."""
        return self._deltas(*self.splitter.feed(piece))

    def finish(self, cut: bool = False) -> list[dict]:
        """The deltas held back until the end (the splitter is flushed before the call parser); ``cut``: the
        token limit ended the output (``CallStream.finish``)."""
        out = self._deltas(*self.splitter.finish())
        if self.calls is not None:
            out += self._calls(self.calls.finish(cut))
        return out

    def _deltas(self, r: str, c: str) -> list[dict]:
        out = []
        if r:
            self.reasoning.append(r)
            out.append({"reasoning_content": r, "reasoning": r})
        if self.calls is not None:
            out += self._calls(self.calls.feed(c)) if c else []
        elif c:
            self.content.append(c)
            out.append({"content": c})
        return out

    def _calls(self, deltas: list[dict]) -> list[dict]:
        return [d for d in deltas if "content" not in d] if self.forced else deltas

    def result(self) -> tuple[str | None, str | None, list[dict]]:
        """(thinking or None, content or None, tool calls) of everything fed; call after ``finish``."""
        reasoning = "".join(self.reasoning) or None
        if self.calls is None:
            return reasoning, "".join(self.content), []
        content = None if self.forced else (self.calls.content.strip() or None)
        return reasoning, content, self.calls.calls


def cut_by_limit(stats) -> bool:
    """Whether the token limit (or the context) ended the output (``Answer.finish``'s ``cut``)."""
    return FINISH.get(stats.stop_reason) == "length"


def split_answer(text: str, st: Structured) -> tuple[str | None, str | None, list[dict]]:
    """(thinking or None, content, tool calls) of a whole output: ``Answer`` fed once (for other dialects:
    Anthropic thinking / tool_use blocks, Responses reasoning / function_call items)."""
    a = Answer(st)
    a.feed(text)
    a.finish()
    return a.result()

