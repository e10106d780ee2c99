"""The server's front door: Host, Origin and API-key checks, and CORS, before any route runs.

Host allow-list against DNS rebinding (a web page whose name an attacker points at this machine's address
reaches the server with that name as its Host): on a loopback address only loopback names are answered;
off loopback also IP addresses and the bound address. Names given with ``--allowed-host`` are answered
either way. A browser request from another origin is refused unless that origin was allowed with
``--cors-origin``; allowed origins get CORS headers on every answer, errors included. ``--api-key`` makes
every route but the chat page and ``/health`` (``OPEN_PATHS``) require ``Authorization: Bearer KEY`` (or Anthropic's ``x-api-key: KEY``).
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Callable, Sequence

from starlette.responses import JSONResponse, Response

from ondevice.server.errors import ApiError

LOOPBACK = ("127.0.0.1", "localhost", "::1")
OPEN_PATHS = frozenset({"/", "/health"})  # answered without the API key: the chat page and the health check


def _host_name(host_header: str) -> str:
    h = host_header.strip().lower()
    if h.startswith("["):
        name, _, rest = h[1:].partition("]")
        # "[::1]evil.example" is no URL's host: only "[addr]" or "[addr]:port" names the address
        return name if rest == "" or (rest[:1] == ":" and rest[1:].isdigit()) else h
    return (h.rsplit(":", 1)[0] if h.count(":") == 1 else h).rstrip(".")


def _is_address(name: str) -> bool:
    """An IP literal: a browser sends one only for a page loaded from that address, never after DNS rebinding."""
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class Guard:
    """ASGI middleware around ``app``.

    Args:
        app: the ASGI application to protect.
        api_key: when set, every route but ``OPEN_PATHS`` needs ``Authorization: Bearer api_key``.
        cors_origins: browser origins allowed to call the API ("*" = any).
        loopback_only: answer only loopback names (and ``allowed_hosts``) in the Host header; else also IP
            addresses.
        allowed_hosts: further names the Host header may hold (the bound address, ``--allowed-host``).
        error_body: (request path, error) → the refusal's JSON body in that API's shape (OpenAI's by default).
    """

    def __init__(self, app, *, api_key: str | None, cors_origins: list[str], loopback_only: bool,
                 allowed_hosts: Sequence[str] = (),
                 error_body: Callable[[str, ApiError], dict] | None = None) -> None:
        self.app = app
        self.error_body = error_body or (lambda path, e: e.body())
        self.api_key = api_key
        self.cors = list(cors_origins)
        self.loopback_only = loopback_only
        self.hosts = {*LOOPBACK, *(_host_name(h) for h in allowed_hosts)}

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
            origin = headers.get("origin")
            cross = bool(origin and self.cors and self._origin_allowed(origin))  # an allowed cross-origin caller
            if cross:
                send = self._with_cors(send, origin)  # errors below must be readable by that page too
            try:
                self._guard(scope, headers, origin)
            except ApiError as e:
                await JSONResponse(self.error_body(scope["path"], e), e.status, e.headers)(scope, receive, send)
                return
            if cross and scope["method"] == "OPTIONS":
                await self._preflight(headers)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _guard(self, scope, headers: dict, origin: str | None) -> None:
        host = _host_name(headers.get("host", ""))
        if host not in self.hosts and (self.loopback_only or not _is_address(host)):
            given = headers.get("host", "")
            if self.loopback_only and self.hosts == set(LOOPBACK):
                raise ApiError(403, f"Host header {given!r} is not a loopback name; this server only answers "
                               "http://127.0.0.1 or http://localhost (use --host to serve elsewhere, or "
                               f"--allowed-host {host or 'NAME'} to answer this name)", code="forbidden_host")
            raise ApiError(403, f"Host header {given!r} is not a name this server answers (a web page may be "
                           f"trying DNS rebinding); start the server with --allowed-host {host or 'NAME'} to "
                           "answer it", code="forbidden_host")
        if origin and not self._origin_allowed(origin, headers.get("host", "")):
            raise ApiError(403, f"requests from the web origin {origin!r} are not allowed; start the server "
                           f"with --cors-origin {origin} to allow it", code="forbidden_origin")
        # every route but OPEN_PATHS (not only /v1: llama.cpp's /rerank path runs the model too)
        if self.api_key and scope["path"] not in OPEN_PATHS and scope["method"] != "OPTIONS":
            auth = headers.get("authorization", "")
            given = auth[7:].strip() if auth[:7].lower() == "bearer " else headers.get("x-api-key", "").strip()
            if not hmac.compare_digest(given.encode(), self.api_key.encode()):
                what = "no API key was sent" if not given else "the API key is wrong"
                raise ApiError(401, f"{what}: send 'Authorization: Bearer KEY' (or 'x-api-key: KEY') with the "
                               "server's --api-key",
                               code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    def _origin_allowed(self, origin: str, host: str | None = None) -> bool:
        if "*" in self.cors or origin in self.cors:
            return True
        return host is not None and origin.split("://", 1)[-1].lower() == host.lower()  # same origin

    def _preflight(self, headers: dict) -> Response:
        return Response(status_code=204, headers={  # Access-Control-Allow-Origin comes from _with_cors
            "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
            "Access-Control-Allow-Headers": headers.get("access-control-request-headers", "authorization, content-type"),
            "Access-Control-Max-Age": "600"})

    @staticmethod
    def _with_cors(send, origin: str):
        async def wrapped(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []),
                                                  (b"access-control-allow-origin", origin.encode("latin-1")),
                                                  (b"vary", b"Origin")]}
            await send(message)

        return wrapped
