"""Measured costs of a backend pair: draft cost ratio c and the verify curve cost(k)/cost(1).

Used by the benchmark (bounds, predictions) and by the adaptive γ policy. Pure timing of the
backends' own ``eval``; no sampling involved.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ondevice.atomic import write_text
from ondevice.backends.base import Backend
from ondevice.errors import OndeviceError

PROBE_KS = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 33)  # verify batch sizes the probe times (33: n-gram γ = 32)
PROBE_CONTEXT = 64  # prefix tokens before the timed batches


@dataclass
class Costs:
    """Seconds of one target pass over k tokens, and of one draft token.

    Attributes:
        target_seconds: {k: median seconds of target.eval of k tokens}.
        draft_seconds: median seconds of one draft token (0 for n-gram drafts).
    """

    target_seconds: dict[int, float] = field(default_factory=dict)
    draft_seconds: float = 0.0

    @property
    def draft_cost_ratio(self) -> float:
        """c = draft token time ÷ one target decode."""
        return self.draft_seconds / self.target_seconds[1] if self.target_seconds.get(1) else 0.0

    def _curve(self) -> dict[int, float]:
        """The measured times made monotone (a larger batch never costs less; noise can say otherwise)
        and capped at k single decodes.

        Monotone from above: each k takes the least time seen for any batch of k or more. Timing noise on
        a busy machine only ever adds time, so the smaller reading is the truer one; raising later points
        to an inflated earlier one instead would let one slow plain step make every batch look free (and
        a policy that then always drafts would never time a plain step again to correct it).
        """
        ks = sorted(self.target_seconds)
        low, env = float("inf"), {}
        for k in reversed(ks):
            low = min(low, self.target_seconds[k])
            env[k] = low
        t1 = env[ks[0]]
        return {k: min(env[k], k * t1) for k in ks}

    def verify_cost(self, k: int) -> float:
        """cost(k)/cost(1), interpolated linearly between measured k (past the last one: see ``verify_costs``)."""
        return self.verify_costs(k)[k - 1]

    def verify_costs(self, n: int) -> list[float]:
        """[cost(1), …, cost(n)] relative to cost(1), from one pass over the curve (the policy's hot path)."""
        curve = self._curve()
        ks = sorted(curve)
        t1 = curve[1]
        out = []
        j = 0
        for k in range(1, n + 1):
            while j + 1 < len(ks) and ks[j + 1] <= k:
                j += 1
            lo = ks[j]
            if k == lo:
                out.append(curve[lo] / t1)
            elif j + 1 < len(ks):
                hi = ks[j + 1]
                w = (k - lo) / (hi - lo)
                out.append(((1 - w) * curve[lo] + w * curve[hi]) / t1)
            else:  # past the last measured k: at least that point's cost per token (a locally flat stretch
                # of the curve must not make every longer batch look free)
                a, b = ks[-2], ks[-1]
                out.append(max(curve[b] + (curve[b] - curve[a]) / (b - a) * (k - b), curve[b] * k / b) / t1)
        return out

    def observe(self, k: int, seconds: float, draft_seconds_per_token: float | None = None, weight: float = 0.05) -> None:
        """Fold one real step's timing into the curve (online refinement of the load-time probe).

        A reading is clipped at twice the current value: a step the OS preempted is not a slower machine,
        and one such step must not move the curve far (a changing load still does, step by step).
        """
        old = self.target_seconds.get(k)
        self.target_seconds[k] = seconds if old is None else old + weight * (min(seconds, 2 * old) - old)
        if draft_seconds_per_token is not None:
            self.draft_seconds += weight * (draft_seconds_per_token - self.draft_seconds)

    def to_json(self) -> dict:
        return {"draft_cost_ratio": self.draft_cost_ratio,
                "verify_cost": {str(k): self.verify_cost(k) for k in sorted(self.target_seconds)},
                **{k: v for k, v in asdict(self).items() if k != "target_seconds"},
                "target_seconds": {str(k): v for k, v in self.target_seconds.items()}}


def _time_eval(b: Backend, context: list[int], tokens: list[int], reps: int) -> float:
    """Median seconds of ``b.eval(tokens)`` after ``context[:b.n_past]``, the cache put back after each pass."""
    import statistics  # lazily: decimal and fractions come with it, and a cold start needs neither
    base = b.n_past
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        b.eval(tokens)
        ts.append(time.perf_counter() - t0)
        try:
            b.rollback(base)
        except OndeviceError:  # a recurrent state (qwen35) rolls back only into its last pass, not to its start:
            b.rollback(0)  # the prefix is evaluated again, untimed
            if base:
                b.eval(context[:base], logits="last")
    return statistics.median(ts)


def probe_shape(target: Backend, draft: Backend | None = None, ks=PROBE_KS, context_tokens: int = PROBE_CONTEXT):
    """The probe's batch sizes and prefix length, shrunk to fit the smaller of the two contexts.

    Returns:
        (ks, context_tokens): every k fits after the prefix; k = 1 and 2 are always measured (the
        policy extrapolates the curve from its last two points).
    """
    room = min(target.n_ctx, draft.n_ctx) if draft is not None else target.n_ctx
    ks = [k for k in ks if 2 * k <= room]
    ks = ks if len(ks) >= 2 else [1, 2]
    return ks, max(0, min(context_tokens, room - max(ks)))


def plausible(target_seconds: dict[int, float], width: int = 1) -> bool:
    """Could a machine have produced these times? No batch of k tokens faster than 0.8 of one decode or
    slower than 1.5·max(k, ``width``) decodes. A probe on a machine busy enough to stall threads for whole
    time slices says otherwise (seen: a 2-token batch at 1/15 of the time of one token), and a policy
    trusting it would think drafts free or ruinous.

    Args:
        width: tokens a multi-token batch may really compute (``batch_width``): a fixed-shape model
            pads a 4-token batch to its prefill chunk, so that batch honestly costs up to ``chunk`` decodes.
    """
    t1 = target_seconds.get(1)
    return bool(t1) and all(0.8 * t1 <= t <= 1.5 * max(k, width) * t1 for k, t in target_seconds.items())


def batch_width(target: Backend) -> int:
    """The prefill chunk of a fixed-shape backend (Core ML, MIL: ``StaticCacheBackend``), else 1."""
    return max(1, int(target.chunk))


class ProbeCancelled(Exception):
    """The probe was cancelled (``measure``'s ``cancelled`` returned True); nothing was measured or cached."""


def measure(target: Backend, draft: Backend | None = None, *, ks=PROBE_KS, reps: int = 5,
            context_tokens: int = PROBE_CONTEXT, attempts: int = 3, cancelled=None) -> Costs:
    """Time the target on k-token batches after a ``context_tokens`` prefix (and one draft token).

    The probe is sized to the contexts (``probe_shape``) and repeated (up to ``attempts`` times) while its
    curve is not ``plausible``; the last attempt is returned either way. Both caches are left empty whatever
    happens, an error or Ctrl-C included (callers forget their bookkeeping before calling, e.g. ``Runtime``).
    ``cancelled`` (a callable) is asked between timed passes: when it returns True the probe stops with
    ``ProbeCancelled`` (a request cancelled by a shutdown does not wait for a probe of seconds).
    """
    import statistics  # lazily: a cold start needs neither decimal nor fractions

    ks, context_tokens = probe_shape(target, draft, ks, context_tokens)
    ids = [(i * 7919) % max(target.vocab_size - 1, 1) + 1 for i in range(context_tokens + max(ks))]
    c = Costs()
    try:
        target.rollback(0)
        if context_tokens:
            target.eval(ids[:context_tokens], logits="last")
        _time_eval(target, ids, ids[context_tokens : context_tokens + 1], 1)  # warm-up
        for _ in range(attempts):
            # Interleaved (each rep times every k in turn): a machine whose load changes during the probe
            # then shifts the whole curve, not its shape.
            times: dict[int, list[float]] = {k: [] for k in ks}
            for _ in range(reps):
                if cancelled is not None and cancelled():
                    raise ProbeCancelled
                for k in ks:
                    times[k].append(_time_eval(target, ids, ids[context_tokens : context_tokens + k], 1))
            c.target_seconds = {k: statistics.median(v) for k, v in times.items()}
            if plausible(c.target_seconds, batch_width(target)):
                break  # else the machine was too busy to measure anything: try again
        target.rollback(0)
        if draft is not None:
            draft.rollback(0)
            if context_tokens:
                draft.eval(ids[:context_tokens], logits="last")
            _time_eval(draft, ids, ids[context_tokens : context_tokens + 1], 1)
            c.draft_seconds = _time_eval(draft, ids, ids[context_tokens : context_tokens + 1], reps)
    finally:
        target.rollback(0)
        if draft is not None:
            draft.rollback(0)
    return c


def speedup_bound(alpha: float, gamma: int, c: float, verify_cost: float) -> float:
    """Expected speedup of γ-draft speculation over plain decoding (Leviathan et al., with verify cost):

        E[tokens per pass] = (1 − α^(γ+1)) / (1 − α);   cost per pass = γ·c + cost(γ+1)/cost(1)
    """
    if gamma == 0:
        return 1.0
    tokens = gamma + 1 if alpha >= 1.0 else (1 - alpha ** (gamma + 1)) / (1 - alpha)
    return tokens / (gamma * c + verify_cost)


def _key(b: Backend) -> str:
    """Model file (path, size, mtime), backend, threads, the device it really runs on and its kernels."""
    p = Path(b.path)
    st = p.stat() if p.is_file() else (p / "config.json").stat()
    return (f"{type(b).__name__}:{p.resolve()}:{st.st_size}:{st.st_mtime_ns}:{b.threads or ''}:{b.device or ''}"
            + (f":{b.kernels}" if b.kernels else ""))


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def cached_measure(target: Backend, draft: Backend | None = None, cancelled=None, attempts: int = 3) -> Costs:
    """``measure``, cached in ``$ONDEVICE_HOME/costs.json`` per (model files, threads, device, probe shape);
    an implausible curve (a probe on a swamped machine) is neither cached nor read back. ``attempts``: probes
    at most while the curve is implausible (``measure``; 1: one probe whatever the load)."""
    from ondevice.store import catalog

    ks, ctx = probe_shape(target, draft)
    key = _key(target) + ("|" + _key(draft) if draft is not None else "") + f"|probe {ctx}+{max(ks)}"
    path = catalog.home() / "costs.json"
    e = _read(path).get(key)
    if e is not None:
        cached = Costs({int(k): v for k, v in e["target_seconds"].items()}, e["draft_seconds"])
        if plausible(cached.target_seconds, batch_width(target)):
            return cached
    c = measure(target, draft, reps=7, cancelled=cancelled, attempts=attempts)
    if not plausible(c.target_seconds, batch_width(target)):
        return c  # used for this process only (the policy refines it step by step); never cached
    cache = _read(path)  # re-read: another process may have added entries meanwhile
    cache[key] = {"target_seconds": {str(k): v for k, v in c.target_seconds.items()}, "draft_seconds": c.draft_seconds}
    write_text(path, json.dumps(cache, indent=1))
    return c
