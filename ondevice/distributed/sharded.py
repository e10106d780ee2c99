"""A target sharded over the ranks of an ``mlx.launch`` job, driven SPMD by one speculative loop.

Every rank loads its shard of the target (mlx-lm's tensor parallelism, or its pipeline where the
architecture offers it) and a whole drafter of its own (n-gram, or a small model that fits on every
machine). Rank 0 is the only rank that reads input and writes output: each request it receives
(``stream``, ``reset``, ``close``, or a bare target ``eval``/``rollback`` made outside a request) is
announced to the other ranks, which replay it on their copies. They hold the same seed, so they
draw the same uniforms, draft the same tokens and take the same decisions; the partition only
changes where the target's matrix products run, never what the loop computes.

Before every target pass the ranks compare a fingerprint of the tokens the pass will hold (one small
collective); at the end of a request they compare the tokens emitted. Disagreement raises
``DivergenceError`` on every rank instead of letting them compute on different streams.

Ranks other than 0 never return from ``load``: they serve rank 0 until it exits.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ondevice.distributed.mlx_backend import ShardedMLXBackend
from ondevice.distributed.spmd import GuardedTarget, SyncedPolicy, _Stopped
from ondevice.distributed.world import (
    OP_DONE,
    OP_FAILED,
    OP_GO,
    OP_IDLE,
    OP_REQUEST,
    OP_STOP,
    DivergenceError,
    World,
    _die,
    fingerprint,
    world,
)
from ondevice.errors import OndeviceError
from ondevice.params import GenerateRequest
from ondevice.runtime import Runtime
from ondevice.speculative import Stats

NORMAL_ENDS = ("eos", "stop", "length", "context")


@dataclass
class DistStats(Stats):
    """``Stats`` plus the job: ``collectives`` counts the model's (estimated per forward) and ondevice's own."""

    world_size: int = 1
    shard: str = ""
    collectives: int = 0
    control_collectives: int = 0
    collectives_per_token: float = 0.0
    seconds_per_pass: float = 0.0

    def bench_fields(self) -> dict:
        """What ``ondevice bench`` adds to each run of a sharded target."""
        return {"world_size": self.world_size, "shard": self.shard, "target_forwards": self.target_forwards,
                "collectives_per_token": self.collectives_per_token, "seconds_per_pass": self.seconds_per_pass}


class DistributedRuntime(Runtime):
    """A ``Runtime`` whose target is sharded over the job; see the module docstring."""

    constraints_and_logprobs = False

    def __init__(self, target, drafter, *, vocab_limit: int, load_seconds: float = 0.0, world: World, rid: int) -> None:
        super().__init__(GuardedTarget(target, world, rid), drafter, vocab_limit=vocab_limit, load_seconds=load_seconds)
        self.world, self.rid = world, rid
        self._closed = False
        self._probe = (0, 0)

    @contextlib.contextmanager
    def _symmetric(self):
        self.target.symmetric += 1
        try:
            yield
        finally:
            self.target.symmetric -= 1

    def _request(self, msg: dict) -> None:
        if self.world.rank == 0:
            if self.world.failed:
                raise OndeviceError("the ranks diverged or lost a peer earlier; restart the job")
            self.world.send({**msg, "rid": self.rid})

    def stream(self, prompt, request: GenerateRequest | None = None, **options):
        request = GenerateRequest.resolve(request, options)
        if request.sampling.seed is None and self.world.rank == 0:  # one seed for every rank
            seed = int.from_bytes(os.urandom(4), "little")
            request = dataclasses.replace(request, sampling=dataclasses.replace(request.sampling, seed=seed))
        stream = super().stream(prompt, request)
        stream._req.stats = DistStats(world_size=self.world.size, shard=self.target.inner.shard_mode)  # before it runs
        return stream

    def _not_streaming_here(self) -> None:
        if self._owner == threading.get_ident():  # checked before the other ranks are told anything
            raise OndeviceError("this thread is still iterating a stream of this Runtime; finish, cancel or close it first")

    def reset(self) -> None:
        self._not_streaming_here()
        with self.world.lock, self._symmetric():
            self._request({"op": "reset"})
            super().reset()

    def close(self) -> None:
        if self._closed:
            return
        self._not_streaming_here()
        self.cancel()
        self._closed = True
        with self.world.lock, self._symmetric():
            if not self.world.failed:
                self._request({"op": "close"})
            super().close()

    def _costs(self, cancelled=None):
        """The probe on every rank; never cancelled half-way (every rank must run the same passes)."""
        from ondevice.costs import Costs, measure

        draft = self.draft_backend
        c0, f0 = self.world.collectives, self.target.forwards
        self.slot.kv = []  # before the probe, as Runtime._costs does: an interrupted probe leaves nothing stale
        if self.drafter is not None:
            self.drafter.reset()
        # Every rank runs the same passes: one attempt, whatever its own timings say (a retry decided by
        # one rank alone would leave the others waiting in a collective).
        local = measure(self.target, draft, reps=5, attempts=1)
        shared = self.world.share({"t": {str(k): v for k, v in local.target_seconds.items()}, "d": local.draft_seconds})
        self._probe = (self.world.collectives - c0, self.target.forwards - f0)  # left out of the request's stats
        return Costs({int(k): v for k, v in shared["t"].items()}, shared["d"])

    def _policy(self, gamma, stats, cancelled=None):
        policy = super()._policy(gamma, stats)
        return SyncedPolicy(policy, self.world) if gamma == "auto" else policy

    def _run(self, prompt, req: GenerateRequest, out):
        w, t = self.world, self.target
        if not isinstance(out.stats, DistStats):  # a replayed request (ranks > 0)
            out.stats = DistStats(world_size=w.size, shard=t.inner.shard_mode)
        stats = out.stats
        with w.lock:  # rank 0: one request at a time across all runtimes (the other ranks replay in order)
            self._request({"op": "stream", "prompt": prompt if isinstance(prompt, str) else [int(x) for x in prompt],
                           "request": req.to_dict()})
            c0, f0 = w.collectives, t.forwards
            self._probe = (0, 0)
            normal = False
            with self._symmetric():
                try:
                    yield from super()._run(prompt, req, out)
                    normal = stats.stop_reason in NORMAL_ENDS
                except _Stopped:
                    pass
                finally:
                    if not normal:
                        if self.drafter is not None:  # rank 0 stopped where the others had drafted further
                            self.drafter.reset()
                        if w.rank == 0 and not w.failed:
                            w.exchange(OP_STOP)
                if normal:
                    w.agree(fingerprint(out.tokens, stats.stop_reason), OP_DONE, "request end")
        stats.control_collectives = w.collectives - c0 - self._probe[0]
        forwards = t.forwards - f0 - self._probe[1]
        stats.collectives = stats.control_collectives + forwards * t.inner.collectives_per_forward
        stats.collectives_per_token = stats.collectives / stats.tokens if stats.tokens else 0.0
        stats.seconds_per_pass = stats.verify_seconds / stats.target_forwards if stats.target_forwards else 0.0


class LoadSync:
    """The two checkpoints of a sharded load, so that a rank that cannot load never leaves the others
    waiting in a collective: (1) before any weight moves (``ShardedMLXBackend`` calls it) and (2) after
    the drafter loaded. A rank that fails sends "failed" in place of its next checkpoint; then every
    rank raises (its own error, or which ranks failed)."""

    def __init__(self, w: World) -> None:
        self.w, self.stage, self.failed = w, 0, False

    def checkpoint(self, fp: int = 0, error: str | None = None) -> None:
        rows = self.w.exchange(OP_FAILED if error else OP_GO, fingerprint(error) if error else fp)
        self.stage += 1
        bad = [r for r in range(self.w.size) if rows[r, 0] != OP_GO]
        self.failed = bool(bad)
        if bad and error is None:
            raise OndeviceError(f"rank(s) {bad} could not load the model (see their errors above)")
        if not bad and len({(int(r[1]), int(r[2])) for r in rows}) > 1:
            self.failed = True
            raise OndeviceError("the ranks read different config.json files (or shard modes); use the same "
                                "model directory on every machine")
        if error and self.w.rank != 0 and (rows[0, 0] == OP_GO or (rows[0, 1], rows[0, 2]) != (rows[self.w.rank, 1],
                                                                                                rows[self.w.rank, 2])):
            import sys

            sys.stderr.write(f"error: rank {self.w.rank}: {error}\n")  # this machine's own problem


def _open_sharded(w: World, shard: str, sync: LoadSync, path, *, n_ctx: int, threads=None, device=None, mmap=True):
    from ondevice.backends import detect_format

    if detect_format(Path(path)) != "mlx":
        raise OndeviceError(f"{path}: a target sharded with mlx.launch must be an MLX model directory; "
                            "convert it with `ondevice convert --to mlx`")
    return ShardedMLXBackend(path, world=w, mode=shard, n_ctx=n_ctx, device=device, checkpoint=sync.checkpoint)


def _load_here(w: World, rid: int, args: dict, build) -> DistributedRuntime:
    """Every rank: load the same runtime with ``build`` (``ondevice.loader.build``); a load error on any rank is
    raised on every rank."""
    sync = LoadSync(w)
    try:
        rt = build(**args["kw"], open_target=functools.partial(_open_sharded, w, args["shard"], sync),
                           runtime_class=functools.partial(DistributedRuntime, world=w, rid=rid))
    except OndeviceError as e:
        if not sync.failed:  # this rank failed first: tell the others at the checkpoint they are waiting in
            sync.checkpoint(error=str(e))
        raise
    try:
        sync.checkpoint()
    except OndeviceError:
        with rt._symmetric():
            rt._closed = True
            Runtime.close(rt)
        raise
    return rt


_NEXT_RID = [0]


def load(model, draft=None, *, build, **kw) -> DistributedRuntime:
    """``ondevice.load`` in an mlx.launch job: rank 0 returns the runtime; the other ranks serve it and
    end the process when rank 0 exits (they never return). ``build`` builds a runtime around a target opener
    (``ondevice.loader.build``)."""
    w = world()
    if w.rank != 0:
        serve(w, build)
    if str(draft) == "auto":
        raise OndeviceError("draft='auto' chooses by timing, which differs between machines; name the draft model "
                            "(or use --ngram) when the target is sharded")
    _NEXT_RID[0] += 1
    args = {"kw": {"model": str(model), "draft": None if draft is None else str(draft), **kw},
            "shard": os.environ.get("ONDEVICE_SHARD", "auto")}
    with w.lock:
        w.send({"op": "load", "rid": _NEXT_RID[0], "args": args})
        return _load_here(w, _NEXT_RID[0], args, build)


def serve(w: World, build) -> None:
    """Ranks > 0: replay rank 0's requests until it exits (the heartbeat then ends this process)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C in a terminal reaches every rank: rank 0 decides
    runtimes: dict[int, DistributedRuntime] = {}
    while True:
        try:
            rows = w.agree(0, OP_IDLE, "request start")
        except DivergenceError:
            _wait_for_exit(w)
        if rows[0, 0] == OP_STOP:  # rank 0 ended a request this rank had already finished
            continue
        if rows[0, 0] != OP_REQUEST:
            w.failed = True
            _wait_for_exit(w)
        msg = w.payload(nbytes=int(rows[0, 3]))
        try:
            _dispatch(w, runtimes, msg, build)
        except DivergenceError:
            _wait_for_exit(w)
        except OndeviceError:  # rank 0 raised it too (a load checkpoint printed this rank's own problems)
            pass
        except Exception as e:  # noqa: BLE001 - anything else is this rank's own failure: end it visibly
            _die(f"rank {w.rank}: {type(e).__name__}: {e}", 1)


def _dispatch(w: World, runtimes: dict, msg: dict, build) -> None:
    op, rid = msg["op"], msg["rid"]
    if op == "load":
        runtimes[rid] = _load_here(w, rid, msg["args"], build)
        return
    rt = runtimes[rid]
    if op == "stream":
        for _ in Runtime.stream(rt, msg["prompt"], GenerateRequest.of(**msg["request"])):
            pass
    elif op == "reset":
        rt.reset()
    elif op == "close":
        rt.close()
        del runtimes[rid]
    elif op == "eval":
        rt.target.eval(msg["tokens"], msg["logits"])
    elif op == "rollback":
        rt.target.rollback(msg["n"])


def _wait_for_exit(w: World) -> None:
    """After a divergence: do nothing more until rank 0 exits (its error is the one the user sees)."""
    w.failed = True
    while True:
        time.sleep(3600)
