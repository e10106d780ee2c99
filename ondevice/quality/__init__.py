"""Quality a user can see: does a model (or a format of it) still give right answers?

A small task set written for this project (``tasks.toml``: code with unit tests, arithmetic, facts, unit
conversions), asked greedily through each model's chat template and checked: code by running the answer's
unit tests in an OS sandbox (``sandbox``; bubblewrap / sandbox-exec, ``confine``), short answers by exact match after extraction
(``extract``). ``evaluate`` returns pass rates per class with 95 % Wilson intervals, time and decode tok/s;
``report`` prints the table and the plot. CLI: ``ondevice bench --quality MODEL[,MODEL...]``.
"""

from __future__ import annotations

from ondevice.quality.runner import evaluate, wilson
from ondevice.quality.tasks import CLASSES, Task, Verdict, check, load_tasks, select

__all__ = ["CLASSES", "Task", "Verdict", "check", "evaluate", "load_tasks", "select", "wilson"]
