"""The server's scheduler: one ``Runtime``, one generation at a time, a bounded FIFO queue, explicit cancel.

Requests wait on an ``asyncio.Lock`` (FIFO) instead of blocking threads on the Runtime's own lock, so a
request that is still queued costs nothing and a client that leaves the queue simply stops waiting.
The generation itself runs in a worker thread that iterates ``Runtime.stream`` and hands chunks to the
event loop. Cancelling a job sets the stream's cancel flag and stops the worker after the chunk it is
delivering; the worker then closes the stream (the Runtime releases its slot at once) and only then
frees the queue slot, so the next request starts within one target pass of a disconnect.

A runtime loaded with ``parallel=N`` (``serve --parallel N``) runs up to N jobs at once: their streams come
from one ``ondevice.batching.BatchEngine``, which decodes them together in one llama.cpp batch (a job's
cancel frees its slot before the next batched step); the queue then waits for a free slot, FIFO.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from ondevice.errors import OndeviceError
from ondevice.params import GenerateRequest
from ondevice.speculative import Chunk, Stats


class Busy(Exception):
    """The queue is full: the caller answers 503 with Retry-After."""


@dataclass
class Piece:
    """One streamed chunk with the running draft counters at the moment it was produced."""

    chunk: Chunk
    drafted: int
    accepted: int


@dataclass
class Counters:
    """What ``/health`` reports."""

    served: int = 0
    cancelled: int = 0
    failed: int = 0
    rejected: int = 0
    last: dict = field(default_factory=dict)  # stop_reason / tokens of the last finished request


class Job:
    """A generation admitted to the runtime. Iterate ``events()``; always call ``cancel()`` when leaving.

    ``events()`` yields ``Piece``s and ends after the stream has finished; ``stats`` is then final.
    Errors raised by the runtime (for example an ``OndeviceError`` on the first pass) re-raise from
    ``events()``.
    """

    def __init__(self, engine: Engine, stream) -> None:
        self._engine = engine
        self.stream = stream
        self.stats: Stats = stream.stats
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()
        self._stop = threading.Event()
        self.finished = asyncio.Event()  # set when the worker has closed the stream and freed the slot
        self._thread = threading.Thread(target=self._work, name="ondevice-serve", daemon=True)
        self._thread.start()

    def _post(self, item) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the event loop is gone (server shutting down)
            pass

    def _work(self) -> None:
        error: BaseException | None = None
        try:
            for chunk in self.stream:
                s = self.stream.stats
                self._post(Piece(chunk, s.drafted, s.accepted))
                if self._stop.is_set():
                    break
        except BaseException as e:  # noqa: BLE001 - handed to the event loop, re-raised there
            error = e
        finally:
            try:
                self.stream.close()  # ends the runtime's generator: its slot is free from here on
                if self._stop.is_set() and not self.stats.stop_reason:
                    self.stats.stop_reason = "cancelled"
            finally:
                self._post(error if error is not None else None)
                try:
                    self._loop.call_soon_threadsafe(self._engine._release, self)
                except RuntimeError:
                    pass

    async def events(self) -> AsyncIterator[Piece]:
        while True:
            item = await self._queue.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def cancel(self) -> None:
        """Stop after the target pass in progress (idempotent, safe after the end)."""
        self._stop.set()
        self.stream.cancel()

    @property
    def cancelled(self) -> bool:
        return self._stop.is_set()


class Engine:
    """Serialises requests on one runtime (``runtime.parallel`` at once, default 1) with at most ``max_queue``
    waiting behind the running ones.

    Args:
        runtime: the loaded ``Runtime``.
        max_queue: how many requests may wait while the slots are busy; more get ``Busy``.
    """

    def __init__(self, runtime, max_queue: int) -> None:
        self.rt = runtime
        self.max_queue = max_queue
        self.waiting = 0
        self.current: Job | None = None  # the job started last
        self.jobs: set[Job] = set()  # the jobs running now
        self.counters = Counters()
        self.closing = False
        self.parallel = int(getattr(runtime, "parallel", 1) or 1)
        self.batch = None
        if self.parallel > 1:
            from ondevice.batching import BatchEngine

            self.batch = BatchEngine(runtime, self.parallel)
        self._lock = asyncio.Lock() if self.parallel == 1 else asyncio.Semaphore(self.parallel)
        self._held = 0  # slots taken (a job running, or its stream being opened)

    @property
    def running(self) -> int:
        return self._held

    async def _take(self) -> None:
        await self._lock.acquire()
        self._held += 1

    def _free(self) -> None:
        self._held -= 1
        self._lock.release()

    async def start(self, ids: Sequence[int], req: GenerateRequest) -> Job:
        """Wait for the runtime (FIFO), then start generating ``ids`` with ``Runtime.stream(ids, req)``.

        Raises:
            Busy: ``max_queue`` requests are already waiting, or the server is shutting down.
            OndeviceError: the runtime rejected the arguments (nothing was started).
        """
        if self.closing:
            raise Busy("the server is shutting down")
        if self._lock.locked() and self.waiting >= self.max_queue:
            self.counters.rejected += 1
            raise Busy(f"{self.waiting} requests are already waiting (--max-queue {self.max_queue})")
        self.waiting += 1
        try:
            await self._take()
        finally:
            self.waiting -= 1
        # Runtime.stream compiles the request's grammar (and, the first time, the vocabulary's): seconds for a
        # large schema, so in a worker thread; the event loop keeps serving other clients meanwhile.
        made = asyncio.ensure_future(asyncio.to_thread(self._open, ids, req))
        try:
            stream = await asyncio.shield(made)
        except asyncio.CancelledError:  # the client left: the runtime is free once the thread has finished
            made.add_done_callback(self._discard)
            raise
        except BaseException:
            self._free()
            raise
        try:
            self.current = job = Job(self, stream)
        except BaseException:
            stream.close()
            self._free()
            raise
        self.jobs.add(job)
        return job

    def _open(self, ids: Sequence[int], req: GenerateRequest):
        from ondevice.media import MediaPrompt

        if self.closing:
            raise Busy("the server is shutting down")
        if isinstance(ids, MediaPrompt):  # a prompt with images: the one-at-a-time path evaluates them
            if self.batch is not None:
                ids.close()
                raise OndeviceError("images are not decoded in --parallel slots yet; serve this model without "
                                    "--parallel to send images")
            return self.rt.stream(ids, req)
        if self.batch is not None:
            return self.batch.stream(list(ids), req)
        return self.rt.stream(list(ids), req)

    def _discard(self, made: asyncio.Future) -> None:
        """A stream opened for a client that left: close it (nothing ran), then free the runtime."""
        try:
            if not made.cancelled() and made.exception() is None:
                made.result().close()
        finally:
            self._free()

    def _release(self, job: Job) -> None:
        """Called on the event loop once the worker has closed ``job``'s stream."""
        s = job.stats
        c = self.counters
        if s.stop_reason == "cancelled":
            c.cancelled += 1
        elif s.stop_reason:
            c.served += 1
        else:
            c.failed += 1
        c.last = {"stop_reason": s.stop_reason or "error", "tokens": s.tokens,
                  "target_forwards": s.target_forwards, "seconds": s.total_seconds}
        if self.current is job:
            self.current = None
        self.jobs.discard(job)
        job.finished.set()
        self._free()

    def close(self) -> None:
        """Shutdown: refuse new and queued requests, cancel the running one (it ends within one target pass)."""
        self.closing = True
        for job in list(self.jobs):
            job.cancel()
