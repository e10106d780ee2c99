"""``ondevice serve``: an OpenAI-compatible HTTP server (Starlette on uvicorn) and the chat page.

Routes: ``GET /`` (the chat page), ``GET /health``, ``GET /v1/models``, ``POST /v1/completions`` and
``POST /v1/chat/completions`` (whole or streamed as server-sent events). One ``Runtime`` serves every
request in turn (``ondevice.server.engine``); the wire format lives in ``ondevice.server.openai_api``.

Security: the server binds 127.0.0.1 unless told otherwise (``ondevice.server.guard`` checks Host,
Origin and the API key before routing). Request bodies are limited to ``MAX_BODY`` bytes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from importlib import resources
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from ondevice.errors import OndeviceError
from ondevice.params import GenerateRequest
from ondevice.server.engine import Busy, Engine
from ondevice.server.guard import Guard
from ondevice.server.openai_api import (
    ApiError,
    Reply,
    chat_messages,
    check_context,
    completion_prompt,
    cut_short,
    generation_args,
)
from ondevice.server.structured import (
    Structured,
    ToolStream,
    chat_logprobs,
    completion_logprobs,
    structured_args,
    tool_call_deltas,
)
from ondevice.tools import parse_calls, template_messages

MAX_BODY = 4 << 20  # bytes; a full 32k-token conversation is well under 1 MiB of JSON
RETRY_AFTER = "1"


def _error(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


class Server:
    """The application state: runtime, engine, model id, and the security settings.

    Args:
        runtime: the loaded ``Runtime`` (closed by the caller).
        model_id: the name clients send as ``model`` (also listed by /v1/models).
        api_key: when set, /v1 routes need ``Authorization: Bearer api_key``.
        max_queue: requests that may wait behind the running one.
        cors_origins: browser origins allowed to call the API ("*" = any).
        loopback_only: refuse requests whose Host header is not a loopback name.
    """

    def __init__(self, runtime, model_id: str, *, api_key: str | None = None, max_queue: int = 16,
                 cors_origins: list[str] | None = None, loopback_only: bool = True) -> None:
        self.rt = runtime
        self.model_id = model_id
        self.api_key = api_key
        self.engine = Engine(runtime, max_queue)
        app = Starlette(
            routes=[
                Route("/", self.page, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/models/{model_id:path}", self.model, methods=["GET"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            ],
            exception_handlers={HTTPException: self._http_error, Exception: self._crash},
        )
        self.asgi = Guard(app, api_key=api_key, cors_origins=list(cors_origins or []), loopback_only=loopback_only)

    async def __call__(self, scope, receive, send) -> None:
        await self.asgi(scope, receive, send)

    async def _http_error(self, request: Request, exc: HTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        msg = f"{request.method} {request.url.path}: {exc.detail}"
        return _error(ApiError(exc.status_code, msg, code=code))

    async def _crash(self, request: Request, exc: Exception) -> JSONResponse:
        first = (str(exc).splitlines() or [""])[0]
        return _error(ApiError(500, f"internal error: {type(exc).__name__}: {first}", code="internal_error"))

    # -- simple routes ------------------------------------------------------------------------------
    async def page(self, request: Request) -> HTMLResponse:
        html = resources.files("ondevice.web").joinpath("index.html").read_text(encoding="utf-8")
        return HTMLResponse(html, headers={"Content-Security-Policy": "default-src 'self'; style-src 'unsafe-inline'; "
                                           "script-src 'unsafe-inline'; img-src data:", "X-Content-Type-Options": "nosniff"})

    async def health(self, request: Request) -> JSONResponse:
        e = self.engine
        d = self.rt.drafter
        return JSONResponse({"status": "ok", "model": self.model_id, "drafter": d.name if d else "none",
                             "n_ctx": self.rt.n_ctx, "auth": bool(self.api_key), "running": e.running,
                             "queued": e.waiting, "max_queue": e.max_queue, **{k: v for k, v in vars(e.counters).items()}})

    def _model_obj(self) -> dict:
        d = self.rt.drafter
        return {"id": self.model_id, "object": "model", "created": 0, "owned_by": "ondevice",
                "meta": {"n_ctx": self.rt.n_ctx, "drafter": d.name if d else "none",
                         "vocab_size": self.rt.target.vocab_size}}

    async def models(self, request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [self._model_obj()]})

    async def model(self, request: Request) -> JSONResponse:
        self._check_model(request.path_params["model_id"])
        return JSONResponse(self._model_obj())

    def _check_model(self, name: Any) -> None:
        if name != self.model_id:
            raise ApiError(404, f"the model {name!r} is not served here; this server serves {self.model_id!r} "
                           "(see GET /v1/models)", param="model", code="model_not_found")

    # -- generation ---------------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def _body(self, request: Request) -> dict:
        n = request.headers.get("content-length")
        if n is not None and (not n.isdigit() or int(n) > MAX_BODY):
            raise ApiError(413, f"the request body is {n} bytes; the limit is {MAX_BODY}", code="body_too_large")
        data = bytearray()
        async for part in request.stream():
            data += part
            if len(data) > MAX_BODY:
                raise ApiError(413, f"the request body is over the limit of {MAX_BODY} bytes", code="body_too_large")
        try:
            body = json.loads(data)
        except (ValueError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
        try:  # JSON may spell unpaired UTF-16 surrogates ("\\ud800"), which no tokenizer can encode
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as e:
            bad = e.object[e.start:e.end].encode("unicode_escape").decode()
            raise ApiError(400, f"the request body holds an unpaired UTF-16 surrogate ({bad}); send valid Unicode",
                           code="invalid_value") from None
        return body

    async def _generate(self, request: Request, chat: bool) -> Response:
        try:
            body = await self._body(request)
            if body.get("model") is None:
                raise ApiError(400, f"'model' is required; this server serves {self.model_id!r}", param="model",
                               code="missing_required_parameter")
            self._check_model(body.get("model"))
            stream = body.get("stream", False)
            if not isinstance(stream, bool):
                raise ApiError(400, "'stream' must be true or false", param="stream")
            opts = body.get("stream_options") or {}
            with_usage = bool(isinstance(opts, dict) and opts.get("include_usage"))
            st = structured_args(body, chat, self.rt.target.chat_template)
            ids = await asyncio.to_thread(self._prompt_ids, body, chat, st.tools)  # an untrusted template renders off the loop
            req = dataclasses.replace(generation_args(body, len(ids), self.rt.n_ctx), **st.run)
        except ApiError as e:
            return _error(e)
        except ClientDisconnect:  # the client left while sending its body: nobody to answer
            return Response(status_code=499)
        reply = Reply(chat, self.model_id)
        if stream:
            return SSEResponse(self, ids, req, reply, with_usage, st)
        return await self._whole(request, ids, req, reply, st)

    def _prompt_ids(self, body: dict, chat: bool, tools: list | None = None) -> list[int]:
        """The request's prompt as token ids (in a worker thread: tokenizing waits for the runtime's lock and a
        chat template renders in its own budgeted process)."""
        try:
            if chat:
                ids = self.rt.render_chat(template_messages(chat_messages(body)), tools=tools)
            else:
                p = completion_prompt(body)
                ids = self.rt.tokenize(p) if isinstance(p, str) else p
                if isinstance(p, str) and not p and self.rt.target.bos_id is not None:
                    ids = [self.rt.target.bos_id]
                bad = [x for x in ids if not 0 <= x < self.rt.target.vocab_size]
                if bad:
                    raise ApiError(400, f"prompt token id {bad[0]} is outside the vocabulary (size "
                                   f"{self.rt.target.vocab_size})", param="prompt")
        except OndeviceError as e:
            raise ApiError(400, str(e), param="messages" if chat else "prompt") from e
        if not ids:
            raise ApiError(400, "the prompt is empty", param="prompt")
        check_context(len(ids), self.rt.n_ctx)
        return ids

    async def start(self, ids: list[int], req: GenerateRequest):
        """Admit a job or raise ApiError (503 when the queue is full, 400 when the runtime refuses)."""
        try:
            return await self.engine.start(ids, req)
        except Busy as e:
            raise ApiError(503, f"the server is busy: {e}; retry later", code="server_busy",
                           headers={"Retry-After": RETRY_AFTER}) from None
        except OndeviceError as e:
            raise ApiError(400, str(e)) from e

    async def _whole(self, request: Request, ids: list[int], req: GenerateRequest, reply: Reply, st: Structured) -> Response:
        watcher = asyncio.ensure_future(_disconnected(request.receive))
        admit = asyncio.ensure_future(self.start(ids, req))
        job = None
        try:
            await asyncio.wait({admit, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not admit.done():  # the client left while queued
                admit.cancel()
                try:
                    await admit
                except (asyncio.CancelledError, ApiError):
                    pass
                return Response(status_code=499)
            job = admit.result()
            text, lps = [], []
            collect = asyncio.ensure_future(_collect(job, text, lps))
            await asyncio.wait({collect, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not collect.done():
                job.cancel()
                await collect
                return Response(status_code=499)
            collect.result()
            cut = cut_short(job.stats)
            if cut is not None:
                return _error(cut)
            answer, calls = "".join(text), None
            if st.tools:
                answer, calls = parse_calls(answer, st.tool_format, st.tools)
                if "grammar" in st.run and not calls:
                    answer = None  # a forced call cut short is no content (as streamed: ToolStream)
            tb = self.rt.target.token_bytes
            lp = (chat_logprobs(lps, tb) if reply.chat else completion_logprobs(lps, tb)) if st.logprobs else None
            return JSONResponse(reply.whole(answer, job.stats, lp, calls or None))
        except ApiError as e:
            return _error(e)
        except OndeviceError as e:
            return _error(ApiError(400, str(e)))
        finally:
            watcher.cancel()
            admit.cancel()  # no-op once admitted; a shutdown that cancels this handler leaves no waiter behind
            if job is not None:
                job.cancel()


async def _disconnected(receive) -> None:
    """Return when the client disconnects (the request body has already been read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _collect(job, text: list[str], lps: list) -> None:
    async for piece in job.events():
        text.append(piece.chunk.text)
        lps.extend(piece.chunk.logprobs or [])


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


class SSEResponse:
    """A streamed completion: waits for the runtime *before* sending headers (so 503/400 keep their status),
    sends one ``data:`` event per chunk, ends with ``data: [DONE]``, and cancels the job as soon as the
    client disconnects."""

    def __init__(self, server: Server, ids: list[int], req: GenerateRequest, reply: Reply, with_usage: bool,
                 st: Structured) -> None:
        self.server, self.ids, self.req, self.reply, self.with_usage = server, ids, req, reply, with_usage
        self.st = st

    async def __call__(self, scope, receive, send) -> None:
        watcher = asyncio.ensure_future(_disconnected(receive))
        body = asyncio.ensure_future(self._run(scope, send))
        try:
            await asyncio.wait({body, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not body.done():
                body.cancel()  # the client left: cancels the queued wait or the running job (see _run)
            try:
                await body
            except (asyncio.CancelledError, OSError):
                pass

    async def _run(self, scope, send) -> None:
        try:
            job = await self.server.start(self.ids, self.req)
        except ApiError as e:
            await _error(e)(scope, None, send)
            return
        try:
            events = job.events()
            try:
                piece = await anext(events, None)
            except OndeviceError as e:
                await _error(ApiError(400, str(e)))(scope, None, send)
                return
            await send({"type": "http.response.start", "status": 200, "headers": [
                (b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                (b"x-accel-buffering", b"no")]})
            r, u, st = self.reply, self.with_usage, self.st
            opening = r.first(u)
            out = [_sse(opening)] if opening else []
            tb, offset = self.server.rt.target.token_bytes, 0
            ts = ToolStream(st.tool_format, st.tools, "grammar" in st.run) if st.tools else None
            calls: list = []
            try:
                while piece is not None:
                    c = piece.chunk
                    lp = None
                    if st.logprobs:
                        lp = chat_logprobs(c.logprobs or [], tb) if r.chat else completion_logprobs(c.logprobs or [], tb, offset)
                        offset += len(c.text)
                    text = ts.feed(c.text) if ts else c.text
                    out.append(_sse(r.piece(text, c.from_draft, piece.drafted, piece.accepted, u, lp)))
                    await send({"type": "http.response.body", "body": b"".join(out), "more_body": True})
                    out = []
                    piece = await anext(events, None)
                cut = cut_short(job.stats)
                if cut is not None:  # an error event and no [DONE]: the client must not keep this as complete
                    await send({"type": "http.response.body", "body": b"".join(out) + _sse(cut.body()),
                                "more_body": False})
                    return
                if ts:
                    tail, calls = ts.finish()
                    if tail or calls:
                        out.append(_sse(r.piece(tail, [], 0, 0, u, tool_calls=tool_call_deltas(calls) or None)))
                out += [_sse(o) for o in r.last(job.stats, u, bool(calls))]
            except Exception as e:  # noqa: BLE001 - after the headers: report in-band, as OpenAI does
                msg = str(e) if isinstance(e, OndeviceError) else f"internal error: {type(e).__name__}: {e}"
                out.append(_sse(ApiError(500, (msg.splitlines() or [""])[0], code="internal_error").body()))
            await send({"type": "http.response.body", "body": b"".join(out) + b"data: [DONE]\n\n", "more_body": False})
        finally:
            job.cancel()
