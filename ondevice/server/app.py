"""``ondevice serve``: an OpenAI-compatible HTTP server (Starlette on uvicorn) and the chat page.

Routes (``ondevice.server.routes``): ``GET /`` (the chat page), ``GET /health``, ``GET /v1/models`` and one
``POST`` route per API dialect — ``/v1/completions`` and ``/v1/chat/completions``, whole or streamed as
server-sent events — all run by one driver (``ondevice.server.driver``). One ``Runtime`` serves every request
in turn (``ondevice.server.engine``).

Security: the server binds 127.0.0.1 unless told otherwise (``ondevice.server.guard`` checks Host,
Origin and the API key before routing). Request bodies are limited to ``driver.MAX_BODY`` bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request

from ondevice.server.driver import MAX_BODY, READ_SECONDS
from ondevice.server.engine import Engine
from ondevice.server.errors import ApiError, crash, error_response, http_error
from ondevice.server.guard import Guard
from ondevice.server.routes import error_body, routes

__all__ = ["MAX_BODY", "Server"]


async def _api_error(request: Request, exc: ApiError):
    return error_response(exc)


class Server:
    """The application state: runtime, engine, model id, and the security settings.

    Args:
        runtime: the loaded ``Runtime`` (closed by the caller).
        model_id: the name clients send as ``model`` (also listed by /v1/models).
        api_key: when set, /v1 routes need ``Authorization: Bearer api_key``.
        max_queue: requests that may wait behind the running one.
        cors_origins: browser origins allowed to call the API ("*" = any).
        loopback_only: answer only loopback names and ``allowed_hosts`` in the Host header (else IP addresses too).
        allowed_hosts: further Host names to answer (``ondevice.server.guard``).
        read_seconds: the longest a client may take to send its request body (408 after).
    """

    def __init__(self, runtime, model_id: str, *, api_key: str | None = None, max_queue: int = 16,
                 cors_origins: list[str] | None = None, loopback_only: bool = True,
                 allowed_hosts: Sequence[str] = (), read_seconds: float = READ_SECONDS) -> None:
        self.rt = runtime
        self.read_seconds = read_seconds
        self.model_id = model_id
        self.api_key = api_key
        self.engine = Engine(runtime, max_queue)
        app = Starlette(routes=routes(self),
                        exception_handlers={ApiError: _api_error, HTTPException: http_error, Exception: crash})
        self.asgi = Guard(app, api_key=api_key, cors_origins=list(cors_origins or []), loopback_only=loopback_only,
                          allowed_hosts=allowed_hosts, error_body=error_body)

    async def __call__(self, scope, receive, send) -> None:
        await self.asgi(scope, receive, send)
