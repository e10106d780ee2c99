"""``evaluate(models)``: every model answers every task greedily, side by side; pass rates with Wilson intervals."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from ondevice.quality.tasks import CLASSES, Task, check, select

Z95 = 1.959963984540054  # two-sided 95 % normal quantile


def wilson(passed: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval for a pass rate of ``passed`` / ``n`` (95 % by default); (0, 1) when n is 0.

    Unlike the normal approximation it stays inside [0, 1] and is honest at 0 % or 100 % on a few tasks.
    """
    if n == 0:
        return 0.0, 1.0
    p = passed / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def rate(rows: list[dict]) -> dict:
    """passed / n, the pass rate and its 95 % Wilson interval for some per-task rows."""
    k, n = sum(r["passed"] for r in rows), len(rows)
    lo, hi = wilson(k, n)
    return {"passed": k, "n": n, "pass_rate": k / n if n else None, "ci95": [lo, hi]}


def _messages(task: Task) -> list[dict]:
    return [{"role": "user", "content": task.prompt}]


def _ask(rt, task: Task, seed: int):
    """One greedy answer through the model's chat template (raw prompt text when the file carries none)."""
    kw = dict(max_tokens=task.max_tokens, temperature=0.0, seed=seed)
    if rt.target.chat_template:
        return rt.chat(_messages(task), **kw)
    return rt.generate(task.prompt, **kw)


def _load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def evaluate(models: Sequence[str | Path], *, classes: list[str] | None = None, per_class: int | None = None,
             ids: list[str] | None = None, seed: int = 0, drafter: str = "none", n_ctx: int = 2048,
             threads: int | None = None, timeout: float = 10.0, unsafe_no_sandbox: bool = False,
             progress: Callable[[str], None] | None = None) -> dict:
    """Ask every model every task (greedy, fixed seed), check the answers, and summarise per model and class.

    The models are loaded together and asked in turn, task by task, so the load of a shared machine falls on
    all of them alike; the answers do not depend on the order (each request starts from the same prompt).

    Args:
        models: GGUF paths, catalog names (pulled when missing; the pull is timed apart) or local variants
            such as ``qwen2.5-coder-0.5b-instruct:q4_0`` (``ondevice pull NAME --quant q4_0``).
        classes, per_class, ids: which tasks (``tasks.select``); default: all of them.
        seed: sampling seed (greedy decoding does not use it; it is recorded and passed for completeness).
        drafter: "none" (default: plain decoding, so tok/s is the model's own decode speed), "ngram" or
            "model"; greedy speculative decoding gives the same answers token for token.
        n_ctx: context of each runtime; threads: CPU threads.
        timeout: wall-clock seconds for each code answer's tests in the sandbox.
        unsafe_no_sandbox: run code answers without an OS sandbox where none is available (with a warning);
            by default the eval refuses to start there (``sandbox.require``).
        progress: called with one line per answer.
    Returns:
        JSON document: ``config``, ``machine``, ``models`` (one summary per model: per-class and overall pass
        rate with 95 % Wilson interval, pull / load / answer / check / wall seconds, decode tok/s, file size),
        ``answers`` (one entry per model, in the same order: per task the reply, what was extracted, the
        verdict and why).
    """
    import ondevice
    from ondevice.bench.run import machine
    from ondevice.quality.sandbox import require
    from ondevice.store import lookup

    require(unsafe_no_sandbox)  # before any model is pulled or loaded

    say = progress or (lambda s: None)
    tasks = select(classes, per_class, ids)
    t_start = time.perf_counter()
    runs = []
    try:
        for spec in models:
            t0 = time.perf_counter()
            path = lookup.resolve(spec)  # pulls a catalog model that is not cached yet
            pulled = time.perf_counter() - t0
            say(f"loading {spec}")
            rt = ondevice.load(path, drafter=drafter, n_ctx=n_ctx, threads=threads)
            runs.append({"model": str(spec), "path": str(path), "size_bytes": Path(path).stat().st_size, "rt": rt,
                         "pull_seconds": pulled, "load_seconds": time.perf_counter() - t0 - pulled, "answer_seconds": 0.0,
                         "check_seconds": 0.0, "decode_tokens": 0, "decode_seconds": 0.0, "tokens": 0, "rows": [],
                         "chat_template": bool(rt.target.chat_template), "load_average": [_load_average()]})
        for i, task in enumerate(tasks):
            for run in runs:
                t0 = time.perf_counter()
                res = _ask(run["rt"], task, seed)
                t1 = time.perf_counter()
                verdict = check(task, res.text, timeout=timeout, unsafe=unsafe_no_sandbox)
                t2 = time.perf_counter()
                st = res.stats
                run["answer_seconds"] += t1 - t0
                run["check_seconds"] += t2 - t1
                run["tokens"] += st.tokens
                if st.tokens > 1 and st.decode_tokens_per_second > 0:
                    run["decode_tokens"] += st.tokens - 1
                    run["decode_seconds"] += (st.tokens - 1) / st.decode_tokens_per_second
                run["rows"].append({"id": task.id, "class": task.cls, "passed": verdict.passed, "detail": verdict.detail,
                                    "extracted": verdict.extracted, "answer": res.text, "tokens": st.tokens,
                                    "stop_reason": st.stop_reason, "answer_seconds": round(t1 - t0, 3),
                                    "check_seconds": round(t2 - t1, 3)})
                say(f"[{i + 1}/{len(tasks)}] {run['model']:<36} {task.id:<24} {'pass' if verdict.passed else 'FAIL'}"
                    f"  {st.tokens:>3} tok  {verdict.detail[:60]}")
    finally:
        for run in runs:
            run.pop("rt").close()
    summaries, answers = [], []
    for run in runs:
        rows = run.pop("rows")
        run["load_average"].append(_load_average())
        by_class = {c: rate([r for r in rows if r["class"] == c]) for c in CLASSES if any(r["class"] == c for r in rows)}
        wall = run["pull_seconds"] + run["load_seconds"] + run["answer_seconds"] + run["check_seconds"]
        dec_t, dec_n = run.pop("decode_seconds"), run.pop("decode_tokens")
        summaries.append({**run, "classes": by_class, "overall": rate(rows), "wall_seconds": wall,
                          "decode_tokens_per_second": dec_n / dec_t if dec_t else None})
        answers.append({"model": run["model"], "tasks": rows})
    return {"machine": machine(),
            "config": {"models": [str(m) for m in models], "tasks": [t.id for t in tasks], "classes": classes,
                       "per_class": per_class, "seed": seed, "temperature": 0.0, "drafter": drafter, "n_ctx": n_ctx,
                       "threads": threads, "timeout": timeout, "seconds": time.perf_counter() - t_start,
                       "order": "interleaved: each task is asked of every model in turn"},
            "models": summaries, "answers": answers}


def rejudge(doc: dict, *, timeout: float = 10.0, unsafe_no_sandbox: bool = False) -> dict:
    """Check the answers stored in an ``evaluate`` document again (after a fix to a task's tests or to the
    extractor) without asking the models again: greedy answers do not change. Returns a new document whose
    verdicts and pass rates are recomputed (times, tok/s and the replies are kept) and ``config.rejudged``."""
    from ondevice.quality.tasks import load_tasks

    tasks = {t.id: t for t in load_tasks()}
    out = {**doc, "config": {**doc["config"], "rejudged": True}, "models": [], "answers": []}
    for m, a in zip(doc["models"], doc["answers"], strict=True):
        rows = []
        for r in a["tasks"]:
            v = check(tasks[r["id"]], r["answer"], timeout=timeout, unsafe=unsafe_no_sandbox)
            rows.append({**r, "passed": v.passed, "detail": v.detail, "extracted": v.extracted})
        classes = {c: rate([r for r in rows if r["class"] == c]) for c in CLASSES if any(r["class"] == c for r in rows)}
        out["models"].append({**m, "classes": classes, "overall": rate(rows)})
        out["answers"].append({**a, "tasks": rows})
    return out
