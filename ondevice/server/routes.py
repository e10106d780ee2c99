"""The server's routes: the chat page, ``/health``, ``/v1/models`` and one ``POST`` route per API dialect
(``DIALECTS``; a new API is one more dialect module listed here)."""

from __future__ import annotations

import asyncio
from importlib import resources

from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from ondevice.server.chat_completions import ChatCompletions
from ondevice.server.completions import Completions
from ondevice.server.driver import Driver, read_body
from ondevice.server.embeddings import embeddings
from ondevice.server.errors import ApiError, error_response
from ondevice.server.messages import Messages, anthropic_error
from ondevice.server.openai_api import check_model
from ondevice.server.responses import Responses
from ondevice.server.types import Dialect

DIALECTS: tuple[type[Dialect], ...] = (Completions, ChatCompletions, Messages, Responses)
PAGE_HEADERS = {  # no other site may frame the page (clickjacking: a hidden frame clicking Send)
    "Content-Security-Policy": "default-src 'self'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; "
                               "img-src data:; frame-ancestors 'none'",
    "X-Frame-Options": "DENY", "X-Content-Type-Options": "nosniff"}


def routes(server) -> list[Route]:
    """Every route of ``server`` (an ``ondevice.server.app.Server``)."""

    async def page(request: Request) -> HTMLResponse:
        html = resources.files("ondevice.web").joinpath("index.html").read_text(encoding="utf-8")
        return HTMLResponse(html, headers=PAGE_HEADERS)

    async def health(request: Request) -> JSONResponse:
        e, rt = server.engine, server.rt
        d = rt.drafter
        return JSONResponse({"status": "ok", "model": server.model_id, "drafter": d.name if d else "none",
                             "n_ctx": rt.n_ctx, "auth": bool(server.api_key), "running": e.running,
                             "queued": e.waiting, "max_queue": e.max_queue, **dict(vars(e.counters))})

    def model_obj() -> dict:
        rt = server.rt
        d = rt.drafter
        return {"id": server.model_id, "object": "model", "created": 0, "owned_by": "ondevice",
                "meta": {"n_ctx": rt.n_ctx, "drafter": d.name if d else "none", "vocab_size": rt.target.vocab_size}}

    async def models(request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [model_obj()]})

    async def model(request: Request) -> JSONResponse:
        check_model(request.path_params["model_id"], server.model_id)
        return JSONResponse(model_obj())

    anthropic = Messages(server)

    async def count_tokens(request: Request) -> JSONResponse:
        try:
            body = await read_body(request, server.read_seconds)
            return JSONResponse(await asyncio.to_thread(anthropic.count_tokens, body))
        except ApiError as e:
            return error_response(e, anthropic_error(e))

    async def embed(request: Request) -> JSONResponse:
        return await embeddings(request, server)

    driver = Driver(server.engine, server.read_seconds)
    return [
        Route("/", page, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", model, methods=["GET"]),
        Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
        Route("/v1/embeddings", embed, methods=["POST"]),
        *[Route(d.path, _endpoint(driver, d), methods=["POST"]) for d in (cls(server) for cls in DIALECTS)],
    ]


def error_body(path: str, e: ApiError) -> dict:
    """A refused request's body in the shape of the API ``path`` belongs to (the guard refuses before routing)."""
    return anthropic_error(e) if path.startswith(Messages.path) else e.body()


def _endpoint(driver: Driver, dialect: Dialect):
    async def endpoint(request: Request) -> Response:
        return await driver.handle(request, dialect)

    endpoint.__name__ = type(dialect).__name__
    return endpoint
