"""The task set (``tasks.toml`` in this package) and the checker that judges one answer to one task."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from ondevice.errors import OndeviceError
from ondevice.quality.extract import extract_code, extract_number, same_number, same_text

TASKS_FILE = Path(__file__).with_name("tasks.toml")
CLASSES = ("code", "arithmetic", "facts", "units")
MAX_TOKENS = {"code": 384, "arithmetic": 64, "facts": 64, "units": 64}  # a worked short answer fits in 64

# The program the sandbox runs for a code task: the answer is solution.py; its function is bound to
# `candidate` (by name, or the last top-level function it defines), then the task's asserts run.
_HARNESS = """import inspect
import solution

entry = {entry!r}
if entry == "*":
    fns = [f for n, f in vars(solution).items() if inspect.isfunction(f) and f.__module__ == "solution"
           and not n.startswith("_")]
    if not fns:
        raise SystemExit("the answer defines no function")
    candidate = fns[-1]
else:
    candidate = getattr(solution, entry)
{tests}
print("all tests passed")
"""


@dataclass(frozen=True)
class Task:
    """One task. ``kind`` is how it is checked: "code" (unit tests), "number" or "text" (exact match)."""

    id: str
    cls: str
    prompt: str
    kind: str
    entry: str | None = None
    tests: str | None = None
    answer: str | None = None
    answers: tuple[str, ...] = field(default_factory=tuple)

    @property
    def max_tokens(self) -> int:
        return MAX_TOKENS[self.cls]


@dataclass
class Verdict:
    """The checker's judgement: passed or not, and one line saying what was extracted and why."""

    passed: bool
    detail: str
    extracted: str | None = None


def _task(raw: dict, where: str) -> Task:
    cls = raw.get("class")
    if cls not in CLASSES or not raw.get("id") or not raw.get("prompt"):
        raise OndeviceError(f"{where}: every [[task]] needs id, prompt and class (one of {', '.join(CLASSES)})")
    if cls == "code":
        if not raw.get("entry") or not raw.get("tests"):
            raise OndeviceError(f"{where}: code task {raw['id']} needs entry and tests")
        return Task(raw["id"], cls, raw["prompt"], "code", entry=raw["entry"], tests=raw["tests"])
    if raw.get("answers"):
        return Task(raw["id"], cls, raw["prompt"], "text", answers=tuple(raw["answers"]))
    if raw.get("answer") is None:
        raise OndeviceError(f"{where}: task {raw['id']} needs answer (a number) or answers (texts)")
    try:
        float(raw["answer"])
    except (TypeError, ValueError):
        raise OndeviceError(f"{where}: task {raw['id']}: answer {raw['answer']!r} is not a number") from None
    return Task(raw["id"], cls, raw["prompt"], "number", answer=str(raw["answer"]))


@lru_cache(maxsize=4)
def load_tasks(path: Path = TASKS_FILE) -> tuple[Task, ...]:
    """Read the task set (default: the one shipped in this package).

    Returns:
        The tasks in file order. Raises a one-line ``OndeviceError`` naming the file on a malformed task.
    """
    try:
        doc = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise OndeviceError(f"{path}: cannot read the task set ({e})") from None
    tasks = tuple(_task(t, str(path)) for t in doc.get("task", []))
    ids = [t.id for t in tasks]
    if len(set(ids)) != len(ids):
        raise OndeviceError(f"{path}: task ids must be unique")
    return tasks


def select(classes: list[str] | None = None, per_class: int | None = None, ids: list[str] | None = None) -> list[Task]:
    """The shipped tasks, filtered: only ``classes``, only ``ids``, at most ``per_class`` of each class (file order)."""
    tasks = load_tasks()
    if classes:
        bad = [c for c in classes if c not in CLASSES]
        if bad:
            raise OndeviceError(f"quality classes {', '.join(bad)}: choose from {', '.join(CLASSES)}")
    if ids:
        unknown = set(ids) - {t.id for t in tasks}
        if unknown:
            raise OndeviceError(f"unknown task ids {', '.join(sorted(unknown))}: see {TASKS_FILE}")
    out, seen = [], {}
    for t in tasks:
        if (classes and t.cls not in classes) or (ids and t.id not in ids):
            continue
        if per_class is not None and seen.get(t.cls, 0) >= per_class:
            continue
        seen[t.cls] = seen.get(t.cls, 0) + 1
        out.append(t)
    return out


def check(task: Task, answer: str, *, timeout: float = 10.0, unsafe: bool = False) -> Verdict:
    """Judge ``answer`` (the model's whole reply) to ``task``.

    Code: the extracted program and the task's tests run in the sandbox (``sandbox.run_python``) under a
    wall-clock limit of ``timeout`` seconds; it passes when every assert holds. Numbers: the extracted number
    equals the answer exactly. Text: a normalised reading of the reply equals one of the answers.
    ``unsafe``: run code even where no OS sandbox is available (``sandbox.require``).
    """
    if task.kind == "code":
        from ondevice.quality.sandbox import run_python

        code = extract_code(answer, task.entry)
        if code is None:
            return Verdict(False, "no Python code found in the answer")
        r = run_python(_HARNESS.format(entry=task.entry, tests=task.tests), files={"solution.py": code}, timeout=timeout,
                       unsafe=unsafe)
        return Verdict(r.ok, "all tests passed" if r.ok else r.reason(), code)
    if task.kind == "number":
        got = extract_number(answer)
        ok = same_number(got, float(task.answer))
        return Verdict(ok, f"read {got:g}, want {task.answer}" if got is not None else "no number in the answer",
                       None if got is None else f"{got:g}")
    ok = same_text(answer, list(task.answers))
    return Verdict(ok, ("matches " if ok else "does not match ") + " / ".join(task.answers))
