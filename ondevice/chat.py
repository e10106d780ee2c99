"""Chat templates rendered in a jinja2 sandbox (a template cannot reach Python internals)."""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from functools import lru_cache

from ondevice.errors import OndeviceError
from ondevice.params import GenerateRequest


def _raise(message: str):
    raise OndeviceError(f"chat template error: {message}")


@lru_cache(maxsize=8)
def _compile(template: str):
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except TemplateError as e:
        raise OndeviceError(f"chat template does not compile: {e}") from e


def render(
    template: str | None,
    messages: Sequence[dict],
    *,
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    tools: Sequence[dict] | None = None,
) -> str:
    """Render ``messages`` ([{role, content}]) with the model's jinja chat template.

    ``tools`` (OpenAI's function list) is handed to the template as ``tools``, as llama.cpp's --jinja does.

    Raises:
        OndeviceError: no template, a template error, or a template that tries to escape the sandbox.
    """
    from jinja2.exceptions import SecurityError, TemplateError

    if not template:
        raise OndeviceError("this model has no chat template in its metadata; use generate with a plain prompt")
    for m in messages:
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise OndeviceError(f"chat message {m!r} needs 'role' and 'content'")
    try:
        return _compile(template).render(
            messages=list(messages), add_generation_prompt=add_generation_prompt, bos_token=bos_token, eos_token=eos_token,
            **({"tools": list(tools)} if tools else {}),
        )
    except SecurityError as e:
        raise OndeviceError(f"chat template rejected by the sandbox: {e}") from e
    except TemplateError as e:
        raise OndeviceError(f"chat template failed to render: {e}") from e


class ChatSession:
    """A conversation on a ``Runtime``: history, the model's template, and trimming to fit n_ctx.

    Each turn re-renders the whole history; the runtime's prefix reuse then evaluates only the
    tokens after what its caches already hold.

    Args:
        runtime: a loaded ``Runtime``.
        system: optional system prompt (always kept).
        request: the ``GenerateRequest`` every answer is made with, or none and its options as keywords
            (max_tokens, temperature, ... as ``Runtime.stream`` takes them).
    """

    def __init__(self, runtime, system: str | None = None, request: GenerateRequest | None = None, **options) -> None:
        self.rt = runtime
        self.system = system
        self.request = request if request is not None else GenerateRequest.of(**options)
        self.turns: list[tuple[str, str]] = []  # (user, assistant)
        self.dropped = 0  # turns dropped to fit the context

    def messages(self, user: str | None = None) -> list[dict]:
        msgs = [{"role": "system", "content": self.system}] if self.system else []
        for u, a in self.turns:
            msgs += [{"role": "user", "content": u}, {"role": "assistant", "content": a}]
        if user is not None:
            msgs.append({"role": "user", "content": user})
        return msgs

    def prompt_ids(self, user: str) -> list[int]:
        """Token ids for the next answer, dropping the oldest turns while the prompt would not fit."""
        budget = self.rt.n_ctx - self.request.max_tokens
        while True:
            ids = self.rt.render_chat(self.messages(user))
            if len(ids) <= budget or not self.turns:
                return ids
            self.turns.pop(0)
            self.dropped += 1

    def ask(self, user: str):
        """Start the answer to ``user``; returns the ``Stream``. Call ``commit`` when it is done."""
        return self.rt.stream(self.prompt_ids(user), self.request)

    def commit(self, user: str, answer: str) -> None:
        self.turns.append((user, answer))

    def reset(self) -> None:
        self.turns.clear()
        self.dropped = 0
        self.rt.reset()
