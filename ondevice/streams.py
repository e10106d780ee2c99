"""``Stream`` and ``AsyncStream``: one request's chunks, its cancel handle and its statistics.

A stream owns the runtime's request slot from its first chunk until it ends. Nothing else keeps
it alive: the runtime holds only a weak reference to the generator, so a stream that is dropped
unfinished (``for c in rt.stream(...): break``) is closed at once by the garbage collector, which
releases the slot. ``AsyncStream`` computes a chunk only when the consumer asks for the next one,
on a thread of its own, and closes its stream synchronously when the consumer leaves.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

from ondevice.results import Chunk, Stats


class Request:
    """What a running request shares with its runtime: statistics, output so far, cancel flag.

    The generator doing the work refers to this object, never to its ``Stream``, so that dropping the
    stream really frees (and closes) the generator.
    """

    def __init__(self) -> None:
        self.stats = Stats()
        self.text = ""
        self.tokens: list[int] = []
        self.logprobs: list | None = None  # TokenLogprob per token, when asked for
        self.cancel_event = threading.Event()
        self.gen: weakref.ReferenceType | None = None  # the generator serving this request

    def add(self, chunk: Chunk) -> None:
        """Record a chunk about to be released (the output so far)."""
        self.tokens.extend(chunk.tokens)
        if chunk.logprobs is not None:
            self.logprobs.extend(chunk.logprobs)
        self.text += chunk.text


class _Outputs:
    """What a stream shows of its request: ``stats``, ``text`` and ``tokens`` so far, and ``cancel()``."""

    _req: Request

    @property
    def stats(self) -> Stats:
        return self._req.stats

    @property
    def text(self) -> str:
        return self._req.text

    @property
    def tokens(self) -> list[int]:
        return self._req.tokens

    @property
    def logprobs(self) -> list | None:
        """``TokenLogprob`` per token so far (None unless the request asked for logprobs)."""
        return self._req.logprobs

    def cancel(self) -> None:
        """Stop after the current target pass (safe from any thread)."""
        self._req.cancel_event.set()


class Stream(_Outputs):
    """An iterator of ``Chunk`` with a cancel handle and the request's ``stats`` once done."""

    def __init__(self, gen_factory, request: Request) -> None:
        self._req = request
        self._gen = gen_factory(request)
        request.gen = weakref.ref(self._gen)
        self._busy = threading.RLock()  # held by ``next`` and ``close``: neither meets the other's generator running

    @property
    def cancelled(self) -> bool:
        return self._req.cancel_event.is_set()

    def __iter__(self) -> Iterator[Chunk]:
        return self

    def __next__(self) -> Chunk:
        with self._busy:  # a close() from another thread may be running the generator's cleanup: wait for it
            return next(self._gen)

    def close(self) -> None:
        """End the request: now when no thread is inside ``next`` (or from the thread iterating it); from another
        thread while a pass runs, right after that pass (a cancel: the iterating thread sees the stream end)."""
        if not self._busy.acquire(blocking=False):  # another thread is inside next: closing would raise
            self.cancel()  # "generator already executing"
            return
        try:
            if self._gen.gi_running:  # this thread, from inside the pass (a callback)
                self.cancel()
            else:
                if self._gen.gi_frame is not None and not self._gen.gi_suspended:  # never started: its cleanup
                    self.cancel()  # will not run, and a request already queued (a BatchEngine's) must end too
                self._gen.close()
        finally:
            self._busy.release()

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncStream(_Outputs):
    """A ``Stream`` for asyncio: ``async for chunk in rt.astream(...)``.

    Each ``__anext__`` computes the next chunk on this stream's own worker thread, so the event loop
    never blocks and nothing is computed ahead of the consumer. Leaving the ``async for`` early
    (break, an exception, a cancelled task) ends the request at once: the stream is closed, the
    runtime's slot released and ``Runtime.last_stats`` updated before the next line runs.
    """

    def __init__(self, stream: Stream) -> None:
        self._stream = stream
        self._req = stream._req
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ondevice-astream")
        self._pending: Future | None = None
        self._closed = False

    def __aiter__(self) -> AsyncStream:
        return self

    async def __anext__(self) -> Chunk:
        if self._closed:
            raise StopAsyncIteration
        import asyncio  # here, not at import: already loaded by any caller's event loop (24 ms at a cold start)

        self._pending = self._pool.submit(next, self._stream, None)
        try:
            chunk = await asyncio.wrap_future(self._pending)
        except BaseException:  # an error in the model, or the consumer's task was cancelled
            self.close()
            raise
        self._pending = None
        if chunk is None:
            self.close()
            raise StopAsyncIteration
        return chunk

    def close(self) -> None:
        """End the request now; a pass already running finishes first, on the worker thread."""
        if self._closed:
            return
        self._closed = True
        self._stream.cancel()
        pending, self._pending = self._pending, None
        if pending is None or pending.done():
            self._stream.close()  # not executing: close it here, synchronously
        else:
            self._pool.submit(self._stream.close)  # runs right after the pass in flight
        self._pool.shutdown(wait=False)

    async def aclose(self) -> None:
        self.close()

    async def __aenter__(self) -> AsyncStream:
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - finalizers must not raise
            pass
