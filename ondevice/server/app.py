"""``ondevice serve``: an HTTP server (Starlette on uvicorn) for the APIs apps speak, and the chat page.

Routes (``ondevice.server.routes``): ``GET /`` (the chat page), ``GET /health``, ``GET /v1/models``,
``POST /v1/embeddings``, ``POST /v1/messages/count_tokens`` and one ``POST`` route per API dialect —
``/v1/completions``, ``/v1/chat/completions`` (OpenAI), ``/v1/messages`` (Anthropic), ``/v1/responses``
(OpenAI Responses), whole or streamed as server-sent events — all run by one driver (``ondevice.server.driver``)
on the model each request names (``ondevice.server.models``: loaded on demand, unloaded when idle).

Security: the server binds 127.0.0.1 unless told otherwise (``ondevice.server.guard`` checks Host,
Origin and the API key before routing). Request bodies are limited to ``driver.MAX_BODY`` bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request

from ondevice.server.driver import MAX_BODY, READ_SECONDS
from ondevice.server.errors import ApiError, crash, error_response, http_error
from ondevice.server.guard import Guard
from ondevice.server.models import Models
from ondevice.server.routes import error_body, routes

__all__ = ["MAX_BODY", "Server"]


async def _api_error(request: Request, exc: ApiError):
    return error_response(exc)


def _not_loadable(spec: str):
    from ondevice.errors import OndeviceError

    raise OndeviceError(f"{spec}: this server was given no way to load models")


class Server:
    """The application state: the served models and the security settings.

    Args:
        runtime: a loaded ``Runtime`` served as ``model_id`` and never unloaded (closed by the caller), or None
            with ``models``.
        model_id: the name clients send as ``model`` for ``runtime``.
        models: the served models, loaded on demand (instead of ``runtime``).
        api_key: when set, /v1 routes need ``Authorization: Bearer api_key`` (or ``x-api-key: api_key``).
        max_queue: requests that may wait per model behind its running one.
        cors_origins: browser origins allowed to call the API ("*" = any).
        loopback_only: answer only loopback names and ``allowed_hosts`` in the Host header (else IP addresses too).
        allowed_hosts: further Host names to answer (``ondevice.server.guard``).
        read_seconds: the longest a client may take to send its request body (408 after).
    """

    def __init__(self, runtime, model_id: str | None = None, *, models: Models | None = None,
                 api_key: str | None = None, max_queue: int = 16, cors_origins: list[str] | None = None,
                 loopback_only: bool = True, allowed_hosts: Sequence[str] = (),
                 read_seconds: float = READ_SECONDS) -> None:
        if models is None:
            models = Models([(model_id, model_id)], _not_loadable, keep_alive=float("inf"), max_queue=max_queue)
            if runtime is not None:
                models.adopt(model_id, runtime)
        self.models = models
        self.read_seconds = read_seconds
        self.api_key = api_key
        app = Starlette(routes=routes(self),
                        exception_handlers={ApiError: _api_error, HTTPException: http_error, Exception: crash})
        self.asgi = Guard(app, api_key=api_key, cors_origins=list(cors_origins or []), loopback_only=loopback_only,
                          allowed_hosts=allowed_hosts, error_body=error_body)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            self.models.start_clocks()  # idle models (one loaded at startup) unload after their keep-alive
        await self.asgi(scope, receive, send)
