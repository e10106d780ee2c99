"""The server's routes: the chat page, ``/health``, ``/v1/models``, ``/v1/embeddings``,
``/v1/messages/count_tokens`` and one ``POST`` route per API dialect (``DIALECTS``; a new API is one more
dialect module listed here)."""

from __future__ import annotations

import asyncio
from importlib import resources

from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from ondevice.server.chat_completions import ChatCompletions
from ondevice.server.completions import Completions
from ondevice.server.driver import Driver, lease, read_body
from ondevice.server.embeddings import embeddings_answer
from ondevice.server.errors import ApiError, error_response
from ondevice.server.messages import Messages, anthropic_error
from ondevice.server.models import Model
from ondevice.server.responses import Responses
from ondevice.server.types import Dialect

DIALECTS: tuple[type[Dialect], ...] = (Completions, ChatCompletions, Messages, Responses)
PAGE_HEADERS = {  # no other site may frame the page (clickjacking: a hidden frame clicking Send)
    "Content-Security-Policy": "default-src 'self'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; "
                               "img-src data:; frame-ancestors 'none'",
    "X-Frame-Options": "DENY", "X-Content-Type-Options": "nosniff"}


def _model_obj(m: Model) -> dict:
    return {"id": m.id, "object": "model", "created": 0, "owned_by": "ondevice",
            "meta": {**m.info, "loaded": m.loaded, "loads": m.loads}}


def routes(server) -> list[Route]:
    """Every route of ``server`` (an ``ondevice.server.app.Server``)."""
    models = server.models

    async def page(request: Request) -> HTMLResponse:
        html = resources.files("ondevice.web").joinpath("index.html").read_text(encoding="utf-8")
        return HTMLResponse(html, headers=PAGE_HEADERS)

    async def health(request: Request) -> JSONResponse:
        ms = list(models.models.values())
        engines = [m.engine for m in ms if m.engine is not None]
        first, recent = ms[0], max(ms, key=lambda m: m.last_used)
        counts = {k: sum(getattr(m.counters, k) for m in ms) for k in ("served", "cancelled", "failed", "rejected")}
        each = [{"id": m.id, "loaded": m.loaded, "loads": m.loads, "keep_alive": None if m.keep_alive == float("inf") else m.keep_alive,
                 **m.info,
                 "running": m.engine.running if m.engine else 0, "queued": m.engine.waiting if m.engine else 0}
                for m in ms]
        return JSONResponse({"status": "ok", "model": first.id, "drafter": first.info.get("drafter", "none"),
                             "n_ctx": first.info.get("n_ctx"), "auth": bool(server.api_key),
                             "running": sum(e.running for e in engines), "queued": sum(e.waiting for e in engines),
                             "max_queue": models.max_queue, "max_loaded": models.max_loaded, **counts,
                             "last": recent.counters.last, "models": each})

    async def list_models(request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [_model_obj(m) for m in models.models.values()]})

    async def model(request: Request) -> JSONResponse:
        return JSONResponse(_model_obj(models.get(request.path_params["model_id"])))

    async def count_tokens(request: Request) -> JSONResponse:
        return await _leased(request, lambda held, body: Messages(held).count_tokens(body), anthropic_error)

    async def embed(request: Request) -> JSONResponse:
        def run(held, body) -> dict:
            from ondevice.embed import embedder_for
            from ondevice.errors import OndeviceError

            try:
                emb = embedder_for(held.rt)
            except OndeviceError as e:
                raise ApiError(400, str(e), param="model", code="unsupported_value") from e
            return embeddings_answer(emb, held.model_id, body)

        return await _leased(request, run, lambda e: e.body())

    async def _leased(request: Request, work, shape) -> JSONResponse:
        """``work(lease, body)`` in a worker thread on the model the body names; errors in ``shape``."""
        held = None
        try:
            body = await read_body(request, server.read_seconds)
            held = await lease(models, body)
            return JSONResponse(await asyncio.to_thread(work, held, body))
        except ApiError as e:
            return error_response(e, shape(e))
        finally:
            if held is not None:
                held.release()

    driver = Driver(models, server.read_seconds)
    return [
        Route("/", page, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", model, methods=["GET"]),
        Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
        Route("/v1/embeddings", embed, methods=["POST"]),
        *[Route(d.path, _endpoint(driver, d), methods=["POST"]) for d in DIALECTS],
    ]


def error_body(path: str, e: ApiError) -> dict:
    """A refused request's body in the shape of the API ``path`` belongs to (the guard refuses before routing)."""
    return anthropic_error(e) if path.startswith(Messages.path) else e.body()


def _endpoint(driver: Driver, dialect: type[Dialect]):
    async def endpoint(request: Request) -> Response:
        return await driver.handle(request, dialect)

    endpoint.__name__ = dialect.__name__
    return endpoint
