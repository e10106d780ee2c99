"""Show an ``evaluate`` document: a rich table, a PNG plot, and the ``ondevice bench --quality`` entry point."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from ondevice.quality.tasks import CLASSES


def _cell(r: dict | None) -> str:
    if not r or not r["n"]:
        return ""
    lo, hi = r["ci95"]
    return f"{r['passed']}/{r['n']} {r['pass_rate']:.0%} [{lo:.0%}–{hi:.0%}]"


def table(doc: dict) -> None:
    """Print one row per model: pass rate per class and overall (95 % Wilson interval), speed, size, time."""
    from rich.console import Console
    from rich.table import Table

    classes = [c for c in CLASSES if any(c in m["classes"] for m in doc["models"])]
    t = Table("model", *classes, "all", "decode tok/s", "MB", "wall s", title="ondevice bench --quality "
              "(passed/n, pass rate, 95 % Wilson interval; greedy, one chat turn per task)")
    for m in doc["models"]:
        tps = m["decode_tokens_per_second"]
        t.add_row(m["model"], *(_cell(m["classes"].get(c)) for c in classes), _cell(m["overall"]),
                  "" if tps is None else f"{tps:.1f}", f"{m['size_bytes'] / 1e6:.0f}", f"{m['wall_seconds']:.0f}")
    Console(stderr=True).print(t)


def markdown(doc: dict) -> str:
    """The table as GitHub markdown (for docs): the same columns as ``table``, plus pull / load / answer seconds."""
    classes = [c for c in CLASSES if any(c in m["classes"] for m in doc["models"])]
    head = ["model", *classes, "all", "decode tok/s", "MB", "pull s", "load s", "answer s", "check s", "wall s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m in doc["models"]:
        tps = m["decode_tokens_per_second"]
        cells = [f"`{m['model']}`", *(_cell(m["classes"].get(c)) for c in classes), f"**{_cell(m['overall'])}**",
                 "" if tps is None else f"{tps:.1f}", f"{m['size_bytes'] / 1e6:.0f}",
                 *(f"{m[k]:.1f}" for k in ("pull_seconds", "load_seconds", "answer_seconds", "check_seconds",
                                           "wall_seconds"))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(doc: dict, out_dir: Path) -> Path:
    """quality_pass_rate.png: pass rate per class and model with 95 % Wilson intervals as error bars."""
    from ondevice.bench.tools import pyplot

    plt = pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    classes = [c for c in CLASSES if any(c in m["classes"] for m in doc["models"])] + ["all"]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.35 * len(classes) * len(doc["models"]) + 2), 4))
    w = 0.8 / max(len(doc["models"]), 1)
    for i, m in enumerate(doc["models"]):
        rows = [m["overall"] if c == "all" else m["classes"].get(c) for c in classes]
        ys = [r["pass_rate"] if r and r["n"] else 0.0 for r in rows]
        err = [[y - r["ci95"][0] if r else 0.0 for y, r in zip(ys, rows, strict=True)],
               [r["ci95"][1] - y if r else 0.0 for y, r in zip(ys, rows, strict=True)]]
        ax.bar([j + i * w for j in range(len(classes))], ys, w, yerr=err, capsize=2, label=m["model"])
    ax.set_xticks([j + 0.4 - w / 2 for j in range(len(classes))], classes)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("pass rate (95 % Wilson interval)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    path = out_dir / "quality_pass_rate.png"
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close("all")
    return path


def bench_quality(models: list[str], *, json_path: Path | None = None, plot_dir: Path | None = None,
                  per_class: int | None = None, classes: list[str] | None = None, threads: int | None = None,
                  echo: Callable[[str], None] = print, progress: Callable[[str], None] | None = None,
                  unsafe_no_sandbox: bool = False) -> dict:
    """``ondevice bench --quality MODEL[,MODEL…]``: evaluate, write the JSON (temp then rename) before the table
    (a display error must not lose a long run), print the table, optionally plot; without ``json_path`` the
    JSON goes to stdout via ``echo``. ``unsafe_no_sandbox``: see ``evaluate``."""
    from ondevice.atomic import write_text
    from ondevice.quality.runner import evaluate

    doc = evaluate(models, classes=classes, per_class=per_class, threads=threads, progress=progress,
                   unsafe_no_sandbox=unsafe_no_sandbox)
    if plot_dir:
        doc["plots"] = [str(plot(doc, plot_dir))]
    text = json.dumps(doc, indent=2, default=str)
    if json_path:
        write_text(json_path, text)
    table(doc)
    if not json_path:
        echo(text)
    return doc
