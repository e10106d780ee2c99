"""What a step cost: wall time and peak private memory, sampled while it runs.

Linux keeps no peak of *private* memory (``VmHWM`` counts memory-mapped file pages too, which the page
cache can drop), so ``MemoryWatch`` samples ``RssAnon`` of this process (and, with ``tree=True``, of
its child processes) from ``/proc`` every few milliseconds on a daemon thread. Elsewhere (macOS) it
falls back to ``ru_maxrss``, the process's lifetime peak resident size, and says so.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path


def rss_anon(pid: int | str = "self") -> int:
    """Private resident memory (RssAnon) of one process in bytes; 0 when it is gone or unreadable."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def tree_pids(root: int) -> list[int]:
    """``root`` and all its descendants (from /proc/*/stat parent ids)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


class MemoryWatch:
    """Context manager: ``seconds`` and ``peak_rss_bytes`` (peak RssAnon; the process tree with ``tree``).

    Args:
        pid: the process to watch (default: this one).
        tree: add the RssAnon of its descendants at each sample.
        interval: seconds between samples.
    """

    def __init__(self, pid: int | None = None, *, tree: bool = False, interval: float = 0.01) -> None:
        self.pid, self.tree, self.interval = pid or os.getpid(), tree, interval
        self.proc = Path("/proc/self/status").is_file()
        self.peak_rss_bytes = 0
        self.seconds = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pids, self._scanned = [self.pid], -1.0

    def sample(self) -> int:
        if self.tree and time.perf_counter() - self._scanned > 0.2:  # walking /proc is costly: 5 times a second
            self._pids, self._scanned = tree_pids(self.pid), time.perf_counter()
        now = sum(rss_anon(p) for p in self._pids)
        self.peak_rss_bytes = max(self.peak_rss_bytes, now)
        return now

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def __enter__(self) -> MemoryWatch:
        self._t0, self._cpu0 = time.perf_counter(), time.process_time()
        if self.proc:
            self.sample()
            self._thread = threading.Thread(target=self._run, daemon=True, name="memwatch")
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self._t0
        self.cpu_seconds = time.process_time() - self._cpu0  # this process's CPU time (all its threads)
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self.sample()
        else:
            import resource

            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            self.peak_rss_bytes = peak if sys.platform == "darwin" else peak * 1024

    def record(self) -> dict:
        """{"seconds", "cpu_seconds", "peak_rss_bytes", "measure"} for --json (``cpu_seconds``: this process's
        CPU time, which a machine shared with other work inflates less than wall time)."""
        how = "RssAnon sampled every 10 ms" if self.proc else "ru_maxrss (lifetime peak resident size)"
        return {"seconds": round(self.seconds, 3), "cpu_seconds": round(self.cpu_seconds, 3),
                "peak_rss_bytes": int(self.peak_rss_bytes), "measure": how}
