"""The OpenAI wire format: request validation → runtime arguments, and stats → response objects.

Nothing here touches HTTP or threads; ``ondevice.server.app`` does. Every rejected request raises
``ApiError`` with the status, OpenAI ``type`` and ``code``, and a one-line message naming the field.
"""

from __future__ import annotations

import dataclasses
import math
import time
import uuid
from typing import Any

from ondevice.errors import OndeviceError
from ondevice.params import DEFAULT_GAMMA, GenerateRequest, gamma_value
from ondevice.speculative import Stats

FINISH = {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}  # anything else was cut short
MAX_STOPS = 16


class ApiError(Exception):
    """An error answered in OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None,
                 type: str | None = None, headers: dict | None = None) -> None:
        super().__init__(" ".join(message.split()))
        self.status = status
        self.code = code
        self.param = param
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}


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
    """``messages`` → [{role, content}] for the chat template (text parts joined; 'developer' → 'system')."""
    from ondevice.chat import OPENAI_ROLES, normalize_messages

    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ApiError(400, "'messages' must be a non-empty list of {role, content} objects", param="messages",
                       code="invalid_value")
    try:
        return [{"role": m["role"], "content": m["content"],
                 **{k: m[k] for k in ("tool_calls", "tool_call_id", "name") if m.get(k) is not None}}
                for m in normalize_messages(msgs, roles=OPENAI_ROLES)]
    except OndeviceError as e:
        code = "unsupported_value" if "not supported" in str(e) else "invalid_value"
        raise ApiError(400, str(e), param="messages", code=code) from None


def completion_prompt(body: dict) -> str | list[int]:
    """``prompt`` of /v1/completions: a string or token ids (a batch of one is accepted)."""
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str | list):
        p = p[0]
    if isinstance(p, str):
        return p
    if isinstance(p, list) and p and all(isinstance(x, int) and not isinstance(x, bool) for x in p):
        return p
    if isinstance(p, list) and len(p) > 1 and all(isinstance(x, str | list) for x in p):
        raise ApiError(400, f"'prompt': batches are not supported (got {len(p)} prompts); send one per request",
                       param="prompt", code="unsupported_value")
    raise ApiError(400, "'prompt' must be a string or a list of token ids", param="prompt", code="invalid_value")


def check_context(n_prompt: int, n_ctx: int) -> None:
    if n_prompt >= n_ctx:
        raise ApiError(400, f"the prompt is {n_prompt} tokens but the context is {n_ctx} (--n-ctx); "
                       "shorten the prompt or restart the server with a larger --n-ctx", param="messages",
                       code="context_length_exceeded")


def cut_short(s: Stats) -> ApiError | None:
    """The error to answer instead of a finish_reason when generation did not end by itself (stop string, EOS,
    token limit, full context) but was cut (the server shutting down, a failure): OpenAI clients must not store
    a truncated answer as complete."""
    if s.stop_reason in FINISH:
        return None
    why = "the server is shutting down" if s.stop_reason == "cancelled" else f"it ended by {s.stop_reason or 'error'}"
    return ApiError(503, f"the answer was cut short after {s.tokens} tokens: {why}; retry the request",
                    code="generation_interrupted")


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


class Reply:
    """Builds the response objects of one request (chat or text completion, whole or streamed)."""

    def __init__(self, chat: bool, model: str) -> None:
        self.chat = chat
        self.model = model
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    def _base(self, chunk: bool) -> dict:
        obj = ("chat.completion" if self.chat else "text_completion") + (".chunk" if chunk and self.chat else "")
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "system_fingerprint": None}

    def _choice(self, text: str | None, finish: str | None, chunk: bool, role: bool = False, logprobs: dict | None = None,
                tool_calls: list | None = None) -> dict:
        if not self.chat:
            return {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
        if chunk:
            delta = {"role": "assistant", "content": text or ""} if role else ({"content": text} if text else {})
            if tool_calls:
                delta["tool_calls"] = tool_calls
            return {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        msg = {"role": "assistant", "content": text, "refusal": None, **({"tool_calls": tool_calls} if tool_calls else {})}
        return {"index": 0, "message": msg, "logprobs": logprobs, "finish_reason": finish}

    def whole(self, text: str | None, s: Stats, logprobs: dict | None = None, tool_calls: list | None = None) -> dict:
        finish = "tool_calls" if tool_calls else FINISH.get(s.stop_reason, "stop")
        return {**self._base(False), "choices": [self._choice(text, finish, False, logprobs=logprobs, tool_calls=tool_calls)],
                "usage": usage(s), "timings": timings(s), "ondevice": dataclasses.asdict(s)}

    def first(self, with_usage: bool) -> dict | None:
        """The chat stream's opening chunk (role only); None for text completions."""
        if not self.chat:
            return None
        return {**self._base(True), "choices": [self._choice("", None, True, role=True)],
                **({"usage": None} if with_usage else {})}

    def piece(self, text: str, from_draft: list[bool], drafted: int, accepted: int, with_usage: bool,
              logprobs: dict | None = None, tool_calls: list | None = None) -> dict:
        return {**self._base(True), "choices": [self._choice(text, None, True, logprobs=logprobs, tool_calls=tool_calls)],
                **({"usage": None} if with_usage else {}),
                "ondevice": {"from_draft": from_draft, "drafted": drafted, "accepted": accepted}}

    def last(self, s: Stats, with_usage: bool, tool_calls: bool = False) -> list[dict]:
        """The finishing chunk (finish_reason, timings, full stats) and, if asked, the usage chunk."""
        finish = "tool_calls" if tool_calls else FINISH.get(s.stop_reason, "stop")
        out = [{**self._base(True), "choices": [self._choice(None, finish, True)],
                **({"usage": None} if with_usage else {}), "timings": timings(s), "ondevice": dataclasses.asdict(s)}]
        if with_usage:
            out.append({**self._base(True), "choices": [], "usage": usage(s)})
        return out
