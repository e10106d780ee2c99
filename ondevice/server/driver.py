"""The one request path every API dialect goes through: read the body, lease the model it names (loading it if
needed: ``ondevice.server.models``), ``Dialect.parse`` it in a worker thread, admit the ``Call`` to that model's
engine, generate, and answer whole or as server-sent events; the lease ends with the answer.

Either way the answer waits for the runtime *before* anything is sent (so 503 and 400 keep their status), a
generation that did not end by itself is an error, never a finished answer (``errors.cut_short``), and the
job is cancelled as soon as the client disconnects, whether it is still queued or generating.
"""

from __future__ import annotations

import asyncio
import json

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from ondevice.errors import OndeviceError
from ondevice.params import GenerateRequest
from ondevice.server.engine import Busy, Engine, Job, Piece
from ondevice.server.errors import ApiError, cut_short, error_response
from ondevice.server.models import Lease, Models
from ondevice.server.types import Call, Dialect, Reply

MAX_BODY = 4 << 20  # bytes; a full 32k-token conversation is well under 1 MiB of JSON
READ_SECONDS = 30.0  # the longest a client may take to send a request (--read-timeout)
RETRY_AFTER = "1"


async def read_body(request: Request, seconds: float = READ_SECONDS) -> dict:
    """The request's JSON object, at most ``MAX_BODY`` bytes (413 above), valid Unicode (400 otherwise), sent
    within ``seconds`` (408 otherwise: a client trickling its body must not hold a connection for ever)."""
    n = request.headers.get("content-length")
    if n is not None and (not n.isdigit() or int(n) > MAX_BODY):
        raise ApiError(413, f"the request body is {n} bytes; the limit is {MAX_BODY}", code="body_too_large")
    data = bytearray()
    try:
        async with asyncio.timeout(seconds):
            async for part in request.stream():
                data += part
                if len(data) > MAX_BODY:
                    raise ApiError(413, f"the request body is over the limit of {MAX_BODY} bytes",
                                   code="body_too_large")
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {seconds:g} s ({len(data)} bytes came); "
                       "send it at once (the server's --read-timeout)", code="request_timeout",
                       headers={"Connection": "close"}) from None
    try:
        body = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:  # "[[[[..." deeper than the interpreter's limit: was an unhandled 500
        raise ApiError(400, "the request body's JSON nests too deeply", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    try:  # JSON may spell unpaired UTF-16 surrogates ("\\ud800"), which no tokenizer can encode
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        bad = e.object[e.start:e.end].encode("unicode_escape").decode()
        raise ApiError(400, f"the request body holds an unpaired UTF-16 surrogate ({bad}); send valid Unicode",
                       code="invalid_value") from None
    return body


async def lease(models: Models, body: dict) -> Lease:
    """The model ``body`` names (``model``, required), leased for one request (``keep_alive``: Ollama's field)."""
    if body.get("model") is None:
        raise ApiError(400, f"'model' is required; this server serves {', '.join(map(repr, models.ids))}",
                       param="model", code="missing_required_parameter")
    return await models.acquire(body["model"], body.get("keep_alive"))


class Driver:
    """Runs any dialect's requests on the engine of the model each names.

    Args:
        models: the served models.
        read_seconds: the longest a client may take to send its request body.
    """

    def __init__(self, models: Models, read_seconds: float = READ_SECONDS) -> None:
        self.models = models
        self.read_seconds = read_seconds

    async def handle(self, request: Request, dialect: type[Dialect]) -> Response:
        """The answer to one request in ``dialect``."""
        held = None
        try:
            body = await read_body(request, self.read_seconds)
            held = await lease(self.models, body)
            call = await asyncio.to_thread(dialect(held).parse, body)
        except ApiError as e:
            if held is not None:
                held.release()
            return error_response(e, dialect.error(e))
        except ClientDisconnect:  # the client left while sending its body: nobody to answer
            return Response(status_code=499)
        except BaseException:
            if held is not None:
                held.release()
            raise
        return Exchange(self, call, held)

    @staticmethod
    async def start(engine: Engine, ids: list[int], req: GenerateRequest) -> Job:
        """Admit a job or raise ApiError (503 when the queue is full, 400 when the runtime refuses)."""
        try:
            return await engine.start(ids, req)
        except Busy as e:
            raise ApiError(503, f"the server is busy: {e}; retry later", code="server_busy",
                           headers={"Retry-After": RETRY_AFTER}) from None
        except OndeviceError as e:
            raise ApiError(400, str(e)) from e


async def _disconnected(receive) -> None:
    """Return when the client disconnects (the request body has already been read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class Exchange:
    """One call's answer as an ASGI response: generates while watching for the client leaving."""

    def __init__(self, driver: Driver, call: Call, held: Lease) -> None:
        self.driver, self.call, self.held = driver, call, held

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
            finally:
                self.held.release()

    async def _run(self, scope, send) -> None:
        reply = self.call.reply
        try:
            job = await self.driver.start(self.held.engine, self.call.ids, self.call.request)
        except ApiError as e:
            await error_response(e, reply.error(e))(scope, None, send)
            return
        try:
            events = job.events()
            try:
                piece = await anext(events, None)
            except OndeviceError as e:
                e = ApiError(400, str(e))
                await error_response(e, reply.error(e))(scope, None, send)
                return
            out = _Events(reply, scope, send) if self.call.stream else _Whole(reply, scope, send)
            await out.begin()
            try:
                while piece is not None:
                    await out.add(piece)
                    piece = await anext(events, None)
                cut = cut_short(job.stats)
                if cut is not None:
                    await out.cut(cut)
                else:
                    await out.end(job)
            except Exception as e:  # noqa: BLE001 - each way of answering reports it as it can
                await out.fail(e)
        finally:
            job.cancel()


class _Whole:
    """Answers with one JSON body once generation has ended."""

    def __init__(self, reply: Reply, scope, send) -> None:
        self.reply, self.scope, self.send = reply, scope, send
        self.pieces: list[Piece] = []

    async def begin(self) -> None:
        pass

    async def add(self, piece: Piece) -> None:
        self.pieces.append(piece)

    async def end(self, job: Job) -> None:
        await JSONResponse(self.reply.whole(self.pieces, job.stats))(self.scope, None, self.send)

    async def cut(self, e: ApiError) -> None:
        await error_response(e, self.reply.error(e))(self.scope, None, self.send)

    async def fail(self, e: Exception) -> None:
        if isinstance(e, OndeviceError):
            e = ApiError(400, str(e))
        if not isinstance(e, ApiError):
            raise e  # Starlette answers 500 (errors.crash)
        await self.cut(e)


class _Events:
    """Answers with server-sent events: headers once the first chunk is ready, one send per chunk."""

    def __init__(self, reply: Reply, scope, send) -> None:
        self.reply, self.scope, self.send = reply, scope, send
        self.out: list[bytes] = []

    async def begin(self) -> None:
        await self.send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no")]})
        self.out = [self.reply.encode(e) for e in self.reply.opening()]

    async def add(self, piece: Piece) -> None:
        self.out += [self.reply.encode(e) for e in self.reply.piece(piece)]
        await self.send({"type": "http.response.body", "body": b"".join(self.out), "more_body": True})
        self.out = []

    async def end(self, job: Job) -> None:
        self.out += [self.reply.encode(e) for e in self.reply.closing(job.stats)]
        await self._last(self.reply.done)

    async def cut(self, e: ApiError) -> None:  # an error event and no end marker: not to be kept as complete
        self.out.append(self.reply.encode(self.reply.error(e)))
        await self._last(b"")

    async def fail(self, e: Exception) -> None:  # after the headers: reported in-band, as OpenAI does
        msg = str(e) if isinstance(e, OndeviceError) else f"internal error: {type(e).__name__}: {e}"
        self.out.append(self.reply.encode(self.reply.error(ApiError(500, (msg.splitlines() or [""])[0],
                                                                    code="internal_error"))))
        await self._last(self.reply.done)

    async def _last(self, tail: bytes) -> None:
        await self.send({"type": "http.response.body", "body": b"".join(self.out) + tail, "more_body": False})
