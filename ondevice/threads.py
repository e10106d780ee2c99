"""The default CPU thread count: the cores that are free when the model loads, at most the physical ones.

llama.cpp's CPU threads meet at a barrier after every operation and spin while they wait. When the
machine runs something else, one of N threads is descheduled and the others spin for it: with two
threads on a 2-core machine and one other CPU-bound process, decoding measured 16-30× slower than with
one thread (docs/benchmarks.md, "Default thread count"). So the default counts the cores other processes
are using *now* and leaves them alone; ``--threads`` / ``threads=`` still sets any number.
"""

from __future__ import annotations

import os
import sys
import time


def usable_cpus() -> int:
    """Logical CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def physical_cores() -> int:
    """Physical cores (one thread per core is llama.cpp's advice; SMT siblings share one core's units).

    Linux: distinct ``thread_siblings_list`` of the usable CPUs; macOS: the performance cores
    (``hw.perflevel0.physicalcpu``); elsewhere the logical count.
    """
    cpus = usable_cpus()
    if sys.platform.startswith("linux"):
        try:
            ids = os.sched_getaffinity(0)
            sib = {open(f"/sys/devices/system/cpu/cpu{i}/topology/thread_siblings_list").read().strip() for i in ids}
            return max(1, min(cpus, len(sib)))
        except (AttributeError, OSError):
            return cpus
    if sys.platform == "darwin":
        import subprocess

        try:
            n = int(subprocess.run(["sysctl", "-n", "hw.perflevel0.physicalcpu"], capture_output=True, text=True,
                                   timeout=2).stdout.strip())
            return max(1, min(cpus, n))
        except (OSError, ValueError, subprocess.SubprocessError):
            return cpus
    return cpus


def busy_cpus(samples: int = 5, interval: float = 0.02) -> float:
    """CPUs other processes keep busy now: the median count of runnable tasks besides this one (Linux's
    instantaneous ``/proc/loadavg`` field), else the 1-minute load average."""
    try:
        counts = []
        for i in range(samples):
            with open("/proc/loadavg") as f:
                counts.append(int(f.read().split()[3].split("/")[0]) - 1)  # minus the reader itself
            if i + 1 < samples:
                time.sleep(interval)
        return float(sorted(counts)[len(counts) // 2])
    except (OSError, ValueError, IndexError):
        try:
            return os.getloadavg()[0]
        except (AttributeError, OSError):
            return 0.0


def default_threads() -> int:
    """Threads for a model loaded now: the physical cores, less the CPUs other processes are using, at least 1."""
    free = usable_cpus() - round(busy_cpus())
    return max(1, min(physical_cores(), free))
