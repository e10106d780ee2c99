"""The served models: each named model is loaded on first use, at most ``max_loaded`` at once (the least
recently used idle one is unloaded to make room; a request that needs room waits, it is never refused for it),
and unloaded after ``keep_alive`` seconds without requests, its memory given back (``Runtime.close``).

A request holds a ``Lease`` on its model from parsing to the end of its answer; a model with leases is never
unloaded. Each loaded model has its own ``Engine`` (one generation at a time per model, so two models answer
two clients at once) and its own drafter (``load(..., draft="auto")`` chooses per model). A model that fails
to load answers its requests with one clear error; the others keep serving.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ondevice.server.engine import Counters, Engine
from ondevice.server.errors import ApiError

KEEP_ALIVE = 300.0  # seconds an idle model stays loaded (Ollama's default: 5 minutes)
_DURATION = re.compile(r"^\s*(-?\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")


def _retrieved(task: asyncio.Task) -> None:
    """Mark a load's exception as seen (it was answered to each waiting request, or nobody waited)."""
    if not task.cancelled():
        task.exception()


def keep_alive_seconds(v: Any, param: str = "keep_alive") -> float:
    """Ollama's ``keep_alive``: seconds as a number or a duration ("30s", "5m", "1h"); 0 unloads at once after
    the request, a negative value keeps the model loaded (returns ``inf``).

    Raises:
        ApiError: anything else (400 naming ``param``).
    """
    if isinstance(v, int | float) and not isinstance(v, bool):
        x = float(v)
    elif isinstance(v, str) and (m := _DURATION.match(v)):
        x = float(m.group(1)) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600, None: 1}[m.group(2)]
    else:
        raise ApiError(400, f"'{param}': {v!r} is not a duration: give seconds or a string such as '30s', '5m', "
                       "'1h' (0 unloads after the request, negative keeps the model loaded)", param=param,
                       code="invalid_value")
    if x != x:
        raise ApiError(400, f"'{param}' must be a number", param=param, code="invalid_value")
    return float("inf") if x < 0 else x


@dataclass
class Model:
    """One served model and, while it is loaded, its runtime and engine."""

    id: str
    spec: str  # what ``load`` takes: a path, a catalog or store name
    rt: Any = None
    engine: Engine | None = None
    info: dict = field(default_factory=dict)  # n_ctx, drafter, vocab_size: known after the first load
    leases: int = 0
    load: asyncio.Task | None = None  # the load in progress
    last_used: float = 0.0
    keep_alive: float = KEEP_ALIVE
    loads: int = 0  # how many times it was loaded (``/health``)
    counters: Counters = field(default_factory=Counters)
    timer: asyncio.TimerHandle | None = None

    @property
    def loaded(self) -> bool:
        return self.rt is not None

    @property
    def busy(self) -> bool:
        e = self.engine
        return self.leases > 0 or self.load is not None or (e is not None and (e.running or e.waiting))


class Lease:
    """A request's hold on a loaded model: what a dialect reads (``rt``, ``model_id``, ``shared``) and the
    engine it runs on. ``release()`` once the answer is finished (idempotent)."""

    def __init__(self, models: Models, model: Model) -> None:
        self._models, self.model = models, model
        self.rt, self.engine, self.model_id = model.rt, model.engine, model.id
        self.shared = models.shared
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._models._release(self.model)


class Models:
    """Every served model, loaded on demand.

    Args:
        specs: (id, what ``load`` takes) per model, in the order ``/v1/models`` lists them.
        loader: spec → a loaded ``Runtime`` (blocking; run in a worker thread).
        max_loaded: models loaded at once at most.
        keep_alive: seconds an idle model stays loaded (``inf``: until exit), unless a request says otherwise.
        max_queue: requests that may wait per model behind its running one.
    """

    def __init__(self, specs: Sequence[tuple[str, str]], loader: Callable[[str], Any], *, max_loaded: int = 1,
                 keep_alive: float = KEEP_ALIVE, max_queue: int = 16) -> None:
        ids = [i for i, _ in specs]
        dup = {i for i in ids if ids.count(i) > 1}
        if dup:
            from ondevice.errors import OndeviceError

            raise OndeviceError(f"the model name {sorted(dup)[0]!r} is given twice; serve each model once")
        if max_loaded < 1:
            from ondevice.errors import OndeviceError

            raise OndeviceError(f"--max-loaded {max_loaded}: at least 1")
        self.models = {i: Model(i, s, keep_alive=keep_alive) for i, s in specs}
        self.loader = loader
        self.max_loaded = max_loaded
        self.keep_alive = keep_alive
        self.max_queue = max_queue
        self.shared: dict = {}  # state a dialect keeps across models (the Responses store)
        self.closing = False
        self._cond: asyncio.Condition | None = None

    @property
    def ids(self) -> list[str]:
        return list(self.models)

    def adopt(self, model_id: str, rt) -> None:
        """A model loaded before the event loop started (``ondevice serve`` loads the first one at once)."""
        m = self.models[model_id]
        self._loaded(m, rt)
        m.last_used = time.monotonic()

    def _loaded(self, m: Model, rt) -> None:
        m.rt, m.engine = rt, Engine(rt, self.max_queue)
        m.engine.counters = m.counters  # counted over every load
        m.loads += 1
        d = rt.drafter
        m.info = {"n_ctx": rt.n_ctx, "drafter": d.name if d else "none", "vocab_size": rt.target.vocab_size}

    def get(self, name: Any) -> Model:
        """The served model called ``name`` (404 in OpenAI's shape otherwise; a dialect rewrites the shape)."""
        m = self.models.get(name) if isinstance(name, str) else None
        if m is None:
            served = ", ".join(repr(i) for i in self.models)
            raise ApiError(404, f"the model {name!r} is not served here; this server serves {served} "
                           "(see GET /v1/models)", param="model", code="model_not_found")
        return m

    async def acquire(self, name: Any, keep_alive: Any = None) -> Lease:
        """Lease the model ``name``, loading it first if needed (waiting for room when ``max_loaded`` models are
        loaded and busy). ``keep_alive``: this request's idle time for the model (Ollama's field).

        Raises:
            ApiError: unknown model (404), a bad keep_alive (400), the model failed to load (500), shutting down
                (503).
        """
        m = self.get(name)
        ka = self.keep_alive if keep_alive is None else keep_alive_seconds(keep_alive)
        self.start_clocks()
        while True:
            async with self._cond:
                evict: list = []  # runtimes of the idle models unloaded to make room
                while True:
                    if self.closing:
                        raise ApiError(503, "the server is shutting down", code="server_busy")
                    if m.loaded:
                        return self._lease(m, ka)
                    if m.load is not None:  # loading for another request: wait for the same load
                        break
                    active = [x for x in self.models.values() if x.loaded or x.load is not None]
                    if len(active) < self.max_loaded:
                        m.load = asyncio.ensure_future(self._load(m, evict))
                        m.load.add_done_callback(_retrieved)
                        break
                    idle = sorted((x for x in active if not x.busy), key=lambda x: x.last_used)
                    if idle:
                        evict.append(self._unhook(idle[0]))
                        continue
                    await self._cond.wait()
                task = m.load
            # shielded: a client that leaves does not cancel a load other requests may be waiting for
            await asyncio.shield(task)  # then lease it (unless it was unloaded meanwhile: round again)

    async def _load(self, m: Model, evict: list) -> None:
        """Unload ``evict``, then load ``m`` (its ``load`` task; every request waiting for it sees its error)."""
        rt = None
        try:
            for old in evict:
                await asyncio.to_thread(self._close, old)
            rt = await asyncio.to_thread(self.loader, m.spec)
        except Exception as e:
            first = (str(e).splitlines() or [""])[0]
            raise ApiError(500, f"the model {m.id!r} could not be loaded: {first}", param="model",
                           code="model_load_failed") from e
        finally:
            async with self._cond:
                m.load = None
                if rt is not None and not self.closing:
                    self._loaded(m, rt)
                    m.last_used = time.monotonic()
                self._cond.notify_all()
        if self.closing:
            await asyncio.to_thread(rt.close)
            raise ApiError(503, "the server is shutting down", code="server_busy")
        if not m.leases:
            m.leases = 1
            self._release(m)  # its idle clock runs until a waiting request leases it

    def start_clocks(self) -> None:
        """On the event loop, once: start the idle clock of models loaded before it ran (``adopt``)."""
        if self._cond is None:
            self._cond = asyncio.Condition()
            for m in self.models.values():
                if m.loaded and not m.leases:
                    m.leases = 1
                    self._release(m)

    def _lease(self, m: Model, keep_alive: float) -> Lease:
        m.leases += 1
        m.keep_alive = keep_alive
        m.last_used = time.monotonic()
        if m.timer is not None:
            m.timer.cancel()
            m.timer = None
        return Lease(self, m)

    def _release(self, m: Model) -> None:
        m.leases -= 1
        m.last_used = time.monotonic()
        if m.leases == 0 and m.loaded and m.keep_alive != float("inf"):
            loop = asyncio.get_running_loop()
            m.timer = loop.call_later(m.keep_alive, lambda: asyncio.ensure_future(self._expire(m)))
        if self._cond is not None:
            asyncio.ensure_future(self._notify())

    async def _notify(self) -> None:
        async with self._cond:
            self._cond.notify_all()

    async def _expire(self, m: Model) -> None:
        """Unload ``m`` if it is still idle ``keep_alive`` seconds after its last request."""
        async with self._cond:
            m.timer = None
            if not m.loaded or m.leases:
                return
            if m.busy or time.monotonic() - m.last_used < m.keep_alive - 0.05:  # a job still closing: look again
                m.timer = asyncio.get_running_loop().call_later(0.5, lambda: asyncio.ensure_future(self._expire(m)))
                return
            rt = self._unhook(m)
        await asyncio.to_thread(self._close, rt)
        async with self._cond:
            self._cond.notify_all()

    def _unhook(self, m: Model):
        """Mark ``m`` unloaded (under the condition's lock); returns its runtime for the caller to close."""
        rt, m.rt, m.engine = m.rt, None, None
        if m.timer is not None:
            m.timer.cancel()
            m.timer = None
        return rt

    @staticmethod
    def _close(rt) -> None:
        """Free a runtime and its embedding context (blocking)."""
        from ondevice import embed

        embed.release(rt)
        rt.close()

    def close(self) -> None:
        """Shutdown: refuse new requests, cancel the running ones (each ends within one target pass)."""
        self.closing = True
        for m in self.models.values():
            if m.timer is not None:
                m.timer.cancel()
            if m.engine is not None:
                m.engine.close()

    def close_all(self) -> None:
        """After the server stopped: free every loaded model."""
        for m in self.models.values():
            if m.rt is not None:
                self._close(self._unhook(m))
