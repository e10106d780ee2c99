"""OS confinement for a child Python that runs untrusted code: the command line that starts it inside
bubblewrap (Linux) or ``sandbox-exec`` (macOS), and which of them this machine allows.

Linux, ``bwrap`` (Debian/Ubuntu package ``bubblewrap``): new user, mount, network, PID, IPC, UTS and cgroup
namespaces; the child sees a read-only root holding only the system libraries (``/usr``, ``/lib*``), the
Python installation it runs (``sys.prefix`` and friends, read-only), the directories named by the caller
(read-only), a minimal ``/dev`` (read-only), and at most one writable directory ``/sandbox``; no ``/proc``,
no ``/tmp``, not the user's home, no network (only its own loopback interface), no environment but
what the caller sets; it runs as uid 65534 with no capabilities and cannot create further user namespaces.
The writable directory is a tmpfs of bounded size. Its number of files is bounded too where an unprivileged
user + mount namespace may mount a tmpfs with ``nr_inodes`` (``unshare -U -r -m``, then ``bwrap`` inside):
kind ``"bwrap+inodes"``; where only ``bwrap`` works, kind ``"bwrap"`` (size bounded, file count only by
the time limit). Started as root, kind ``"bwrap+inodes"`` first binds the read-only directories in a private
mount namespace, then drops to uid 65534 (``setpriv``) before building the sandbox, so that the kernel does
not treat the child as root (root's processes are exempt from ``RLIMIT_NPROC``).

macOS, ``sandbox-exec``: a deny-by-default profile that allows reading the Python installation, the system
libraries and the work directory, writing only the work directory, and no network. (Not exercised on this
project's Linux CI; the tests marked ``macos`` run it.)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from functools import lru_cache
from pathlib import Path

SANDBOX_DIR = "/sandbox"  # the writable directory, as the child sees it (Linux)
INSTALL_HINT = ("install bubblewrap (Debian/Ubuntu: `sudo apt-get install bubblewrap`, Fedora: "
                "`sudo dnf install bubblewrap`, Arch: `sudo pacman -S bubblewrap`)")
_SYSTEM = ("/usr", "/lib", "/lib64", "/lib32", "/libx32", "/bin")
_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def python_roots() -> list[str]:
    """The directories a child of this interpreter needs to read: its prefixes and the real executable's."""
    exe = os.path.realpath(sys.executable)
    roots = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, os.path.dirname(exe),
             os.path.dirname(os.path.dirname(exe))}
    return _outermost(r for r in roots if r and r != "/" and os.path.isdir(r))


def _outermost(paths) -> list[str]:
    """Distinct real paths with those inside another one dropped (one bind covers them)."""
    out: list[str] = []
    for p in sorted({os.path.realpath(p) for p in paths}):
        if not any(p == q or p.startswith(q.rstrip("/") + "/") for q in out):
            out.append(p)
    return out


def _system_binds() -> list[str]:
    args: list[str] = []
    for d in _SYSTEM:
        if os.path.islink(d):
            args += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            args += ["--ro-bind", d, d]
    for f in ("/etc/ld.so.cache", "/etc/localtime"):
        args += ["--ro-bind-try", f, f]
    return args


def bwrap_argv(kind: str, argv: list[str], *, read_only: list[str] = (), files: dict[str, int] | None = None,
               env: dict[str, str] | None = None, work_bytes: int = 64 << 20, work_files: int = 256,
               stage_dir: str | None = None, writable: bool = True, die_with_parent: bool = True) -> list[str]:
    """The command line that runs ``argv`` under bubblewrap, as the module docstring says.

    Args:
        kind: ``"bwrap+inodes"`` or ``"bwrap"`` (``available()``).
        argv: the child's command (its executable by absolute path).
        read_only: further directories the child may read (bound at the same path).
        files: name → open file descriptor: copied into the writable directory before the child starts
            (the caller passes these fds with ``pass_fds``).
        env: the child's whole environment.
        work_bytes, work_files: size and (kind ``"bwrap+inodes"``) number of files of the writable directory.
        stage_dir: kind ``"bwrap+inodes"``: a private, empty host directory (this function makes the mount points
            it needs there: ``work`` for the tmpfs; run as root, also one per read-only bind, see below).
        writable: False: no writable directory at all (the working directory is ``/``).
        die_with_parent: kill the sandbox when the thread that started it ends (Linux ties this to the thread,
            not the process: a child started from a short-lived thread must pass False and end another way).
    Returns:
        The argv to start with ``start_new_session=True`` (so it has no controlling terminal; bwrap's own
        ``--new-session`` is not used, so that ``os.killpg`` of that session reaches the sandbox's PID 1, whose
        death ends every process inside).
    """
    bwrap = shutil.which("bwrap", path=_PATH) or "bwrap"
    roots = _outermost([*python_roots(), *read_only])
    # Run as root (containers, CI), the sandbox would be uid 0 to the kernel, which exempts it from RLIMIT_NPROC:
    # drop to uid 65534 first. That user cannot reach a Python installed under /root, so a first stage (still
    # root, in a private mount namespace) binds each read-only root onto a mount point in stage_dir.
    drop = kind == "bwrap+inodes" and writable and os.geteuid() == 0 and shutil.which("setpriv", path=_PATH)
    sources = roots
    if kind == "bwrap+inodes" and writable:
        stage = Path(str(stage_dir))
        (stage / "work").mkdir()
        if drop:
            sources = [str(stage / f"ro{i}") for i in range(len(roots))]
            for d in [stage, stage / "work", *map(Path, sources)]:
                d.mkdir(exist_ok=True)
                os.chown(d, 65534, 65534)
    box = [bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--uid", "65534", "--gid", "65534",
           *(["--die-with-parent"] if die_with_parent else []), "--hostname", "sandbox", *_system_binds()]
    for src, d in zip(sources, roots, strict=True):
        box += ["--ro-bind", src, d]
    box += ["--dev", "/dev"]
    if writable:
        if kind == "bwrap+inodes":
            box += ["--bind", str(Path(str(stage_dir)) / "work"), SANDBOX_DIR]
        else:
            box += ["--size", str(work_bytes), "--tmpfs", SANDBOX_DIR]
        for name, fd in (files or {}).items():
            box += ["--perms", "0644", "--file", str(fd), f"{SANDBOX_DIR}/{name}"]
    box += ["--remount-ro", "/dev", "--remount-ro", "/", "--chdir", SANDBOX_DIR if writable else "/", "--clearenv"]
    for k, v in (env or {}).items():
        box += ["--setenv", k, v]
    box += ["--", *argv]
    if kind != "bwrap+inodes" or not writable:
        return box
    # the tmpfs with a bounded number of inodes: mounted by an unprivileged user + mount namespace (bwrap itself
    # has no option for nr_inodes), then bwrap runs inside that namespace and binds it as /sandbox
    unshare = shutil.which("unshare", path=_PATH) or "unshare"
    script = ('mount -t tmpfs -o "size=$1,nr_inodes=$2,mode=0777" ondevice-sandbox "$3" || exit 125; '
              'shift 3; exec "$@"')
    cmd = [unshare, "--user", "--map-root-user", "--mount", "--propagation", "private", "/bin/sh", "-c", script,
           "sh", str(work_bytes), str(work_files), str(Path(str(stage_dir)) / "work"), *box]
    if not drop:
        return cmd
    binds = ('n=$1; shift; while [ "$n" -gt 0 ]; do mount --bind "$1" "$2" && mount -o remount,bind,ro "$2" '
             '|| exit 125; shift 2; n=$((n - 1)); done; exec "$@"')
    setpriv = shutil.which("setpriv", path=_PATH)
    return [unshare, "--mount", "--propagation", "private", "/bin/sh", "-c", binds, "sh", str(len(roots)),
            *[x for pair in zip(roots, sources, strict=True) for x in pair],
            setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", "--", *cmd]


def macos_argv(argv: list[str], *, work: str | None, read_only: list[str] = ()) -> list[str]:
    """``sandbox-exec`` with a deny-by-default profile: read the Python installation, system libraries,
    ``read_only`` and ``work``; write only ``work`` (None: nothing); no network, no other process."""

    def q(p: str) -> str:
        return '"' + os.path.realpath(p).replace("\\", "\\\\").replace('"', '\\"') + '"'

    reads = [*python_roots(), *read_only, "/usr/lib", "/usr/share", "/System", "/Library/Apple",
             "/private/var/db/dyld", "/dev"] + ([work] if work else [])
    profile = "\n".join([
        "(version 1)", "(deny default)",
        # a framework build's bin/python3.x re-executes Python.app inside its prefix
        "(allow process-exec " + " ".join(f"(subpath {q(p)})" for p in python_roots())
        + f" (literal {q(sys.executable)}))",
        "(allow file-read-metadata)", "(allow sysctl-read)",
        "(allow file-read* " + " ".join(f"(subpath {q(p)})" for p in reads) + ' (literal "/"))',
        # loading libpython and extension modules maps code: a separate operation since macOS 10.15
        "(allow file-map-executable " + " ".join(f"(subpath {q(p)})" for p in reads if p != "/dev") + ")",
        '(allow file-write-data (literal "/dev/null"))',
        *([f"(allow file-write* (subpath {q(work)}))"] if work else []),
    ])
    return ["/usr/bin/sandbox-exec", "-p", profile, *argv]


@lru_cache(maxsize=1)
def available() -> str | None:
    """Which confinement this machine allows: ``"bwrap+inodes"``, ``"bwrap"``, ``"sandbox-exec"`` or None.

    Checked once per process by starting this interpreter under each (best first) and reading its answer."""
    if sys.platform == "darwin":
        kinds = ["sandbox-exec"] if os.path.exists("/usr/bin/sandbox-exec") else []
    elif sys.platform.startswith("linux") and shutil.which("bwrap", path=_PATH):
        kinds = (["bwrap+inodes"] if shutil.which("unshare", path=_PATH) else []) + ["bwrap"]
    else:
        kinds = []
    for kind in kinds:
        with tempfile.TemporaryDirectory(prefix="ondevice-probe-") as tmp:
            cmd = [sys.executable, "-I", "-S", "-c", "open('probe', 'w').write('ok'); print(open('probe').read())"]
            if kind == "sandbox-exec":
                os.mkdir(Path(tmp) / "work")
                argv, cwd = macos_argv(cmd, work=str(Path(tmp) / "work")), Path(tmp) / "work"
            else:
                argv, cwd = bwrap_argv(kind, cmd, stage_dir=tmp), "/"
            try:
                r = subprocess.run(argv, cwd=cwd, env={"PATH": _PATH}, capture_output=True, timeout=60,
                                   stdin=subprocess.DEVNULL)
            except (OSError, subprocess.TimeoutExpired):
                continue
            if r.returncode == 0 and r.stdout.strip() == b"ok":
                return kind
    return None


def unavailable_reason() -> str:
    """One line: why ``available()`` is None here and how to fix it."""
    if sys.platform == "darwin":
        return "/usr/bin/sandbox-exec is missing or refused to start Python"
    if not sys.platform.startswith("linux"):
        return f"no OS sandbox is implemented for {sys.platform} (Linux: bubblewrap; macOS: sandbox-exec)"
    if not shutil.which("bwrap", path=_PATH):
        return f"bubblewrap (bwrap) is not installed: {INSTALL_HINT}"
    return ("bwrap is installed but could not start a sandbox (unprivileged user namespaces disabled? "
            "`sysctl kernel.unprivileged_userns_clone=1`, or Ubuntu's kernel.apparmor_restrict_unprivileged_userns)")
