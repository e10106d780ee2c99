"""Chat templates rendered in a jinja2 sandbox (a template cannot reach Python internals)."""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from functools import lru_cache

from ondevice.errors import OndeviceError


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
) -> str:
    """Render ``messages`` ([{role, content}]) with the model's jinja chat template.

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
            messages=list(messages), add_generation_prompt=add_generation_prompt, bos_token=bos_token, eos_token=eos_token
        )
    except SecurityError as e:
        raise OndeviceError(f"chat template rejected by the sandbox: {e}") from e
    except TemplateError as e:
        raise OndeviceError(f"chat template failed to render: {e}") from e
