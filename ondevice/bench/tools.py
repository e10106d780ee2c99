"""Benchmark extras: cold start, synthetic shape-true models, plots and the terminal table."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from ondevice.errors import OndeviceError
from ondevice.threads import default_threads

_COLD = r"""
import sys, time, json
t0 = time.perf_counter()
kind, path, mmap, threads = sys.argv[1], sys.argv[2], sys.argv[3] == "1", int(sys.argv[4])
if kind == "ondevice":
    import ondevice
    t_imp = time.perf_counter()
    rt = ondevice.load(path, drafter="none", n_ctx=512, mmap=mmap, threads=threads)
    t_load = time.perf_counter()
    next(iter(rt.stream("Hello", max_tokens=1, temperature=0)))
else:
    import llama_cpp
    t_imp = time.perf_counter()
    from ondevice.backends.llama_ext import guard_amx
    guard_amx()  # else AMX machines crash (llama_ext.amx_off); its import is ondevice's, not the anchor's: left out
    t0 += time.perf_counter() - t_imp
    t_imp = time.perf_counter()
    llm = llama_cpp.Llama(path, n_ctx=512, use_mmap=mmap, n_threads=threads, n_threads_batch=threads, verbose=False)
    t_load = time.perf_counter()
    llm.create_completion("Hello", max_tokens=1, temperature=0)
t_end = time.perf_counter()
print(json.dumps({"import": t_imp - t0, "load": t_load - t_imp, "first_token": t_end - t_load, "in_process": t_end - t0}))
"""


def evict(path: Path) -> str:
    """Drop ``path`` from the page cache (Linux: posix_fadvise DONTNEED); returns the method used."""
    if not hasattr(os, "posix_fadvise"):
        return "none (warm only: no posix_fadvise on this OS)"
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return "posix_fadvise(POSIX_FADV_DONTNEED)"


def cold_start(model_path: Path, repeats: int = 5, threads: int | None = None) -> dict:
    """Fresh process → first token, cold (evicted) and warm, mmap on/off, ours and raw llama-cpp-python.

    Both runners get the same context (512) and the same threads (default: ``ondevice.threads.default_threads``), interleaved.
    ``summary["ratio/…"]`` is ondevice ÷ raw for each condition (the target is ≤ 1.15).
    """
    rows = []
    method = None
    threads = threads or default_threads()
    for rep in range(repeats):
        for kind in ("ondevice", "llama_cpp"):
            for mmap in (True, False):
                for state in ("cold", "warm"):
                    if state == "cold":
                        method = evict(model_path)
                    t0 = time.perf_counter()
                    r = subprocess.run([sys.executable, "-P", "-c", _COLD, kind, str(model_path), "1" if mmap else "0",
                                        str(threads)], capture_output=True, text=True, timeout=600)
                    wall = time.perf_counter() - t0
                    if r.returncode != 0:
                        raise OndeviceError(f"cold-start run failed: {r.stderr.strip().splitlines()[-1:]}")
                    rows.append({"runner": kind, "mmap": mmap, "cache": state, "repeat": rep, "process_to_first_token": wall,
                                 **json.loads(r.stdout.strip().splitlines()[-1])})
    imp = [_import_time() for _ in range(repeats)]
    summary = {}
    for kind in ("ondevice", "llama_cpp"):
        for mmap in (True, False):
            for state in ("cold", "warm"):
                vals = [r["process_to_first_token"] for r in rows if (r["runner"], r["mmap"], r["cache"]) == (kind, mmap, state)]
                summary[f"{kind}/{'mmap' if mmap else 'no-mmap'}/{state}"] = statistics.median(vals)
    for key in [k for k in summary if k.startswith("ondevice/")]:
        raw = summary["llama_cpp/" + key.split("/", 1)[1]]
        summary["ratio/" + key.split("/", 1)[1]] = summary[key] / raw if raw else None
    return {"eviction": method, "threads": threads, "import_ondevice_seconds": statistics.median(imp), "runs": rows,
            "summary": summary}


def _import_time() -> float:
    code = "import time; t = time.perf_counter(); import ondevice; print(time.perf_counter() - t)"
    return float(subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, check=True).stdout)


def table(doc: dict) -> None:
    """Print the summary as a rich table."""
    from rich.console import Console
    from rich.table import Table

    t = Table("class", "mode", "tok/s (median)", "min–max", "× plain", "decode × plain", "oracle", "bound", "acceptance",
              "τ", "plain passes", title="ondevice bench")
    for r in doc["summary"]:
        f = lambda x, fmt: "" if x is None else format(x, fmt)  # noqa: E731
        t.add_row(r["class"], r["mode"], f(r["median_tokens_per_second"], ".1f"),
                  f"{r['min_tokens_per_second']:.1f}–{r['max_tokens_per_second']:.1f}", f(r["speedup_vs_plain"], ".2f"),
                  f(r.get("decode_speedup_vs_plain"), ".2f"), f(r.get("oracle_speedup"), ".2f"), f(r["bound"], ".2f"),
                  f(r["acceptance_rate"], ".0%"), f(r.get("tau"), ".2f"), f(r.get("plain_steps_share"), ".0%"))
    Console(stderr=True).print(t)


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend, or a one-line error naming the extra to install."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise OndeviceError("--plot needs matplotlib: pip install 'ondevice[plot]'") from e
    return plt


def plots(doc: dict, out_dir: Path) -> list[Path]:
    """PNG plots: tok/s by mode and class, acceptance vs γ, realized speedup vs bound."""
    plt = pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    s = doc["summary"]
    classes = list(dict.fromkeys(r["class"] for r in s))
    modes = list(dict.fromkeys(r["mode"] for r in s))
    files = []
    fig, ax = plt.subplots(figsize=(9, 4))
    w = 0.8 / max(len(modes), 1)
    for i, m in enumerate(modes):
        ys = [next((r["median_tokens_per_second"] for r in s if r["mode"] == m and r["class"] == c), 0) for c in classes]
        ax.bar([j + i * w for j in range(len(classes))], ys, w, label=m)
    ax.set_xticks([j + 0.4 - w / 2 for j in range(len(classes))], classes)
    ax.set_ylabel("tokens/s (median)")
    ax.legend(fontsize=7)
    files.append(out_dir / "tokens_per_second.png")
    fig.savefig(files[-1], dpi=120, bbox_inches="tight")
    fig, ax = plt.subplots(figsize=(6, 4))
    for c in classes:
        pts = sorted((r["gamma"], r["acceptance_rate"]) for r in doc["runs"]
                     if r["class"] == c and isinstance(r.get("gamma"), int) and r["gamma"] > 0 and r["acceptance_rate"] is not None)
        if pts:
            gs = sorted({g for g, _ in pts})
            ax.plot(gs, [statistics.fmean(a for g2, a in pts if g2 == g) for g in gs], marker="o", label=c)
    ax.set_xlabel("γ")
    ax.set_ylabel("acceptance rate")
    ax.legend()
    files.append(out_dir / "acceptance_vs_gamma.png")
    fig.savefig(files[-1], dpi=120, bbox_inches="tight")
    fig, ax = plt.subplots(figsize=(5, 5))
    pts = [(r["bound"], r["speedup_vs_plain"], r["mode"]) for r in s if r["bound"] is not None and r["speedup_vs_plain"]]
    for b, real, m in pts:
        ax.scatter(b, real)
        ax.annotate(m, (b, real), fontsize=6)
    lim = max([1.2] + [max(b, r) for b, r, _ in pts])
    ax.plot([0, lim], [0, lim], "k--", lw=0.8)
    ax.set_xlabel("bound from measured α, c, cost(k)")
    ax.set_ylabel("realized speedup vs plain")
    files.append(out_dir / "realized_vs_bound.png")
    fig.savefig(files[-1], dpi=120, bbox_inches="tight")
    plt.close("all")
    return files


def emit_json(doc: dict, path: str | Path | None = None, indent: int = 2) -> None:
    """A benchmark's JSON document: printed, and written (atomically) to ``path`` when one is given."""
    text = json.dumps(doc, indent=indent, default=str)
    print(text)
    if path:
        from ondevice.atomic import write_text

        write_text(Path(path), text + "\n")
