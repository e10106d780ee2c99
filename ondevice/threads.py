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


_gomp = None  # llama.cpp's omp_pause_resource_all once found (False: none), per process


def release_omp_team() -> None:
    """Free the calling thread's OpenMP team, if llama.cpp's CPU backend made one (Linux builds use libgomp).

    Every thread that ran a multi-threaded decode keeps a team, and once a process holds more team threads than
    CPUs libgomp stops spinning at barriers (100 spins, then sleep): a server whose requests ran on another thread
    than its first decodes decoded one token 1.5-1.6x slower on an idle 2-core machine (scripts/bench_spin.py). So
    a thread frees its team when its request ends (``Runtime``'s turn), after embeddings / reranking (outside a
    turn) and at the end of ``load()`` (the batch curve's probe, ``draft="auto"``'s cost probe decode there); the
    next decode makes one again (a thread start, tens of microseconds). Only the libgomp llama.cpp's libraries link (already loaded) is touched, not another copy in the
    process (a wheel's renamed one, e.g. sentencepiece's); a no-op elsewhere (macOS builds use ggml's own thread
    pool), without OpenMP 5.0 (libgomp of GCC < 9) and inside a parallel region.
    """
    global _gomp
    if _gomp is None:
        if not sys.platform.startswith("linux") or "llama_cpp" not in sys.modules:
            return
        _gomp = _find_gomp()
        if _gomp is None:
            return
    if _gomp:
        _gomp(1)  # omp_pause_soft: libgomp frees this thread's pool (per thread)


def _find_gomp():
    """``omp_pause_resource_all`` of the libgomp llama.cpp's CPU backend links (the system's or a wheel's renamed
    copy): looked up in that library's own dependencies, so another libgomp loaded first (sentencepiece's, torch's)
    is not the one paused. False when llama.cpp's libraries are loaded without it (no OpenMP, or GCC < 9); None
    when they are not loaded yet (ask again later)."""
    import ctypes

    try:
        with open("/proc/self/maps") as f:
            paths = {line.split(None, 5)[-1].strip() for line in f if "/" in line}
    except OSError:
        return False
    # the CPU backend first; a static build has it in libllama
    libs = [p for n in ("libggml-cpu", "libggml", "libllama") for p in sorted(paths) if os.path.basename(p).startswith(n)]
    if not libs:
        return None
    for path in libs:
        try:  # dlsym on a library's handle searches it and its dependencies, not the whole process
            return ctypes.CDLL(path, mode=os.RTLD_NOLOAD).omp_pause_resource_all  # OpenMP 5.0: GCC >= 9
        except (OSError, AttributeError):
            continue
    return False
