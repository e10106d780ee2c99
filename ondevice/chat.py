"""Chat messages and templates: messages normalised as the OpenAI API sends them, rendered with the model's
jinja template in a sandboxed worker with a time, memory, output and recursion budget
(``ondevice.templates``: a template is untrusted input)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ondevice.errors import OndeviceError
from ondevice.params import GenerateRequest


def message_text(content: Any, where: str = "message") -> str:
    """A message's ``content`` as text: None → "", a string, or a list of text parts joined (OpenAI's forms).

    Raises:
        OndeviceError: a non-text part (image, audio) or another type.
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if not (isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)):
                kind = p.get("type") if isinstance(p, dict) else type(p).__name__
                raise OndeviceError(f"{where}: content part of type {kind!r} is not supported (text only)")
            parts.append(p["text"])
        return "".join(parts)
    raise OndeviceError(f"{where}.content must be a string or a list of text parts, not {type(content).__name__}")


OPENAI_ROLES = ("system", "developer", "user", "assistant", "tool")  # the roles the OpenAI API defines


def normalize_messages(messages: Sequence[dict], roles: Sequence[str] | None = None) -> list[dict]:
    """``messages`` → a non-empty list of {role, content: str} (other keys kept; 'developer' → 'system').

    Args:
        messages: [{role, content}] in the forms ``message_text`` accepts.
        roles: the roles allowed (the server: ``OPENAI_ROLES``, so a typo such as 'assitant' is refused
            instead of reaching the template); None: any (a template may define its own).
    Raises:
        OndeviceError: not a non-empty list, a message without a 'role' string, a role not in ``roles``, or
            content that is not text.
    """
    if isinstance(messages, str | bytes | dict) or not isinstance(messages, Sequence) or not messages:
        raise OndeviceError("messages must be a non-empty list of {'role', 'content'} dicts")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise OndeviceError(f"messages[{i}] must be a dict with a 'role' string (and 'content'), not {m!r:.80}")
        if roles is not None and m["role"] not in roles:
            raise OndeviceError(f"messages[{i}].role {m['role']!r:.40} is not one of {', '.join(roles)}")
        role = "system" if m["role"] == "developer" else m["role"]
        out.append({**m, "role": role, "content": message_text(m.get("content"), f"messages[{i}]")})
    return out


def render(
    template: str | None,
    messages: Sequence[dict],
    *,
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    source: str = "this model",
    tools: Sequence[dict] | None = None,
    variables: dict | None = None,
) -> str:
    """Render ``messages`` ([{role, content}]) with the model's jinja chat template, within a budget.

    Args:
        template: the jinja source from the model's metadata.
        messages: the conversation (see ``normalize_messages`` for the accepted forms).
        add_generation_prompt, bos_token, eos_token: template variables.
        source: the model file, named in errors.
        tools: OpenAI's function list, handed to the template as ``tools`` (as llama.cpp's --jinja does).
        variables: further template variables (a request's ``chat_template_kwargs``, e.g. enable_thinking);
            they never replace the ones above.
    Raises:
        OndeviceError: no template, bad messages, or a template that fails, tries to escape the sandbox,
            or exceeds its time, memory, output or recursion budget.
    """
    from ondevice import templates

    if not template:
        raise OndeviceError(f"{source} has no chat template in its metadata; use generate with a plain prompt")
    own = dict(add_generation_prompt=add_generation_prompt, bos_token=bos_token, eos_token=eos_token,
               **({"tools": list(tools)} if tools else {}))
    return templates.render(template, normalize_messages(messages), source=source,
                            **{k: v for k, v in (variables or {}).items() if k not in own and k != "messages"}, **own)


def render_prompt(rt, messages: Sequence[dict], *, tools: Sequence[dict] | None = None,
                  variables: dict | None = None) -> tuple[str, list[int]]:
    """(prompt text, token ids) of ``messages`` for the runtime ``rt``'s model: ``Runtime.render_chat`` with
    template variables, and the text, whose end says whether the answer starts inside thinking
    (``ondevice.reasoning.detect``).

    Raises:
        OndeviceError: as ``render``.
    """
    t = rt.target
    bos = t.token_bytes(t.bos_id).decode("utf-8", "replace") if t.bos_id is not None else ""
    text = render(t.chat_template, messages, bos_token=bos, source=str(t.path), tools=tools, variables=variables)
    return text, rt.tokenize(text, add_bos=not (bos and text.startswith(bos)))


PROMPT_TAIL = 512  # characters of a rendered prompt that tell whether it opened a thinking block


def split_output(text: str, template: str | None, prompt: str, tools: Sequence[dict] | None = None,
                 family: str | None = None) -> tuple[str | None, str | None, list[dict]]:
    """A whole answer as (thinking or None, content, tool calls): the template's thinking convention split
    off first (``ondevice.reasoning``), then, when ``tools`` are given, calls parsed in the template's family
    format (``ondevice.toolcalls``; ``family`` overrides it). The same split the server streams.

    Args:
        text: the model's output.
        template: the chat template it was prompted with; prompt: the rendered prompt (its end tells whether
            the answer starts inside thinking).
    Returns:
        (reasoning, content: the text outside thinking and calls, stripped and None when empty if tools were
        given, else as written; the OpenAI ``tool_calls``).
    """
    from ondevice import reasoning, toolcalls

    thought, content = reasoning.split(text, reasoning.detect(template, prompt[-PROMPT_TAIL:]))
    if not tools:
        return thought, content, []
    content, calls = toolcalls.parse(content, family or toolcalls.detect(template), tools)
    return thought, content, calls


@dataclass
class ChatReply:
    """A chat answer split into thinking, content and tool calls (``reply``).

    Attributes:
        reasoning: the thinking (None when the model did not think or the template has no convention).
        content: the answer without thinking or calls.
        tool_calls: OpenAI ``tool_calls`` (when tools were given).
        result: the ``Result`` (its ``text`` is the whole output, tokens, stats).
    """

    reasoning: str | None
    content: str | None
    tool_calls: list[dict] = field(default_factory=list)
    result: Any = None


def reply(rt, messages: Sequence[dict], *, tools: Sequence[dict] | None = None,
          template_kwargs: dict | None = None, request: GenerateRequest | None = None, **options) -> ChatReply:
    """``Runtime.chat`` with thinking and tools: ``messages`` (tool calls and results included, shaped for the
    template's family) rendered with ``tools`` and ``template_kwargs`` (e.g. {"enable_thinking": False}),
    generated with ``request`` / ``options``, and split (``split_output``).

    Raises:
        OndeviceError: bad options or messages, or a template that fails.
    """
    from ondevice import toolcalls

    request = GenerateRequest.resolve(request, options)
    template = rt.target.chat_template
    text, ids = render_prompt(rt, toolcalls.template_messages(normalize_messages(messages),
                                                              toolcalls.detect(template)),
                              tools=tools, variables=template_kwargs)
    result = rt.generate(ids, request)
    return ChatReply(*split_output(result.text, template, text, tools), result=result)


class ChatSession:
    """A conversation on a ``Runtime``: history, the model's template, and trimming to fit n_ctx.

    Each turn re-renders the whole history; the runtime's prefix reuse then evaluates only the
    tokens after what its caches already hold.

    Args:
        runtime: a loaded ``Runtime``.
        system: optional system prompt (always kept).
        request: the ``GenerateRequest`` every answer is made with, or none and its options as keywords
            (max_tokens, temperature, ... as ``Runtime.stream`` takes them).
        variables: template variables for every turn (e.g. {"enable_thinking": False}); ``variables`` may be
            changed between turns.

    Attributes:
        thinking: the template's thinking convention for the last prompt (``ondevice.reasoning.detect``):
            split an answer with ``ondevice.reasoning.Splitter(session.thinking)``.
    """

    def __init__(self, runtime, system: str | None = None, request: GenerateRequest | None = None,
                 variables: dict | None = None, **options) -> None:
        self.rt = runtime
        self.system = system
        self.request = GenerateRequest.resolve(request, options)
        self.variables = dict(variables or {})
        self.thinking = None
        from ondevice import templates

        templates.warm()  # the first turn does not wait for the template worker to start
        self.turns: list[tuple[str, str]] = []  # (user, assistant)
        self.dropped = 0  # turns dropped to fit the context

    def messages(self, user: str | None = None, *, history: bool = True) -> list[dict]:
        """The conversation as chat messages: the system prompt, the kept turns (unless not ``history``) and
        ``user``."""
        msgs = [{"role": "system", "content": self.system}] if self.system else []
        for u, a in self.turns if history else []:
            msgs += [{"role": "user", "content": u}, {"role": "assistant", "content": a}]
        if user is not None:
            msgs.append({"role": "user", "content": user})
        return msgs

    def prompt_ids(self, user: str) -> list[int]:
        """Token ids for the next answer, dropping the oldest turns while the prompt would not fit.

        Raises:
            OndeviceError: ``user`` does not fit the context even without history; the session (its earlier
                turns) is left as it was, so the caller can report it and go on with the next turn.
        """
        n_ctx = self.rt.n_ctx
        budget = n_ctx - self.request.max_tokens
        ids = self._render(self.messages(user))
        if len(ids) <= budget or not self.turns:
            return self._check_fits(ids)
        alone = self._render(self.messages(user, history=False))
        if len(alone) >= n_ctx:
            self._check_fits(alone)
        while len(ids) > budget and self.turns:
            self.turns.pop(0)
            self.dropped += 1
            ids = self._render(self.messages(user))
        return self._check_fits(ids)

    def _render(self, messages: list[dict]) -> list[int]:
        from ondevice import reasoning

        text, ids = render_prompt(self.rt, messages, variables=self.variables)
        self.thinking = reasoning.detect(self.rt.target.chat_template, text[-PROMPT_TAIL:])
        return ids

    def _check_fits(self, ids: list[int]) -> list[int]:
        if len(ids) >= self.rt.n_ctx:
            raise OndeviceError(f"this message is too long: the prompt would be {len(ids)} tokens but the context "
                                f"(n_ctx) is {self.rt.n_ctx}; shorten it or raise --n-ctx (the conversation is kept)")
        return ids

    def ask(self, user: str):
        """Start the answer to ``user``; returns the ``Stream``. Call ``commit`` when it is done."""
        return self.rt.stream(self.prompt_ids(user), self.request)

    def commit(self, user: str, answer: str) -> None:
        """Keep a finished turn (``answer``: what the model answered; give its content without the thinking,
        which templates leave out of past turns)."""
        self.turns.append((user, answer))

    def reset(self) -> None:
        self.turns.clear()
        self.dropped = 0
        self.rt.reset()
