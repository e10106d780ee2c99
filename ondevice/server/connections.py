"""HTTP connection limits, so that slow or idle clients cannot hold the server's connections for ever.

uvicorn caps concurrent connections (``limit_concurrency``: a 503 above) and idle keep-alive connections
(``timeout_keep_alive``), and h11 caps a request head's size, but nothing bounds how long a client may take
to send a request head: ``HeadDeadline`` closes a connection whose head has not fully arrived within the
read timeout. The body has its own deadline (``driver.read_body``).
"""

from __future__ import annotations

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

KEEP_ALIVE_SECONDS = 5  # an idle keep-alive connection is closed after this
MAX_HEAD_BYTES = 16 * 1024  # request line and headers
MIN_CONNECTIONS = 64


def max_connections(max_queue: int) -> int:
    """The default connection cap: room for the queue, streams being read and a few health checks."""
    return max(MIN_CONNECTIONS, max_queue + 16)


def uvicorn_options(max_connections: int, read_seconds: float) -> dict:
    """``uvicorn.Config`` keyword arguments for these limits."""
    # uvicorn counts the connection asking as well: N + 1 lets N be served at once
    return {"limit_concurrency": max_connections + 1, "timeout_keep_alive": KEEP_ALIVE_SECONDS,
            "h11_max_incomplete_event_size": MAX_HEAD_BYTES, "http": head_deadline(read_seconds)}


def head_deadline(seconds: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing a connection whose request head takes over ``seconds`` to arrive."""

    class HeadDeadline(H11Protocol):
        _timer = None

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._watch()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._watch()

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop()
            super().connection_lost(exc)

        def _watch(self) -> None:
            """Time the head being received; a head that has arrived (or a closing connection) stops the clock."""
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                if self._timer is None:
                    self._timer = self.loop.call_later(seconds, self._expired)
            else:
                self._stop()

        def _stop(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _expired(self) -> None:
            self._timer = None
            if self.conn.their_state is h11.IDLE:
                self.transport.close()

    return HeadDeadline
