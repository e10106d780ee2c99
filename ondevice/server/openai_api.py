"""The OpenAI family's shared request fields and response envelope, used by every OpenAI dialect
(``chat_completions``, ``completions``, ``responses``).

Request side: ``check_model``, ``stream_args``, ``generation_args`` (sampling, limits, stop, γ),
``chat_messages``; every rejected request raises ``ApiError`` with the status, OpenAI ``type`` and ``code``,
and a one-line message naming the field. Response side: ``usage``, ``timings`` and ``OpenAIReply``, the
envelope (id, object, created, model) of whole answers and stream chunks. Nothing here touches HTTP or threads.
"""

from __future__ import annotations

import dataclasses
import math
import time
import uuid
from typing import Any, ClassVar

from ondevice.errors import OndeviceError
from ondevice.params import DEFAULT_GAMMA, GenerateRequest, gamma_value
from ondevice.server.errors import FINISH, ApiError
from ondevice.server.types import Reply
from ondevice.speculative import Stats

__all__ = ["ApiError", "FINISH", "OpenAIReply", "chat_messages", "check_context", "check_model", "generation_args",
           "stream_args", "timings", "usage"]

MAX_STOPS = 16


def check_model(name: Any, model_id: str) -> None:
    """Refuse a ``model`` this server does not serve (404 naming the served one)."""
    if name != model_id:
        raise ApiError(404, f"the model {name!r} is not served here; this server serves {model_id!r} "
                       "(see GET /v1/models)", param="model", code="model_not_found")


def stream_args(body: dict, model_id: str) -> tuple[bool, bool]:
    """The fields every OpenAI generation request starts with: ``model`` (required, the served one),
    ``stream`` and ``stream_options.include_usage``.

    Returns:
        (stream, with_usage).
    """
    if body.get("model") is None:
        raise ApiError(400, f"'model' is required; this server serves {model_id!r}", param="model",
                       code="missing_required_parameter")
    check_model(body.get("model"), model_id)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be true or false", param="stream")
    opts = body.get("stream_options") or {}
    return stream, bool(isinstance(opts, dict) and opts.get("include_usage"))


def _bad(param: str, rule: str) -> ApiError:
    return ApiError(400, f"'{param}': {rule}", param=param, code="invalid_value")


def _number(body: dict, key: str, lo: float, hi: float, *, integer: bool = False, lo_open: bool = False):
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float) or (integer and not float(v).is_integer()):
        raise _bad(key, f"must be {'an integer' if integer else 'a number'}, got {v!r}")
    if not math.isfinite(v) or v > hi or v < lo or (lo_open and v == lo):
        raise _bad(key, f"{v!r} is out of range {'(' if lo_open else '['}{lo}, {hi}]")
    return int(v) if integer else float(v)


def _unsupported(body: dict) -> None:
    """Options that would change the output if honoured: refuse them instead of dropping them silently."""
    n = body.get("n")
    if n is not None and n != 1:
        raise ApiError(400, f"'n': only n=1 is supported (got {n!r}); send {n} requests instead", param="n",
                       code="unsupported_value")
    checks = {
        "best_of": lambda v: v not in (None, 1),
        "echo": lambda v: v not in (None, False),
        "suffix": lambda v: v not in (None, ""),
        "logit_bias": lambda v: bool(v),
        "presence_penalty": lambda v: v not in (None, 0),
        "frequency_penalty": lambda v: v not in (None, 0),
        "functions": lambda v: bool(v),  # response_format, tools, logprobs: ondevice.server.structured
    }
    for key, bad in checks.items():
        if bad(body.get(key)):
            hint = "; use 'repetition_penalty' instead" if key.endswith("_penalty") else ""
            raise ApiError(400, f"'{key}' is not supported by this server{hint}", param=key, code="unsupported_parameter")


def generation_args(body: dict, n_prompt: int, n_ctx: int) -> GenerateRequest:
    """Validate the generation fields of a request (OpenAI's ranges here, ondevice's own rules in
    ``GenerateRequest``) and return the request ``Runtime.stream`` runs.

    Standard fields: max_tokens / max_completion_tokens, temperature, top_p, seed, stop. Extensions
    (as in llama-server): top_k, min_p, repetition_penalty, gamma. Unset fields take ondevice's defaults
    (``ondevice.params``); with no token limit, generation runs to end-of-sequence or the full context.
    """
    _unsupported(body)
    mt = body.get("max_completion_tokens", body.get("max_tokens"))
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _number({key: mt}, key, 1, 1 << 31, integer=True)
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, list) or len(stop) > MAX_STOPS or not all(isinstance(s, str) for s in stop)):
        raise _bad("stop", f"must be a string or a list of at most {MAX_STOPS} strings")
    pick = {
        "temperature": _number(body, "temperature", 0, 2),
        "top_p": _number(body, "top_p", 0, 1, lo_open=True),
        "top_k": _number(body, "top_k", 0, 1 << 31, integer=True),
        "min_p": _number(body, "min_p", 0, 1),
        "repetition_penalty": _number(body, "repetition_penalty", 0, 100, lo_open=True),
        "seed": _number(body, "seed", 0, 2**63 - 1, integer=True),
    }
    gen: dict[str, Any] = {k: v for k, v in pick.items() if v is not None}
    try:
        gamma = gamma_value(body.get("gamma", DEFAULT_GAMMA))
    except OndeviceError as e:
        raise ApiError(400, str(e), param="gamma", code="invalid_value") from e
    try:  # the runtime's own checks, before queueing
        return GenerateRequest.of(**gen, max_tokens=max_tokens if max_tokens is not None else max(1, n_ctx - n_prompt),
                                  stop=stop or [], gamma=gamma)
    except OndeviceError as e:
        raise ApiError(400, str(e), code="invalid_value") from e


def chat_messages(body: dict) -> list[dict]:
    """``messages`` → [{role, content}] for the chat template (text parts joined; 'developer' → 'system'; tool
    calls, tool results and an assistant's ``reasoning_content`` kept)."""
    from ondevice.chat import OPENAI_ROLES, normalize_messages

    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ApiError(400, "'messages' must be a non-empty list of {role, content} objects", param="messages",
                       code="invalid_value")
    from ondevice.media import has_images

    try:  # image parts are checked as empty text here and kept for ondevice.media to render
        norm = normalize_messages([_images_as_text(m) for m in msgs], roles=OPENAI_ROLES)
        return [{"role": m["role"], "content": raw["content"] if has_images([raw]) else m["content"],
                 **{k: m[k] for k in ("tool_calls", "tool_call_id", "name") if m.get(k) is not None},
                 **_reasoning(m)} for raw, m in zip(msgs, norm, strict=True)]
    except OndeviceError as e:
        code = "unsupported_value" if "not supported" in str(e) else "invalid_value"
        raise ApiError(400, str(e), param="messages", code=code) from None


def _images_as_text(m):
    """``m`` with each ``image_url`` part as an empty text part (what ``normalize_messages`` checks)."""
    if not isinstance(m, dict) or not isinstance(m.get("content"), list):
        return m
    return {**m, "content": [{"type": "text", "text": ""} if isinstance(p, dict) and p.get("type") == "image_url"
                             else p for p in m["content"]]}


def _reasoning(m: dict) -> dict:
    """An assistant turn's thinking (``reasoning_content``, or ``reasoning`` as mlx-lm / LM Studio send it)
    for templates that render it back (Qwen3 does for the turns after the last user message)."""
    r = m.get("reasoning_content", m.get("reasoning"))
    if r is None or m["role"] != "assistant":
        return {}
    if not isinstance(r, str):
        raise OndeviceError("an assistant message's reasoning_content must be a string")
    return {"reasoning_content": r}


def check_context(n_prompt: int, n_ctx: int) -> None:
    if n_prompt >= n_ctx:
        raise ApiError(400, f"the prompt is {n_prompt} tokens but the context is {n_ctx} (--n-ctx); "
                       "shorten the prompt or restart the server with a larger --n-ctx", param="messages",
                       code="context_length_exceeded")


def timings(s: Stats) -> dict:
    """llama-server's ``timings`` object (prompt_n counts the tokens evaluated after prefix reuse)."""
    prompt_ms = s.prompt_seconds * 1000
    predicted_ms = max(0.0, (s.total_seconds - s.prompt_seconds) * 1000)
    return {
        "prompt_n": s.prompt_eval_tokens,
        "prompt_ms": prompt_ms,
        "prompt_per_second": s.prompt_eval_tokens / s.prompt_seconds if s.prompt_seconds > 0 else 0.0,
        "predicted_n": s.tokens,
        "predicted_ms": predicted_ms,
        "predicted_per_second": s.tokens * 1000 / predicted_ms if predicted_ms > 0 else 0.0,
        "draft_n": s.drafted,
        "draft_n_accepted": s.accepted,
    }


def usage(s: Stats) -> dict:
    return {"prompt_tokens": s.prompt_tokens, "completion_tokens": s.tokens,
            "total_tokens": s.prompt_tokens + s.tokens,
            "prompt_tokens_details": {"cached_tokens": s.prompt_tokens - s.prompt_eval_tokens}}


class OpenAIReply(Reply):
    """The envelope of an OpenAI answer: whole (``object``) or streamed chunks (``chunk_object``) ending with
    ``data: [DONE]``; a subclass writes the choices.

    Args:
        model: the served model's name.
        with_usage: streamed: every chunk carries ``usage: null`` and a last chunk holds the usage.
    """

    prefix: ClassVar[str]  # of the answer's id
    object: ClassVar[str]
    chunk_object: ClassVar[str]
    done = b"data: [DONE]\n\n"

    def __init__(self, model: str, with_usage: bool = False) -> None:
        self.model = model
        self.with_usage = with_usage
        self.id = self.prefix + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    def _base(self, chunk: bool) -> dict:
        return {"id": self.id, "object": self.chunk_object if chunk else self.object, "created": self.created,
                "model": self.model, "system_fingerprint": None}

    def answer(self, choice: dict, s: Stats) -> dict:
        """The whole answer around its one ``choice``."""
        return {**self._base(False), "choices": [choice], "usage": usage(s), "timings": timings(s),
                "ondevice": dataclasses.asdict(s)}

    def head(self, choice: dict) -> dict:
        """A streamed chunk without generated text (a chat stream's opening role)."""
        return {**self._base(True), "choices": [choice], **({"usage": None} if self.with_usage else {})}

    def chunk(self, choice: dict, from_draft: list[bool], drafted: int, accepted: int) -> dict:
        """A streamed chunk of generated text (with the running draft counters)."""
        return {**self._base(True), "choices": [choice], **({"usage": None} if self.with_usage else {}),
                "ondevice": {"from_draft": from_draft, "drafted": drafted, "accepted": accepted}}

    def finish(self, choice: dict, s: Stats) -> list[dict]:
        """The finishing chunk (``choice`` holds finish_reason; timings, full stats) and, if asked, the usage chunk."""
        out = [{**self._base(True), "choices": [choice], **({"usage": None} if self.with_usage else {}),
                "timings": timings(s), "ondevice": dataclasses.asdict(s)}]
        if self.with_usage:
            out.append({**self._base(True), "choices": [], "usage": usage(s)})
        return out
