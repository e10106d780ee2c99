"""What an API dialect is, as the driver (``ondevice.server.driver``) sees it.

A ``Dialect`` is one API surface (OpenAI chat.completions, OpenAI completions, OpenAI Responses, Anthropic
Messages): ``parse`` turns a request body into a ``Call`` — the prompt ids, the ``GenerateRequest``,
whether to stream, and the ``Reply`` that writes the answer back in the dialect's own shape, whole or as
stream events. The driver runs any ``Call`` the same way: admit, generate, cut short, finish.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from ondevice.params import GenerateRequest
from ondevice.server.engine import Piece
from ondevice.server.errors import ApiError
from ondevice.speculative import Stats


class Context(Protocol):
    """What a dialect reads: the named model's loaded ``Runtime``, its name, and state a dialect keeps across
    requests and models (``shared``; e.g. the Responses store). The server's ``models.Lease`` is one."""

    rt: Any
    model_id: str
    shared: dict


class Reply(ABC):
    """One request's answer in its dialect's shape.

    Whole: ``whole(pieces, stats)``. Streamed: ``opening()``, then ``piece(p)`` per generated chunk, then
    ``closing(stats)``; each returns events (dicts) that ``encode`` frames, and ``done`` follows the last.
    A reply may keep state between calls (a tool-call parser, a text offset).
    """

    done: ClassVar[bytes] = b""  # what ends a finished stream (OpenAI: ``data: [DONE]``)

    def encode(self, event: dict) -> bytes:
        """One server-sent event (``data: JSON``)."""
        return b"data: " + json.dumps(event, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"

    def error(self, e: ApiError) -> dict:
        """``e`` as this dialect writes an error (the JSON body of a refused request, or an in-band event)."""
        return e.body()

    def opening(self) -> list[dict]:
        """Events sent before the first chunk."""
        return []

    @abstractmethod
    def piece(self, piece: Piece) -> list[dict]:
        """The events of one generated chunk."""

    @abstractmethod
    def closing(self, stats: Stats) -> list[dict]:
        """The events after the last chunk of an answer that ended by itself."""

    @abstractmethod
    def whole(self, pieces: list[Piece], stats: Stats) -> dict:
        """The whole answer's JSON body."""


@dataclass
class Call:
    """A parsed request: what to generate and how to answer.

    Attributes:
        ids: the prompt as token ids (already checked against the context).
        request: the ``GenerateRequest`` that ``Runtime.stream`` runs.
        reply: writes the answer back.
        stream: answer as server-sent events (else one JSON body).
    """

    ids: list[int]
    request: GenerateRequest
    reply: Reply
    stream: bool = False


class Dialect(ABC):
    """One API surface served at ``path`` (POST).

    Args:
        ctx: the server (``Context``): its runtime is read only inside ``parse``.
    """

    path: ClassVar[str]

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx  # a dialect is made per request, for the model the request names

    @abstractmethod
    def parse(self, body: dict) -> Call:
        """Validate a request body and build its ``Call``. Runs in a worker thread: it may tokenize, render
        a chat template or compile a grammar.

        Raises:
            ApiError: the request is refused (a 4xx naming the field).
        """

    @classmethod
    def error(cls, e: ApiError) -> dict:
        """A refused request's JSON body in this dialect's shape (before any ``Reply`` exists)."""
        return e.body()
