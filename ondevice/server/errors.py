"""Errors the server answers: ``ApiError`` (status, type, code, param and a one-line message), its JSON
response, ``cut_short`` (an answer that did not end by itself) and the handlers Starlette calls for its own
errors (404, 405) and for crashes.

Messages name files of the server machine by their base name only (``local_names``): an engine error such as
"/home/me/models/x.gguf: ..." tells a client "x.gguf: ...", never where the server keeps its files.
Nothing here knows an API dialect: a dialect writes an ``ApiError`` in its own shape (``Reply.error``).
"""

from __future__ import annotations

import os
import re

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

from ondevice.speculative import Stats

FINISH = {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}  # anything else was cut short
# an absolute path with at least one folder: POSIX, home-relative (``ondevice.errors.shown``), or a Windows drive
_PATH = re.compile(r"(?<![\w.~:/\\-])(?:~?/|[A-Za-z]:\\)(?:[^\s/\\'\"`]+[/\\])+[^\s/\\'\"`,;:)\]]*")


def _base_name(m: re.Match) -> str:
    path = m.group(0)
    if path.startswith("/") and not os.path.exists("/" + path[1:].split("/", 1)[0]):
        return path  # not rooted in this machine's file system: a URL path such as /v1/models
    return re.split(r"[/\\]", path.rstrip("/\\"))[-1] or path


def local_names(message: str) -> str:
    """``message`` with every absolute path of this machine replaced by its base name."""
    return _PATH.sub(_base_name, message)


class ApiError(Exception):
    """An error answered in OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None,
                 type: str | None = None, headers: dict | None = None) -> None:
        super().__init__(local_names(" ".join(message.split())))
        self.status = status
        self.code = code
        self.param = param
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}


def error_response(e: ApiError, body: dict | None = None) -> JSONResponse:
    """The HTTP answer of ``e`` (``body``: the error in a dialect's own shape; OpenAI's by default)."""
    return JSONResponse(e.body() if body is None else body, status_code=e.status, headers=e.headers)


def cut_short(s: Stats) -> ApiError | None:
    """The error to answer instead of a finish_reason when generation did not end by itself (stop string, EOS,
    token limit, full context) but was cut (the server shutting down, a failure): OpenAI clients must not store
    a truncated answer as complete."""
    if s.stop_reason in FINISH:
        return None
    why = "the server is shutting down" if s.stop_reason == "cancelled" else f"it ended by {s.stop_reason or 'error'}"
    return ApiError(503, f"the answer was cut short after {s.tokens} tokens: {why}; retry the request",
                    code="generation_interrupted")


def internal(e: BaseException) -> ApiError:
    """A 500 naming the exception by its first line."""
    first = (str(e).splitlines() or [""])[0]
    return ApiError(500, f"internal error: {type(e).__name__}: {first}", code="internal_error")


async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
    """Starlette's own errors (no such route, wrong method) in the API's shape."""
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return error_response(ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", code=code))


async def crash(request: Request, exc: Exception) -> JSONResponse:
    return error_response(internal(exc))
