"""What every rank wraps around the loop's target and policy so the ranks compute the same thing: the target
checks before each pass that all ranks agree on its tokens (and replays rank 0's calls made outside a request);
the policy carries rank 0's γ and timings to the others in one collective per step."""

from __future__ import annotations

import math

import numpy as np

from ondevice.backends.mlx import PREFILL_CHUNK
from ondevice.distributed.mlx_backend import ShardedMLXBackend
from ondevice.distributed.world import OP_GO, OP_POLICY, OP_STOP, DivergenceError, World, fingerprint
from ondevice.policy import Policy


class _Stopped(Exception):
    """Rank 0 ended the request early (cancel or close); this rank stops with it."""


class GuardedTarget:
    """The sharded backend as the loop sees it: every pass first checks that all ranks agree on its
    tokens; on rank 0, calls made outside a request are replayed on the other ranks."""

    def __init__(self, inner: ShardedMLXBackend, world: World, rid: int) -> None:
        self.inner, self.world, self.rid = inner, world, rid
        self.held: list[int] = []  # the ids the cache holds
        self.symmetric = 0 if world.rank == 0 else 1  # >0: every rank is making this same call
        self.passes = 0
        self.forwards = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    @property
    def n_past(self) -> int:
        return self.inner.n_past

    def eval(self, tokens, logits="all"):
        tokens = [int(t) for t in tokens]
        if not self.symmetric:
            with self.world.lock:
                self.world.send({"op": "eval", "rid": self.rid, "tokens": tokens, "logits": logits})
                self.symmetric += 1
                try:
                    return self.eval(tokens, logits)
                finally:
                    self.symmetric -= 1
        rows = self.world.agree(fingerprint(self.held, tokens), OP_GO, "target pass")
        if rows[0, 0] == OP_STOP:
            raise _Stopped
        if rows[0, 0] != OP_GO:
            self.world.failed = True
            raise DivergenceError(f"rank {self.world.rank}: expected a target pass, rank 0 sent op {rows[0, 0]}")
        out = self.inner.eval(tokens, logits)
        self.held = self.held + tokens
        self.passes += 1
        n = len(tokens)
        self.forwards += (math.ceil((n - 1) / PREFILL_CHUNK) + 1) if logits == "last" and n > 1 else math.ceil(n / PREFILL_CHUNK)
        return out

    def rollback(self, n_past: int) -> None:
        if not self.symmetric:
            with self.world.lock:
                self.world.send({"op": "rollback", "rid": self.rid, "n": int(n_past)})
                self.inner.rollback(n_past)
        else:
            self.inner.rollback(n_past)
        self.held = self.held[:n_past]

    def close(self) -> None:
        self.inner.close()


def _f32(x: float) -> int:
    return int(np.float32(x).view(np.uint32))


class SyncedPolicy(Policy):
    """Rank 0's adaptive policy on every rank: one collective per step carries its γ and its last step's
    timings (the policy's only rank-dependent input), so every rank's policy state stays identical."""

    def __init__(self, inner: Policy, world: World) -> None:
        self.inner, self.world = inner, world
        self._pending: tuple[int, float, float, bool] | None = None

    def keep_drafting(self, confidences: list[float]) -> bool:
        return self.inner.keep_drafting(confidences)  # the draft's own probabilities: the same on every rank

    @property
    def max_gamma(self) -> int:
        return self.inner.max_gamma

    def observe_step(self, drafted: int, verify_seconds: float, draft_seconds: float, copied: bool = False) -> None:
        # applied before the next decision; ``copied`` is the same on every rank (same drafts, same decisions)
        self._pending = (drafted, verify_seconds, draft_seconds, copied)

    def next_gamma(self, hint: int = 0, lag: int = 0) -> int:
        w, obs = self.world, self._pending
        self._pending = None
        if w.rank == 0:
            if obs is not None:  # rounded to float32 here too: that is what the other ranks receive
                self.inner.observe_step(obs[0], float(np.float32(obs[1])), float(np.float32(obs[2])), obs[3])
            g = self.inner.next_gamma(hint, lag)
            rows = w.exchange(OP_POLICY, 0, g, _f32(obs[1]) if obs else 0, _f32(obs[2]) if obs else 0)
            if (rows[:, 0] != OP_POLICY).any():
                w.failed = True
                raise DivergenceError("ranks diverged: some rank was not choosing the next draft length with rank 0")
            return g
        rows = w.exchange(OP_POLICY)
        if rows[0, 0] != OP_POLICY:
            if rows[0, 0] == OP_STOP:
                raise _Stopped
            w.failed = True
            raise DivergenceError(f"rank {w.rank}: expected rank 0's draft length, got op {rows[0, 0]}")
        if obs is not None:
            root = rows[0, 4:6].view(np.float32).astype(float)
            self.inner.observe_step(obs[0], float(root[0]), float(root[1]), obs[3])
        self.inner.next_gamma(hint, lag)  # keeps the policy's own counters in step
        return int(rows[0, 3])

    def update(self, drafted: int, accepted: int, hint: int = 0, proposal=None, emitted=None) -> None:
        # the whole guess and the emitted tokens are the same on every rank (same drafts, same decisions)
        self.inner.update(drafted, accepted, hint, proposal, emitted)

    def restart(self) -> None:
        self.inner.restart()
