"""The chat template worker (``python -m ondevice.templates``) is a hostile template's whole world: it must not
import code from the folder ondevice was started in, and (issue #41) it sees no environment and no network."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

RENDER = ("from ondevice import templates\n"
          "print(templates.render({template!r}, [{{'role': 'user', 'content': 'hi'}}], source='t.gguf'))\n")


def _render_in(cwd, template: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """Render ``template`` from a fresh process started in ``cwd`` (itself with -P: the parent is not under test)."""
    return subprocess.run([sys.executable, "-P", "-c", RENDER.format(template=template)], cwd=cwd, capture_output=True,
                          text=True, timeout=120, env={**os.environ, **(env or {})})


def test_worker_does_not_import_from_the_working_directory(tmp_path):
    evil = tmp_path / "evil"
    evil.mkdir()
    marker = tmp_path / "marker"
    # a json.py in the folder ondevice runs in: the worker imports json first thing
    (evil / "json.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    r = _render_in(evil, "{{ messages[0]['content'] }}!")
    assert not marker.exists(), "the template worker imported json.py from the working directory"
    assert r.returncode == 0 and r.stdout.strip() == "hi!", r.stderr


def _worker_processes() -> list[int]:
    """PIDs of the running template worker and everything under it (a sandbox tool and the Python inside)."""
    from ondevice import templates

    root = templates._worker.proc.pid
    parents = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = open(f"/proc/{d}/stat").read()
            except OSError:
                continue
            parents[int(d)] = int(stat.rsplit(")", 1)[1].split()[1])
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += [c for c, pp in parents.items() if pp == p]
    return out


def _render_here(template: str = "{{ messages[0]['content'] }}") -> str:
    from ondevice import templates

    return templates.render(template, [{"role": "user", "content": "hi"}], source="t.gguf")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the worker's /proc entries (Linux)")
def test_worker_gets_no_environment_and_no_network(monkeypatch):
    from ondevice import templates

    monkeypatch.setenv("HF_TOKEN", "hf_SECRET_TOKEN_VALUE")
    templates._kill_worker()
    try:
        assert _render_here() == "hi"
        procs = _worker_processes()
        environ = b"".join(open(f"/proc/{p}/environ", "rb").read() for p in procs)
        assert b"hf_SECRET_TOKEN_VALUE" not in environ
        python = [p for p in procs if b"ondevice.templates" in open(f"/proc/{p}/cmdline", "rb").read()
                  and b"bwrap" not in open(f"/proc/{p}/cmdline", "rb").read()]
        assert python, procs
        if templates._worker.confinement:
            # its own network namespace: nothing but its own loopback
            assert os.readlink(f"/proc/{python[-1]}/ns/net") != os.readlink("/proc/self/ns/net")
    finally:
        templates._kill_worker()


def test_code_in_the_worker_reads_no_token_and_reaches_no_socket(monkeypatch, tmp_path):
    """What a template that escaped the jinja2 sandbox (as CVE-2024-56326 did) could reach: the same launch as the
    worker's, running a probe instead of the worker."""
    from ondevice import templates

    monkeypatch.setenv("HF_TOKEN", "hf_SECRET_TOKEN_VALUE")
    (tmp_path / "notes").write_text("private")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.5)
    probe = ("import os, socket\nprint(sorted(os.environ), 'hf_SECRET_TOKEN_VALUE' in str(os.environ))\n"
             f"try:\n    print(open({str(tmp_path / 'notes')!r}).read())\nexcept OSError as e:\n    print(type(e).__name__)\n"
             "try:\n    s = socket.create_connection(('127.0.0.1', %d), timeout=3)\n    s.sendall(b'x')\n    print('CONNECTED')\n"
             "except OSError as e:\n    print(type(e).__name__)\n") % server.getsockname()[1]
    argv, env, kind = templates._worker_command(("-c", probe))
    try:
        r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    finally:
        if kind is not None:
            with pytest.raises(TimeoutError):
                server.accept()
        server.close()
    assert r.returncode == 0, r.stderr
    assert "False" in r.stdout.splitlines()[0] and "HF_TOKEN" not in r.stdout
    if kind is None:
        pytest.skip("no OS sandbox here: the worker has no environment but cannot be kept off the network")
    assert "CONNECTED" not in r.stdout and "private" not in r.stdout, r.stdout


def test_orphaned_worker_stops_rendering_when_its_parent_dies(tmp_path):
    """A parent killed while its worker renders a hostile template (SIGKILL: no atexit) leaves no worker behind."""
    code = ("import os, sys, threading, time\nfrom ondevice import templates\n"
            "threading.Thread(target=lambda: templates.render('{% for i in range(100000) %}{% for j in range(100000) %}'"
            "'{% endfor %}{% endfor %}', [], source='t', seconds=600), daemon=True).start()\n"
            "time.sleep(4)\nprint(templates._worker.proc.pid, flush=True)\ntime.sleep(600)\n")
    p = subprocess.Popen([sys.executable, "-P", "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        pgid = int(p.stdout.readline())
    finally:
        p.kill()
        p.wait()
    import time

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        os.killpg(pgid, 9)
        pytest.fail("the worker still renders 10 s after its parent died")
