"""Run untrusted Python (a model's answer and its unit tests) in a contained child process.

Layers, each one doing what it can:
  * a fresh temporary directory as the working directory, removed afterwards, where the program's files live;
  * ``python -I -B``: isolated mode (no user site-packages, no PYTHON* variables, the script's directory not
    on ``sys.path``), no bytecode written; an environment holding only PATH, HOME/TMPDIR (the temp dir) and
    ``LC_ALL``; its own session, so a timeout kills every process it started;
  * ``resource`` limits set in the child before it runs: CPU seconds, address space, size of any file written,
    open files, no core dump;
  * a wall-clock limit enforced by the parent;
  * a ``sys.addaudithook`` guard installed before the program runs (audit hooks cannot be removed from
    Python): it refuses writing, deleting, renaming, linking or chmod-ing any path outside the temp dir,
    starting processes, loading ctypes, opening sockets, and adding further hooks.
The guard stops what a model's answer does by mistake or naive malice (``shutil.rmtree(Path.home())``,
``os.system("rm ...")``, ``while True``); it is not a security boundary against code written to escape
CPython (a native extension already importable could), which needs an OS sandbox (a container or a VM).
POSIX only (``resource``): elsewhere ``run_python`` raises a one-line error.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ondevice.errors import OndeviceError

# Runs first in the child: installs the guard, then runs main.py from the temp dir as __main__.
_BOOT = r"""
import os, sys

def _install():
    root = os.path.realpath(os.getcwd())
    write = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
    deny = frozenset({"os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty", "os.kill",
                      "os.killpg", "subprocess.Popen", "socket.__new__", "socket.connect", "socket.bind",
                      "sys.addaudithook", "os.setuid", "os.chroot", "mmap.__new__", "sys.remote_exec"})
    no_import = frozenset({"ctypes", "_ctypes", "_posixsubprocess", "_socket", "socket", "mmap", "_xxsubinterpreters",
                           "multiprocessing", "_multiprocessing"})
    # event → (how many leading args are paths, index of its dir_fd argument or None)
    path_events = {"os.remove": (1, 1), "os.rmdir": (1, 1), "os.rename": (2, 2), "os.mkdir": (1, 2),
                   "os.chmod": (1, 2), "os.chown": (1, 3), "os.truncate": (1, None), "os.link": (2, 2),
                   "os.symlink": (2, 2), "os.utime": (1, 3), "os.setxattr": (1, None), "os.removexattr": (1, None),
                   "shutil.rmtree": (1, 1), "os.mkfifo": (1, 2), "os.mknod": (1, 3), "os.chflags": (1, None)}
    realpath, join, getcwd, fsdecode, fspath, sep = os.path.realpath, os.path.join, os.getcwd, os.fsdecode, os.fspath, os.sep

    def inside(p):
        if isinstance(p, int):
            return True  # an fd the program already holds (it got it through an open this guard allowed)
        if isinstance(p, bytes):
            p = fsdecode(p)
        full = realpath(join(getcwd(), fspath(p)))
        return full == root or full.startswith(root + sep)

    def guard(event, args):
        if event in deny or event.startswith("ctypes.") or event.startswith("winreg."):
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "import" and args[0].split(".")[0] in no_import:
            raise PermissionError(f"sandbox: import {args[0]} is not allowed")
        if event == "open":
            path, mode, flags = args
            writes = (mode is not None and any(c in mode for c in "wax+")) or (mode is None and flags & write)
            if writes and path is not None and not inside(path):
                raise PermissionError(f"sandbox: writing {path!r} outside the sandbox is not allowed")
        if event in path_events:
            n, fd = path_events[event]
            paths = [a for a in args[:n] if a is not None]
            # relative to a directory fd: where it points is unknown here, so refused (rmtree inside works on paths)
            if any(not inside(a) for a in paths) or (fd is not None and len(args) > fd and args[fd] not in (None, -1)):
                raise PermissionError(f"sandbox: {event} {paths!r} outside the sandbox is not allowed")

    sys.path.insert(0, root)  # -I leaves the working directory off sys.path: main.py imports its neighbours
    sys.argv[:] = ["main.py"]
    sys.addaudithook(guard)
    with open("main.py", encoding="utf-8") as f:
        return compile(f.read(), "main.py", "exec")

_code = _install()
del _install
exec(_code, {"__name__": "__main__", "__builtins__": __builtins__})
"""


@dataclass
class SandboxResult:
    """What happened: ``ok`` (exit 0 within the limits), the exit code (negative: killed by that signal),
    whether the wall-clock limit killed it, the first few KiB of stdout/stderr, and the wall time."""

    ok: bool
    returncode: int | None
    timed_out: bool
    stdout: str
    stderr: str
    seconds: float

    def reason(self) -> str:
        """One line: why it failed (the last line of stderr, the time limit, or the signal), or "ok"."""
        if self.ok:
            return "ok"
        if self.timed_out:
            return "wall-clock limit reached (killed)"
        last = [ln for ln in self.stderr.strip().splitlines() if ln.strip()]
        if last:
            return last[-1][:300]
        if self.returncode is not None and self.returncode < 0:
            return f"killed by {signal.Signals(-self.returncode).name}"
        return f"exit code {self.returncode}"


def _limits(cpu_seconds: int, memory_bytes: int, file_bytes: int):
    """The preexec function: resource limits set in the child, after fork and before exec."""
    import resource

    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds + 1))
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_bytes, file_bytes))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))

    return apply


def run_python(code: str, *, files: dict[str, str] | None = None, timeout: float = 10.0,
               memory_bytes: int = 1 << 30, file_bytes: int = 16 << 20, output_bytes: int = 8192) -> SandboxResult:
    """Run ``code`` as ``__main__`` in a fresh temp dir, contained as the module docstring says.

    Args:
        code: the program (main.py).
        files: other files to write next to it first (name → text), e.g. ``{"solution.py": answer}``.
        timeout: wall-clock seconds before the whole process group is killed (CPU limit: the same, rounded up).
        memory_bytes: address-space limit.
        file_bytes: largest file it may write (stdout and stderr are files too: a print loop is cut here).
        output_bytes: how much of stdout / stderr to keep in the result.
    Returns:
        ``SandboxResult``.
    """
    if os.name != "posix":
        raise OndeviceError("the quality sandbox needs a POSIX system (resource limits); run the eval on Linux or macOS")
    tmp = Path(tempfile.mkdtemp(prefix="ondevice-sandbox-"))
    work = tmp / "work"  # the program's directory; its stdout/stderr files live beside it, out of its reach
    work.mkdir()
    try:
        for name, text in {**(files or {}), "main.py": code}.items():
            if "/" in name or name.startswith("."):
                raise OndeviceError(f"sandbox file name {name!r}: use a plain file name")
            (work / name).write_text(text, encoding="utf-8")
        env = {"PATH": "/usr/bin:/bin", "HOME": str(work), "TMPDIR": str(work), "LC_ALL": "C.UTF-8"}
        with open(tmp / "stdout", "wb") as out, open(tmp / "stderr", "wb") as err:
            t0 = time.perf_counter()
            proc = subprocess.Popen([sys.executable, "-I", "-B", "-c", _BOOT], cwd=work, env=env, stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=err, start_new_session=True,
                                    preexec_fn=_limits(int(timeout) + 1, memory_bytes, file_bytes))
            timed_out = False
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # the program and anything it managed to start
                except ProcessLookupError:
                    pass
                proc.wait()
            seconds = time.perf_counter() - t0

        def head(name: str) -> str:
            with open(tmp / name, "rb") as f:
                return f.read(output_bytes).decode("utf-8", "replace")

        rc = proc.returncode
        return SandboxResult(ok=rc == 0 and not timed_out, returncode=rc, timed_out=timed_out, stdout=head("stdout"),
                             stderr=head("stderr"), seconds=seconds)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
