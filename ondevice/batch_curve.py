"""The batch curve of a llama.cpp model on this machine: seconds of one decode step holding k sequences' tokens
(one row each, one KV buffer per sequence, as ``--parallel`` decodes), and the number of slots it pays to run.

``parallel="auto"`` (``serve --parallel auto``) loads with ``choose_slots(curve)`` slots, from a curve measured
once per (model file, threads, device, llama.cpp build) and cached in ``$ONDEVICE_HOME/batch_costs.json`` like
``ondevice.costs`` caches the verify curve. Answers do not depend on it: every slot count is exact.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from ondevice.atomic import write_text

BATCH_KS = (1, 2, 4)  # slot counts the probe times, "auto" picks one: at most 4 (each slot holds n_ctx KV cells
# and makes every busy request's steps slower; llama-server's automatic slot count is 4 as well)
PROBE_PREFIX = 32  # tokens each sequence holds before the timed steps
MIN_GAIN = 1.15  # below this aggregate gain over one slot, auto serves one request at a time
NEAR_BEST = 0.9  # the fewest slots within this share of the best gain (more slots: more memory, slower steps)


def measure(target, ks=BATCH_KS, reps: int = 5, attempts: int = 3) -> dict[int, float]:
    """Median seconds of a decode step of k rows (k sequences, one token each), for each k in ``ks``.

    Args:
        target: a ``LlamaBackend`` with ``kv_unified=False`` and at least ``max(ks)`` sequences; every sequence is
            emptied afterwards.
        reps: timed steps per k (interleaved over the ks: a load change shifts the whole curve, not its shape).
        attempts: probes repeated while the curve is not ``plausible`` (the last one is returned either way).
    """
    n = max(ks)
    ids = [(i * 7919) % max(target.vocab_size - 1, 1) + 1 for i in range(PROBE_PREFIX + 1)]
    curve: dict[int, float] = {}
    try:
        target.clear_seqs()
        target.eval_seqs([(s, p, t) for s in range(n) for p, t in enumerate(ids[:PROBE_PREFIX])],
                         outputs=[False] * (n * PROBE_PREFIX))
        for _ in range(attempts):
            times: dict[int, list[float]] = {k: [] for k in ks}
            for rep in range(reps + 1):  # the first round warms up
                for k in ks:
                    t0 = time.perf_counter()
                    target.eval_seqs([(s, PROBE_PREFIX, ids[PROBE_PREFIX]) for s in range(k)])
                    if rep:
                        times[k].append(time.perf_counter() - t0)
                    for s in range(k):
                        target.rollback_seq(s, PROBE_PREFIX)
            curve = {k: statistics.median(v) for k, v in times.items()}
            if plausible(curve):
                break
    finally:
        target.clear_seqs()
    return curve


def plausible(curve: dict[int, float]) -> bool:
    """No step of k rows faster than 0.8 of one row or slower than 1.5·k rows (a machine busy enough to stall
    threads for whole time slices measures that; such a curve is not cached)."""
    t1 = curve.get(1)
    return bool(t1) and all(0.8 * t1 <= t <= 1.5 * k * t1 for k, t in curve.items())


def gains(curve: dict[int, float]) -> dict[int, float]:
    """Aggregate tokens/s of k busy slots ÷ one slot's: k·t(1)/t(k)."""
    return {k: k * curve[1] / t for k, t in sorted(curve.items())}


def choose_slots(curve: dict[int, float]) -> int:
    """The fewest slots whose aggregate gain is within ``NEAR_BEST`` of the best measured one; 1 when no count
    gains ``MIN_GAIN`` (then batching does not pay here, and one slot keeps speculation)."""
    g = gains(curve)
    best = max(g.values())
    if best < MIN_GAIN:
        return 1
    return min(k for k, v in g.items() if v >= NEAR_BEST * best)


def _key(path: Path, threads: int, device: str | None) -> str:
    import llama_cpp

    st = path.stat()
    return (f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}:{threads}:{device or ''}:"
            f"{llama_cpp.__version__}:{BATCH_KS}+{PROBE_PREFIX}")


def cached_curve(path: str | Path, *, threads: int | None, device: str | None, mmap: bool = True,
                 note=None) -> dict[int, float]:
    """The batch curve of the GGUF at ``path``: from ``$ONDEVICE_HOME/batch_costs.json`` or measured (a second,
    small context of the same model, closed afterwards) and stored there when ``plausible``.

    Args:
        note: called with a one-line message when a curve is measured (default: stderr).
    """
    import sys

    from ondevice.backends.llama import LlamaBackend
    from ondevice.store import catalog
    from ondevice.threads import default_threads

    path = Path(path)
    threads = int(threads or default_threads())
    file = catalog.home() / "batch_costs.json"
    key = _key(path, threads, device)
    try:
        cached = json.loads(file.read_text()).get(key)
        curve = {int(k): float(v) for k, v in cached.items()} if isinstance(cached, dict) else None
    except (OSError, ValueError, AttributeError, TypeError):
        curve = None
    if curve and plausible(curve) and set(curve) == set(BATCH_KS):
        return curve
    n = max(BATCH_KS)
    probe = LlamaBackend(path, n_ctx=128 * n, threads=threads, device=device, mmap=mmap, n_seq_max=n, kv_unified=False)
    try:
        curve = measure(probe)
    finally:
        probe.close()
    ok = plausible(curve)
    (note or (lambda m: print(f"ondevice: {m}", file=sys.stderr)))(
        f"measured the batch curve of {path.name} ({threads} thread{'s' * (threads != 1)}): gains "
        + ", ".join(f"{k}: {g:.2f}x" for k, g in gains(curve).items())
        + ("" if ok else " (the machine was too busy to measure it well: not cached)"))
    if ok:
        try:
            data = json.loads(file.read_text())
            data = data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            data = {}
        data[key] = {str(k): v for k, v in curve.items()}
        write_text(file, json.dumps(data, indent=1))
    return curve
