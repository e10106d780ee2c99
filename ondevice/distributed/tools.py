"""Around a sharded job: ``ondevice launch`` (a thin wrapper over ``mlx.launch``) and link-latency predictions."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from ondevice.errors import OndeviceError

BACKENDS = ("ring", "jaccl")


def hostfile(hosts: list[str], backend: str = "ring") -> dict:
    """mlx.launch's hostfile for ``hosts`` (names resolved to the IPs the ring backend needs)."""
    if backend not in BACKENDS:
        raise OndeviceError(f"--backend {backend}: choose one of {', '.join(BACKENDS)}")
    if len(hosts) < 2:
        raise OndeviceError("--hosts needs at least two hosts, e.g. --hosts mac1.local,mac2.local")
    out = []
    for h in hosts:
        try:
            ip = socket.gethostbyname(h)
        except OSError as e:
            raise OndeviceError(f"--hosts: cannot resolve {h!r} ({e}); give its IP address instead") from e
        out.append({"ssh": h, "ips": [ip]})
    return {"backend": backend, "hosts": out}


def launch(hosts: list[str] | None, command: list[str], *, backend: str = "ring", hostfile_path: str | Path | None = None,
           python: str | None = None, dry_run: bool = False) -> int:
    """Run ``ondevice COMMAND`` on every host through mlx.launch (ssh; the same paths on every machine).

    Args:
        hosts: host names or IPs, rank 0 first (repeat one to run two ranks on it).
        command: the ondevice subcommand and its arguments, e.g. ["generate", "MODEL", "-p", "hi"].
        backend: "ring" (TCP, any network) or "jaccl" (RDMA over Thunderbolt 5: its hostfile also names
            each link's RDMA device, so pass the one ``mlx.distributed_config`` writes as ``hostfile_path``).
        hostfile_path: an mlx.launch hostfile to use instead of ``hosts``.
        python: interpreter on the remote hosts (default: this one's path).
        dry_run: print the hostfile and the mlx.launch command instead of running them.
    Returns:
        mlx.launch's exit status.
    """
    if not command:
        raise OndeviceError("ondevice launch needs a command after --, e.g. -- generate MODEL -p 'hi'")
    if command[0] == "ondevice":
        command = command[1:]
    exe = shutil.which("mlx.launch")
    if exe is None:
        raise OndeviceError("mlx.launch was not found; pip install 'ondevice[mlx]' on every host")
    if (hosts is None) == (hostfile_path is None):
        raise OndeviceError("give either --hosts or --hostfile")
    if hostfile_path is not None:
        if not Path(hostfile_path).is_file():
            raise OndeviceError(f"--hostfile {hostfile_path}: no such file")
        doc = json.loads(Path(hostfile_path).read_text())
    elif backend == "jaccl":
        raise OndeviceError("--backend jaccl needs each Thunderbolt link's RDMA device: write a hostfile with "
                            "`mlx.distributed_config --backend jaccl --over thunderbolt --hosts ...` and pass --hostfile")
    else:
        doc = hostfile(hosts, backend)
    fd, path = tempfile.mkstemp(prefix="ondevice-hosts-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(doc, f, indent=1)
    cmd = [exe, "--hostfile", path, "--backend", backend, "--", python or sys.executable, "-P", "-m", "ondevice", *command]
    try:
        if dry_run:
            print(json.dumps(doc, indent=1))
            print(shlex.join(cmd))
            return 0
        return subprocess.call(cmd)
    finally:
        Path(path).unlink(missing_ok=True)


def predict_link(costs: dict, *, latency_ms: float, world_size: int, n_layers: int, shard: str = "tensor",
                 alphas=(0.5, 0.7, 0.8, 0.9), gammas=range(1, 9), guard: int = 1) -> dict:
    """Predicted tok/s of plain and speculative decoding when the target is sharded over ``world_size``
    machines joined by a link of ``latency_ms`` per collective (a PREDICTION, not a measurement).

    Model: a pass over k tokens costs ``target_seconds(k) / world_size`` of compute (tensor parallel
    splits the matrix products; a pipeline runs its stages one after another, so no division) plus one
    latency per collective: 2 per layer for tensor parallelism, ``world_size`` for a pipeline, plus
    ``guard`` for the divergence check. γ drafts cost ``γ·draft_seconds`` on every rank at once, and
    a pass emits (1 − α^(γ+1)) / (1 − α) tokens.

    Args:
        costs: ``Costs.to_json()`` of the target (and draft) measured on one machine.
    """
    from ondevice.costs import Costs

    c = Costs({int(k): v for k, v in costs["target_seconds"].items()}, costs.get("draft_seconds", 0.0))
    lat = latency_ms / 1000.0
    per_pass = 2 * n_layers if shard == "tensor" else world_size
    split = world_size if shard == "tensor" else 1

    def pass_s(k: int) -> float:
        return c.target_seconds[1] * c.verify_cost(k) / split + (per_pass + guard) * lat

    plain = 1.0 / pass_s(1)
    rows = []
    for a in alphas:
        best = max(((g, (1 - a ** (g + 1)) / (1 - a) / (g * c.draft_seconds + pass_s(g + 1))) for g in gammas),
                   key=lambda x: x[1])
        rows.append({"alpha": a, "best_gamma": best[0], "predicted_tokens_per_second": best[1],
                     "predicted_speedup": best[1] / plain})
    return {"latency_ms": latency_ms, "world_size": world_size, "shard": shard, "collectives_per_pass": per_pass + guard,
            "predicted_plain_tokens_per_second": plain, "by_alpha": rows,
            "note": "predictions from one machine's measured costs and an assumed link latency, not measurements"}


def drafter_placement(draft_path: str | Path, *, vocab_sizes=(512, 151936), gamma: int = 4, reps: int = 20) -> dict:
    """Time the two places a model drafter can run in a job (call on every rank under mlx.launch).

    "each rank": every rank drafts γ tokens itself (what ondevice does): the cost is the local draft time,
    paid in parallel, and nothing crosses the link. "rank 0 + broadcast": rank 0 drafts and sends its γ
    tokens and γ q rows (γ × vocab float32) to the others: the same draft time plus one broadcast.

    Returns:
        medians in seconds: local draft time, and the broadcast time for each vocabulary size.
    """
    import statistics
    import time

    import mlx.core as mx
    import numpy as np

    from ondevice.backends.mlx import MLXBackend
    from ondevice.distributed.world import world
    from ondevice.drafters import ModelDrafter
    from ondevice.sampling import SamplingParams

    w = world()
    b = MLXBackend(draft_path, n_ctx=512, device="cpu")
    d = ModelDrafter(b, b.vocab_size, b.vocab_size)
    ctx = b.tokenize("The model draft and the target verify the tokens")
    params, rng = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0), np.random.default_rng(0)
    local = []
    for _ in range(reps):
        t0 = time.perf_counter()
        d.propose(ctx, gamma, params, rng)
        local.append(time.perf_counter() - t0)
        d.reset()
    b.close()
    bcast = {}
    for V in vocab_sizes:
        rows = np.full((gamma, V), 1.0 / V, dtype=np.float32) if w.rank == 0 else np.zeros((gamma, V), np.float32)
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            mx.eval(mx.distributed.all_sum(mx.array(rows), group=w.group, stream=mx.cpu))
            ts.append(time.perf_counter() - t0)
        bcast[str(V)] = statistics.median(ts)
    return {"gamma": gamma, "local_draft_seconds": statistics.median(local), "broadcast_q_seconds_by_vocab": bcast,
            "world_size": w.size, "choice": "each rank (no traffic; the broadcast only adds time)"}


def bench_summary(doc: dict, show: bool = True) -> dict:
    """Per mode of a sharded ``ondevice bench`` run: median tok/s, target passes per token, collectives per
    token and seconds per pass (printed to stderr as a table when ``show``)."""
    import statistics

    by_mode: dict[str, list[dict]] = {}
    for r in doc["runs"]:
        if "collectives_per_token" in r:
            by_mode.setdefault(r["mode"], []).append(r)
    out = {}
    for mode, rs in by_mode.items():
        tokens = sum(r["tokens"] for r in rs) or 1
        out[mode] = {"world_size": rs[0]["world_size"], "shard": rs[0]["shard"],
                     "tokens_per_second": statistics.median(r["tokens_per_second"] for r in rs),
                     "target_passes_per_token": sum(r["target_forwards"] for r in rs) / tokens,
                     "collectives_per_token": statistics.median(r["collectives_per_token"] for r in rs),
                     "seconds_per_pass": statistics.median(r["seconds_per_pass"] for r in rs)}
    if show and out:
        from rich.console import Console
        from rich.table import Table

        t = Table("mode", "ranks", "tok/s", "passes/token", "collectives/token", "s/pass", title="sharded target")
        for mode, s in out.items():
            t.add_row(mode, f"{s['world_size']} ({s['shard']})", f"{s['tokens_per_second']:.1f}",
                      f"{s['target_passes_per_token']:.2f}", f"{s['collectives_per_token']:.2f}", f"{s['seconds_per_pass']:.4f}")
        Console(stderr=True).print(t)
    return out
