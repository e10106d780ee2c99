"""The quality eval's sandbox holds against code written to escape it: every escape the security review found
(or could think of) is tried, with the audit-hook guard on and with it off (the OS sandbox alone), and fails.

On Linux this needs bubblewrap (`apt-get install bubblewrap`); without it the tests that run code skip and
say so, and the refusal is tested. macOS: sandbox-exec, in the tests marked ``macos``."""

from __future__ import annotations

import os
import socket
import sys
import uuid
from pathlib import Path

import pytest

from ondevice.errors import OndeviceError
from ondevice.quality import confine, sandbox
from ondevice.quality.sandbox import run_python

BEST = confine.available() if os.name == "posix" else None
needs_os_sandbox = pytest.mark.skipif(BEST is None, reason=f"no OS sandbox here: {confine.unavailable_reason()}")
BOTH = pytest.mark.parametrize("guard", [True, False], ids=["guarded", "os-only"])
# where the unshare tmpfs stage works, the bare-bubblewrap fallback is tested too
KINDS = ["bwrap+inodes", "bwrap"] if BEST == "bwrap+inodes" else [BEST]


@pytest.fixture(params=KINDS)
def kind(request, monkeypatch):
    """Each OS sandbox kind this machine can run, forced for the test."""
    monkeypatch.setattr(confine, "available", lambda: request.param)
    return request.param


@pytest.fixture
def target(tmp_path):
    """A directory outside the sandbox the escapes aim at, and the marker path they try to create there."""
    d = tmp_path / "outside"
    d.mkdir()
    return d, d / "marker"


def _escaped(marker: Path, r) -> bool:
    return marker.exists() or "ESCAPED" in r.stdout


@needs_os_sandbox
@BOTH
def test_dir_fd_write_outside_fails(target, guard, kind):
    d, marker = target
    for base in (str(d), "/", os.path.dirname(sys.executable)):
        code = (f"import os\nd = os.open({base!r}, os.O_RDONLY)\n"
                f"fd = os.open({marker.name if base == str(d) else 'marker'!r}, os.O_CREAT | os.O_WRONLY, dir_fd=d)\n"
                "os.write(fd, b'x')\nprint('ESCAPED')")
        r = run_python(code, guard=guard)
        assert not r.ok and not _escaped(marker, r), (base, r.stderr)
        assert not Path(base, "marker").exists() or base == str(d)


@needs_os_sandbox
@BOTH
def test_rebinding_builtins_does_not_open_the_guard(target, guard, kind):
    _, marker = target
    code = ("import builtins\nbuiltins.any = lambda *a: False\nbuiltins.isinstance = lambda *a: True\n"
            f"open({str(marker)!r}, 'w').write('x')\nprint('ESCAPED')")
    r = run_python(code, guard=guard)
    assert not r.ok and not _escaped(marker, r), r.stderr


@needs_os_sandbox
@BOTH
def test_ctypes_cannot_write_outside(target, guard, kind):
    _, marker = target
    code = ("import ctypes, os\nlibc = ctypes.CDLL(None)\n"
            f"fd = libc.open({str(marker).encode()!r}, os.O_CREAT | os.O_WRONLY, 0o644)\n"
            "print('ESCAPED' if fd >= 0 else 'refused')")
    r = run_python(code, guard=guard)
    assert not _escaped(marker, r), r.stdout
    assert ("refused" in r.stdout) if not guard else ("PermissionError" in r.stderr)


@needs_os_sandbox
@BOTH
def test_subprocess_cannot_write_outside_and_processes_are_bounded(target, guard, kind):
    _, marker = target
    code = f"import subprocess\nsubprocess.run(['/bin/sh', '-c', 'echo x > {marker}'])\n"
    r = run_python(code, guard=guard)
    assert not marker.exists(), r.stderr
    # run as root, the sandbox drops to uid 65534 where it can mount its tmpfs (kind bwrap+inodes); bare bwrap run
    # as root stays uid 0 to the kernel, whose processes Linux exempts from RLIMIT_NPROC (docs/quality.md)
    if not guard and (os.geteuid() != 0 or kind == "bwrap+inodes"):
        # a fork bomb stops at the process limit
        r = run_python("import os, time\nn = 0\ntry:\n    for _ in range(64):\n        if os.fork() == 0:\n"
                       "            time.sleep(30)\n            os._exit(0)\n        n += 1\nexcept OSError as e:\n"
                       "    print('stopped', n, e)\n", guard=False, timeout=5)
        assert "stopped" in r.stdout and int(r.stdout.split()[1]) < sandbox.MAX_PROCESSES, r.stdout + r.stderr


@needs_os_sandbox
@BOTH
def test_no_network(guard, kind):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.5)
    port = server.getsockname()[1]
    try:
        code = (f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=3)\n"
                "s.sendall(b'ESCAPED')\nprint('ESCAPED')")
        r = run_python(code, guard=guard)
        assert not r.ok and "ESCAPED" not in r.stdout, r.stderr
        with pytest.raises(TimeoutError):
            server.accept()
    finally:
        server.close()


@needs_os_sandbox
@BOTH
def test_home_and_host_files_are_not_readable(tmp_path, monkeypatch, guard, kind):
    home = tmp_path / "home"
    home.mkdir()
    (home / ".netrc").write_text("machine example.com password SECRET-TOKEN")
    monkeypatch.setenv("HOME", str(home))
    code = ("import os\nfor p in [os.path.expanduser('~/.netrc'), " + repr(str(home / ".netrc")) + "]:\n"
            "    try:\n        print(open(p).read())\n    except OSError as e:\n        print(type(e).__name__)\n"
            "print(sorted(os.listdir('/')))")
    r = run_python(code, guard=guard)
    assert r.ok, r.stderr
    assert "SECRET-TOKEN" not in r.stdout + r.stderr
    if kind.startswith("bwrap"):
        assert "'tmp'" not in r.stdout and "'proc'" not in r.stdout and "'home'" not in r.stdout


@needs_os_sandbox
@BOTH
def test_filling_the_disk_stops_at_the_bounds(guard, kind):
    tag = f"ondevice-fill-{uuid.uuid4().hex}"
    many = (f"import os, tempfile\nn = 0\nfor where in [tempfile.gettempdir(), '/tmp', '/dev/shm']:\n"
            f"    try:\n        for i in range(20000):\n            open(os.path.join(where, '{tag}-%d' % i), 'w').close()\n"
            "            n += 1\n    except OSError as e:\n        print(where, type(e).__name__)\nprint('files', n)")
    r = run_python(many, guard=guard, timeout=30)
    assert "files" in r.stdout, r.stderr
    n = int(r.stdout.split()[-1])
    if kind == "bwrap+inodes":
        assert n <= sandbox.MAX_FILES, r.stdout
    assert not list(Path("/tmp").glob(f"{tag}-*")) and not list(Path("/dev/shm").glob(f"{tag}-*"))
    big = ("n = 0\ntry:\n    for i in range(64):\n        with open(f'big{i}', 'wb') as f:\n"
           "            f.write(b'x' * (8 << 20))\n        n += 1\nexcept OSError as e:\n    print(type(e).__name__)\n"
           "print('big', n)")
    r = run_python(big, guard=guard, timeout=30)
    assert "big" in r.stdout, r.stderr
    if kind.startswith("bwrap"):
        assert int(r.stdout.split()[-1]) * (8 << 20) <= sandbox.MAX_WORK_BYTES, r.stdout


@needs_os_sandbox
def test_correct_programs_still_run_and_write_in_their_dir(kind):
    r = run_python("import solution, os\nopen('a', 'w').write('x')\nos.mkdir('d')\nos.rename('a', 'd/b')\n"
                   "print(solution.f(3), open('d/b').read())", files={"solution.py": "def f(x):\n    return x * 2\n"})
    assert r.ok and r.stdout.split() == ["6", "x"], r.stderr


def test_no_os_sandbox_refuses_unless_unsafe(monkeypatch, capsys):
    monkeypatch.setattr(confine, "available", lambda: None)
    monkeypatch.setattr(sandbox, "_warned", [])
    with pytest.raises(OndeviceError, match="--unsafe-no-sandbox") as e:
        run_python("print(1)")
    assert "\n" not in str(e.value)
    from ondevice.quality import evaluate

    with pytest.raises(OndeviceError, match="OS sandbox"):  # before any model is looked up or loaded
        evaluate(["no-such-model-anywhere"])
    r = run_python("print(1)", unsafe=True)
    assert r.ok and r.stdout.strip() == "1"
    assert "WITHOUT an OS sandbox" in capsys.readouterr().err


def test_missing_bwrap_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(confine.shutil, "which", lambda *a, **k: None)
    assert "apt-get install bubblewrap" in confine.unavailable_reason()


def test_bench_quality_refuses_without_a_sandbox_and_the_unsafe_flag_gets_past(monkeypatch):
    from typer.testing import CliRunner

    from ondevice.cli.main import app

    monkeypatch.setattr(confine, "available", lambda: None)
    monkeypatch.setattr(sandbox, "_warned", [])
    r = CliRunner().invoke(app, ["bench", "--quality", "no-such-model-anywhere"])
    assert r.exit_code != 0 and "--unsafe-no-sandbox" in r.output and "no-such-model-anywhere" not in r.output, r.output
    r = CliRunner().invoke(app, ["bench", "--quality", "no-such-model-anywhere", "--unsafe-no-sandbox"])
    assert r.exit_code != 0 and "no-such-model-anywhere" in r.output, r.output  # past the refusal, to the model


def test_bench_formats_refuses_without_a_sandbox_before_any_conversion(monkeypatch, tiny_gguf):
    """Before: ``bench --formats`` requantized and measured every format and only then failed at its last step,
    the task eval's sandbox. Now it refuses first, in one line naming --unsafe-no-sandbox and how to install
    bubblewrap; with the flag it gets past the check (to the work, stopped here where it starts)."""
    from typer.testing import CliRunner

    from converters import advisor
    from ondevice.cli.main import app

    started: list = []

    def files(*a, **k):
        started.append(True)
        raise RuntimeError("the conversion work started")

    monkeypatch.setattr(advisor, "_files", files)
    monkeypatch.setattr(confine, "available", lambda: None)
    monkeypatch.setattr(confine.shutil, "which", lambda *a, **k: None)  # as where bubblewrap is not installed
    monkeypatch.setattr(sandbox, "_warned", [])
    r = CliRunner().invoke(app, ["bench", str(tiny_gguf("llama")), "--formats", "q4_0"])
    assert r.exit_code != 0 and not started, (r.output, r.exception)
    err = r.output.strip()
    assert "--unsafe-no-sandbox" in err and "apt-get install bubblewrap" in err and "\n" not in err, err
    r = CliRunner().invoke(app, ["bench", str(tiny_gguf("llama")), "--formats", "q4_0", "--unsafe-no-sandbox"])
    assert started and "the conversion work started" in r.output, (r.output, r.exception)


_FORK_A_FEW = ("import os, time\nn = 0\ntry:\n    for _ in range({n}):\n        if os.fork() == 0:\n"
               "            time.sleep({hold})\n            os._exit(0)\n        n += 1\nexcept OSError as e:\n"
               "    print('stopped', n)\nelse:\n    print('forked', n)\ntime.sleep({hold})\n"
               "import resource\nprint('nproc', resource.getrlimit(resource.RLIMIT_NPROC)[0])\n")


def _concurrently(programs: list[str]) -> list:
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(programs)) as ex:
        return list(ex.map(lambda code: run_python(code, guard=False, timeout=30), programs))


def test_rlimit_nproc_is_set_only_where_the_kernel_counts_per_sandbox():
    """RLIMIT_NPROC counts the processes of a uid: in the caller's own user namespace since Linux 5.14 (each
    bubblewrap sandbox has its own), on the host before. There a limit of 4 would be shared by every concurrent
    eval (uid 65534) or, unconfined, by all of the user's processes, so it is not set (the PID namespace and
    the time limit bound a fork bomb). Fails before: the limit was set everywhere."""
    assert not sandbox.counts_per_user_namespace("5.10.0-21-amd64")
    assert not sandbox.counts_per_user_namespace("4.19.0")
    assert sandbox.counts_per_user_namespace("5.14.0-1-generic") and sandbox.counts_per_user_namespace("6.18.44-fc-v1")
    per_ns = sys.platform.startswith("linux") and sandbox.counts_per_user_namespace()
    assert sandbox.nproc_limit("bwrap+inodes") == sandbox.nproc_limit("bwrap") == (sandbox.MAX_PROCESSES if per_ns else 0)
    assert sandbox.nproc_limit(None) == sandbox.nproc_limit("sandbox-exec") == 0


@needs_os_sandbox
@pytest.mark.skipif(not sandbox.counts_per_user_namespace(), reason="kernel before 5.14: RLIMIT_NPROC is per host uid")
def test_concurrent_sandboxes_do_not_use_up_each_others_processes():
    """Three evals at once, one a fork bomb at its limit the whole time: the other two still start their
    processes (each sandbox's count is its own user namespace's), and the bomb still stops at its limit."""
    bomb = _FORK_A_FEW.format(n=64, hold=4)
    few = _FORK_A_FEW.format(n=sandbox.MAX_PROCESSES - 2, hold=2)  # the sandbox's init and Python count too
    r_bomb, *rs = _concurrently([bomb, few, few])
    for r in rs:
        assert r.ok and f"forked {sandbox.MAX_PROCESSES - 2}" in r.stdout, r.stdout + r.stderr
    assert "stopped" in r_bomb.stdout and int(r_bomb.stdout.split()[1]) < sandbox.MAX_PROCESSES, r_bomb.stdout


@needs_os_sandbox
def test_where_the_count_is_per_host_uid_no_limit_is_shared(monkeypatch):
    """As on a kernel before 5.14: no RLIMIT_NPROC is set in the child, and concurrent evals each start a few
    processes."""
    import resource

    monkeypatch.setattr(sandbox, "counts_per_user_namespace", lambda release=None: False)
    inherited = resource.getrlimit(resource.RLIMIT_NPROC)[0]
    for r in _concurrently([_FORK_A_FEW.format(n=3, hold=1)] * 2):
        assert r.ok and "forked 3" in r.stdout and f"nproc {inherited}" in r.stdout, r.stdout + r.stderr


@pytest.mark.macos
def test_macos_sandbox_exec_holds(tmp_path):
    assert confine.available() == "sandbox-exec"
    marker = tmp_path / "marker"
    for code in (f"import os\nd = os.open({str(tmp_path)!r}, os.O_RDONLY)\nos.open('marker', os.O_CREAT | os.O_WRONLY, dir_fd=d)",
                 f"open({str(marker)!r}, 'w')",
                 "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=3)"):
        r = run_python(code, guard=False)
        assert not r.ok and not marker.exists(), r.stderr
