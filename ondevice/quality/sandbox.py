"""Run untrusted Python (a model's answer and its unit tests) in a contained child process.

The boundary is the operating system's (``confine``): on Linux bubblewrap — the child sees only the system
libraries and the Python installation (read-only) and one private writable tmpfs ``/sandbox`` of bounded
size and number of files, not the user's home, ``/tmp`` or ``/proc``; no network; uid 65534 without
capabilities —; on macOS ``sandbox-exec`` with a deny-by-default profile (write only the temp dir, no
network). Where neither is available ``run_python`` refuses (``OndeviceError`` saying how to install
bubblewrap) unless the caller passes ``unsafe=True`` (``ondevice bench --quality --unsafe-no-sandbox``).

Inside it, further layers:
  * ``python -I -B``: isolated mode (no user site-packages, no PYTHON* variables, the script's directory not
    on ``sys.path``), no bytecode written; an environment holding only PATH, HOME/TMPDIR (the work dir) and
    ``LC_ALL``; its own session, so a timeout kills every process it started;
  * ``resource`` limits: CPU seconds, address space, size of any file written, open files, processes, no core;
  * a wall-clock limit enforced by the parent;
  * a ``sys.addaudithook`` guard installed before the program runs: it refuses writes outside the work dir,
    starting processes, ctypes and sockets with a clear ``PermissionError``. It catches mistakes and naive
    malice with a readable message; it is NOT the boundary (code written to escape CPython gets past it —
    ``dir_fd`` calls, native code); the OS sandbox is. docs/quality.md says what is and is not stopped.
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

# Runs first in the child: sets the limits that must be set inside, installs the guard, then runs main.py from the
# work dir as __main__. The guard binds everything it calls now (the program can rebind builtins and modules).
_BOOT = r"""
import os, sys

def _install(nproc, guarded):
    import resource
    root = os.path.realpath(os.getcwd())
    if nproc:  # 0: not set (the count would be shared beyond this sandbox: nproc_limit)
        try:
            resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
        except (ValueError, OSError, AttributeError):
            pass
    write = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
    deny = frozenset({"os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty", "os.kill",
                      "os.killpg", "subprocess.Popen", "socket.__new__", "socket.connect", "socket.bind",
                      "sys.addaudithook", "os.setuid", "os.chroot", "mmap.__new__", "sys.remote_exec"})
    no_import = frozenset({"ctypes", "_ctypes", "_posixsubprocess", "_socket", "socket", "mmap", "_xxsubinterpreters",
                           "multiprocessing", "_multiprocessing"})
    # event -> (how many leading args are paths, index of its dir_fd argument or None)
    path_events = {"os.remove": (1, 1), "os.rmdir": (1, 1), "os.rename": (2, 2), "os.mkdir": (1, 2),
                   "os.chmod": (1, 2), "os.chown": (1, 3), "os.truncate": (1, None), "os.link": (2, 2),
                   "os.symlink": (2, 2), "os.utime": (1, 3), "os.setxattr": (1, None), "os.removexattr": (1, None),
                   "shutil.rmtree": (1, 1), "os.mkfifo": (1, 2), "os.mknod": (1, 3), "os.chflags": (1, None)}
    realpath, join, getcwd, fsdecode, fspath, sep = os.path.realpath, os.path.join, os.getcwd, os.fsdecode, os.fspath, os.sep
    _isinstance, _int, _bytes, _len, _PermissionError = isinstance, int, bytes, len, PermissionError

    def inside(p):
        if _isinstance(p, _int):
            return True  # an fd the program already holds (it got it through an open this guard allowed)
        if _isinstance(p, _bytes):
            p = fsdecode(p)
        full = realpath(join(getcwd(), fspath(p)))
        return full == root or full.startswith(root + sep)

    def guard(event, args):
        if event in deny or event.startswith("ctypes.") or event.startswith("winreg."):
            raise _PermissionError(f"sandbox: {event} is not allowed")
        if event == "import" and args[0].split(".")[0] in no_import:
            raise _PermissionError(f"sandbox: import {args[0]} is not allowed")
        if event == "open":
            path, mode, flags = args
            writes = (mode is not None and ("w" in mode or "a" in mode or "x" in mode or "+" in mode)) or (
                mode is None and flags & write)
            if writes and path is not None and not inside(path):
                raise _PermissionError(f"sandbox: writing {path!r} outside the sandbox is not allowed")
        if event in path_events:
            n, fd = path_events[event]
            bad = fd is not None and _len(args) > fd and args[fd] not in (None, -1)
            for a in args[:n]:
                if a is not None and not inside(a):
                    bad = True
            if bad:  # relative to a directory fd: where it points is unknown here, so refused
                raise _PermissionError(f"sandbox: {event} {args[:n]!r} outside the sandbox is not allowed")

    sys.path.insert(0, root)  # -I leaves the working directory off sys.path: main.py imports its neighbours
    sys.argv[:] = ["main.py"]
    if guarded:
        sys.addaudithook(guard)
    with open("main.py", encoding="utf-8") as f:
        return compile(f.read(), "main.py", "exec")

_code = _install(int(sys.argv[1]), sys.argv[2] == "1")
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
        if last:  # written by the program: escape control characters (terminal escape sequences, bidi overrides)
            return "".join(c if c.isprintable() else f"\\x{ord(c):02x}" if ord(c) < 256 else f"\\u{ord(c):04x}"
                           for c in last[-1][:300])
        if self.returncode is not None and self.returncode < 0:
            return f"killed by {signal.Signals(-self.returncode).name}"
        return f"exit code {self.returncode}"


def _limits(cpu_seconds: int, memory_bytes: int, file_bytes: int):
    """The preexec function: resource limits set in the child, after fork and before exec (inherited by the
    sandbox tool and everything it starts)."""
    import resource

    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds + 1))
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_bytes, file_bytes))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))

    return apply


def require(unsafe: bool = False) -> str | None:
    """The OS sandbox this machine allows (``confine.available()``), checked before a long eval starts.

    Raises:
        OndeviceError: none is available and ``unsafe`` is False (one line: why and how to install one).
    Returns:
        The kind, or None when ``unsafe`` lets the code run without one (a warning is printed to stderr once).
    """
    from ondevice.quality.confine import available, unavailable_reason

    kind = available()
    if kind is None and not unsafe:
        raise OndeviceError(f"the quality eval runs model-written code only inside an OS sandbox, and none works "
                            f"here: {unavailable_reason()}; or pass --unsafe-no-sandbox to run it unconfined")
    if kind is None and not _warned:
        _warned.append(True)
        print("warning: --unsafe-no-sandbox: model-written code runs WITHOUT an OS sandbox (only resource limits "
              "and an audit hook that code written to escape gets past); it can read and write your files",
              file=sys.stderr)
    return kind


_warned: list[bool] = []
MAX_FILES = 256  # files and directories the program may create in its work dir (where the OS lets us bound it)
MAX_WORK_BYTES = 64 << 20  # bytes it may write there in all
MAX_PROCESSES = 4


def counts_per_user_namespace(release: str | None = None) -> bool:
    """Whether this kernel checks ``RLIMIT_NPROC`` against the processes of the uid in the caller's own user
    namespace (Linux 5.14+, "ucounts"), so that each bubblewrap sandbox — a user namespace of its own — has its
    own count. Before 5.14 the count is the host uid's: every concurrent sandbox (and every other process of
    that uid) shares it.

    Args:
        release: a kernel release such as ``"5.10.0-21-amd64"`` (default: this machine's).
    """
    import platform
    import re

    if release is None:
        if not sys.platform.startswith("linux"):
            return False
        release = platform.release()
    m = re.match(r"(\d+)\.(\d+)", release)
    return bool(m) and (int(m.group(1)), int(m.group(2))) >= (5, 14)


def nproc_limit(kind: str | None) -> int:
    """The ``RLIMIT_NPROC`` the program runs under: ``MAX_PROCESSES`` inside a bubblewrap sandbox on a kernel
    that counts per user namespace; else 0 (not set). Where the count is per host uid (an older kernel, no
    sandbox, macOS — whose profile refuses fork anyway), a limit of 4 would be a cap on that uid's processes
    everywhere: concurrent evals would fail each other's forks and threads (and unconfined, the user's own
    hundreds of processes would leave none). There the PID namespace and the time limit bound a fork bomb:
    everything in the sandbox dies with it at the wall-clock limit."""
    return MAX_PROCESSES if kind and kind.startswith("bwrap") and counts_per_user_namespace() else 0


def run_python(code: str, *, files: dict[str, str] | None = None, timeout: float = 10.0,
               memory_bytes: int = 1 << 30, file_bytes: int = 16 << 20, output_bytes: int = 8192,
               unsafe: bool = False, guard: bool = True) -> SandboxResult:
    """Run ``code`` as ``__main__`` in a fresh work dir, contained as the module docstring says.

    Args:
        code: the program (main.py).
        files: other files to write next to it first (name → text), e.g. ``{"solution.py": answer}``.
        timeout: wall-clock seconds before the whole process group is killed (CPU limit: the same, rounded up).
        memory_bytes: address-space limit.
        file_bytes: largest file it may write (stdout and stderr are files too: a print loop is cut here).
        output_bytes: how much of stdout / stderr to keep in the result.
        unsafe: run without an OS sandbox when none is available (with a warning) instead of refusing.
        guard: install the audit-hook guard (False only in tests that show the OS sandbox holds alone).
    Returns:
        ``SandboxResult``.
    Raises:
        OndeviceError: not POSIX, a bad file name, or no OS sandbox here and ``unsafe`` is False.
    """
    from ondevice.quality.confine import SANDBOX_DIR, bwrap_argv, macos_argv

    if os.name != "posix":
        raise OndeviceError("the quality sandbox needs a POSIX system (resource limits); run the eval on Linux or macOS")
    kind = require(unsafe)
    sources = {**(files or {}), "main.py": code}
    for name in sources:
        if "/" in name or name.startswith(".") or not name:
            raise OndeviceError(f"sandbox file name {name!r}: use a plain file name")
    tmp = Path(tempfile.mkdtemp(prefix="ondevice-sandbox-"))
    work = tmp / "work"  # the program's directory (unconfined, sandbox-exec); bwrap's tmpfs mount point
    src = tmp / "src"  # its files, copied into the sandbox's tmpfs by bwrap
    src.mkdir()
    if kind is None or kind == "sandbox-exec":
        work.mkdir()
    fds: dict[str, int] = {}
    try:
        for name, text in sources.items():
            (src / name).write_text(text, encoding="utf-8")
            if kind is None or kind == "sandbox-exec":
                (work / name).write_text(text, encoding="utf-8")
        home = SANDBOX_DIR if kind and kind.startswith("bwrap") else str(work)
        env = {"PATH": "/usr/bin:/bin", "HOME": home, "TMPDIR": home, "LC_ALL": "C.UTF-8"}
        child = [sys.executable, "-I", "-B", "-c", _BOOT, str(nproc_limit(kind)), "1" if guard else "0"]
        cwd = work
        if kind is None:
            argv = child
        elif kind == "sandbox-exec":
            argv = macos_argv(child, work=str(work))
        else:
            fds = {name: os.open(src / name, os.O_RDONLY) for name in sources}
            argv = bwrap_argv(kind, child, files=fds, env=env, work_bytes=MAX_WORK_BYTES, work_files=MAX_FILES,
                              stage_dir=str(tmp))
            cwd, env = "/", {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
        with open(tmp / "stdout", "wb") as out, open(tmp / "stderr", "wb") as err:
            t0 = time.perf_counter()
            proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                    start_new_session=True, pass_fds=tuple(fds.values()),
                                    preexec_fn=_limits(int(timeout) + 1, memory_bytes, file_bytes))
            for fd in fds.values():
                os.close(fd)
            fds = {}
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
        for fd in fds.values():
            os.close(fd)
        shutil.rmtree(tmp, ignore_errors=True)
