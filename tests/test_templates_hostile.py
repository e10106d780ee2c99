"""Chat templates a model file carries are untrusted: a hostile one (endless loops, doubling strings, recursion)
is one error within the render budget from the API, the chat REPL and the server, which stay usable and
stoppable; the render worker starts from a process that once held more than its memory cap."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
from helpers import wait_until_child_busy

import ondevice
from ondevice.errors import OndeviceError

HOSTILE = {  # chat templates a model file may carry
    "loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "doubling": "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}"
                "{{ ns.s }}",
    "recursion": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
}


BUDGET = "3"  # seconds a template may take (ONDEVICE_TEMPLATE_SECONDS) in these tests


@pytest.fixture(scope="module")
def hostile(tiny_gguf, tmp_path_factory):
    """kind → a tiny GGUF whose chat template is hostile (written with gguf's own gguf_new_metadata)."""
    base = tmp_path_factory.mktemp("hostile")
    out = {}
    for kind, template in HOSTILE.items():
        out[kind] = base / f"{kind}.gguf"
        subprocess.run([sys.executable, "-P", "-m", "gguf.scripts.gguf_new_metadata", str(tiny_gguf("llama")), str(out[kind]),
                        "--chat-template", template, "--force"], check=True, capture_output=True, timeout=300)
    return out


def _rss_mib() -> float:
    if not sys.platform.startswith("linux"):
        return 0.0
    with open(f"/proc/{os.getpid()}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


@pytest.mark.parametrize("kind", list(HOSTILE))
def test_hostile_template_is_one_error_within_the_budget_from_the_api(kind, hostile, monkeypatch, time_scale):
    from ondevice import templates

    monkeypatch.setattr(templates, "RENDER_SECONDS", float(BUDGET))
    with ondevice.load(hostile[kind], drafter="none", threads=1, n_ctx=256) as rt:
        outcome: list = []

        def chat():
            try:
                rt.chat([{"role": "user", "content": "hi"}], max_tokens=4)
                outcome.append("answered")
            except BaseException as e:  # noqa: BLE001 - reported below
                outcome.append(e)

        rss = _rss_mib()
        t0 = time.monotonic()
        th = threading.Thread(target=chat, daemon=True)
        th.start()
        th.join(time_scale(60))
        took = time.monotonic() - t0
        assert not th.is_alive(), "the template still renders after 60 s"
        e = outcome[0]
        assert isinstance(e, OndeviceError), e
        assert str(hostile[kind]) in str(e) and "chat template" in str(e) and "\n" not in str(e)
        assert took < time_scale(float(BUDGET) + 20)
        assert _rss_mib() - rss < 200  # the render's memory is the worker's, capped there
        assert rt.generate("hello", max_tokens=3, temperature=0).stats.tokens == 3  # the runtime still works


def test_hostile_template_in_chat_reports_each_turn_and_ctrl_c_stops_the_render(hostile, sigint_default, time_scale):
    env = {**os.environ, "ONDEVICE_TEMPLATE_SECONDS": "120"}
    p = subprocess.Popen([sys.executable, "-P", "-m", "ondevice", "chat", str(hostile["loops"]), "--no-spec", "--threads", "1",
                          "--n-ctx", "256"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    worker = None
    try:
        p.stdin.write(b"first\n")
        p.stdin.flush()
        # loaded, rendering the first turn (for up to 120 s): the template worker has run for a second (its
        # start takes ~0.2 s of CPU)
        worker = wait_until_child_busy(p.pid, "ondevice.templates", 1.0, timeout=time_scale(100), fallback=8)
        t0 = time.monotonic()
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=120)  # closes stdin: no more turns after the interrupted one
    finally:  # a failed wait leaves no endless render behind (the worker runs in a session of its own)
        if worker is not None and p.poll() is None:
            os.kill(worker, signal.SIGKILL)
        p.kill()
        p.wait()
    assert time.monotonic() - t0 < time_scale(30)
    assert "(stopped)" in err.decode() and "Traceback" not in err.decode(), err.decode()
    assert p.returncode == 0, err.decode()
    # piped turns with the budget in force: each one is a one-line error naming the file, the session goes on
    env["ONDEVICE_TEMPLATE_SECONDS"] = BUDGET
    r = subprocess.run([sys.executable, "-P", "-m", "ondevice", "chat", str(hostile["recursion"]), "--no-spec", "--threads",
                        "1", "--n-ctx", "256"], input=b"one\ntwo\n", capture_output=True, timeout=300, env=env)
    lines = [ln for ln in r.stderr.decode().splitlines() if ln.strip()]
    assert r.returncode == 1 and len(lines) == 2, r.stderr.decode()
    assert all(str(hostile["recursion"]) in ln and "recurses" in ln for ln in lines)


def _get(url: str, timeout: float = 5.0) -> int:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status


def _post(url: str, body: dict, timeout: float = 120.0) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_serve_stays_responsive_and_stoppable_with_a_hostile_template(hostile, monkeypatch, time_scale):
    from ondevice.server.run import launch

    monkeypatch.setenv("ONDEVICE_TEMPLATE_SECONDS", "20")
    proc, url = launch(str(hostile["loops"]), "--threads", "1", "--n-ctx", "256", "--no-spec")
    try:
        chat = {"model": hostile["loops"].name.removesuffix(".gguf"), "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4}
        model = json.loads(urllib.request.urlopen(url + "/v1/models", timeout=30).read())["data"][0]["id"]
        chat["model"] = model
        result: list = []
        th = threading.Thread(target=lambda: result.append(_post(url + "/v1/chat/completions", chat)), daemon=True)
        th.start()
        first = wait_until_child_busy(proc.pid, "ondevice.templates", 1.0, timeout=time_scale(15), fallback=2)
        t0 = time.monotonic()
        assert _get(url + "/health") == 200
        status, body = _post(url + "/v1/completions", {"model": model, "prompt": "hello", "max_tokens": 2}, timeout=30)
        assert status == 200 and body["choices"][0]["finish_reason"] == "length"
        assert time.monotonic() - t0 < time_scale(15)  # answered while the template renders, not after it
        th.join(120)
        status, body = result[0]
        assert status == 400 and "chat template" in body["error"]["message"] and "took over" in body["error"]["message"]
        # SIGTERM while another hostile render runs: the server stops at once
        th = threading.Thread(target=lambda: result.append(_post(url + "/v1/chat/completions", chat)), daemon=True)
        th.start()
        wait_until_child_busy(proc.pid, "ondevice.templates", 1.0, timeout=time_scale(15), fallback=2,
                              exclude=(first,))  # the new worker (the first was killed at the budget)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=time_scale(30))
        assert time.monotonic() - t0 < time_scale(10)
    finally:
        proc.kill()
        proc.wait()


def test_template_worker_starts_from_a_process_that_held_more_than_its_memory_cap():
    """Linux keeps ru_maxrss across execve: once this process had held over ``MEMORY_BYTES`` (any model above
    ~1 GB: the Qwen2.5-Coder pair), the worker's memory watchdog saw itself over the cap at start and exited,
    so every chat render failed with "could not start the chat template worker"."""
    code = ("import ondevice.templates as T\n"
            "big = b'\\x01' * (T.MEMORY_BYTES + (128 << 20)); del big  # the high-water mark stays\n"
            "print(T.render('{{ messages[0].content }}!', [{'role': 'user', 'content': 'hi'}], source='s'))\n")
    r = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "hi!", r.stderr
