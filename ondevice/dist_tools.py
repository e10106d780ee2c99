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


def launch(hosts: list[str], command: list[str], *, backend: str = "ring", python: str | None = None,
           dry_run: bool = False) -> int:
    """Run ``ondevice COMMAND`` on every host through mlx.launch (ssh; the same paths on every machine).

    Args:
        hosts: host names or IPs, rank 0 first (repeat one to run two ranks on it).
        command: the ondevice subcommand and its arguments, e.g. ["generate", "MODEL", "-p", "hi"].
        backend: "ring" (TCP, any network) or "jaccl" (RDMA over Thunderbolt 5; the hostfile then also
            needs the RDMA devices that ``mlx.distributed_config`` writes).
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
    doc = hostfile(hosts, backend)
    fd, path = tempfile.mkstemp(prefix="ondevice-hosts-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(doc, f, indent=1)
    cmd = [exe, "--hostfile", path, "--backend", backend, "--", python or sys.executable, "-m", "ondevice", *command]
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
