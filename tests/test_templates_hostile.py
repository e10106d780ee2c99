"""Reliability, second round (issue 28), part 1: hostile chat templates (API, chat, serve), answers cut by a
shutdown, and one too-long chat turn. Part 2 (tests/test_reliability_3.py) holds the smaller items."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import pytest

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
        subprocess.run([sys.executable, "-m", "gguf.scripts.gguf_new_metadata", str(tiny_gguf("llama")), str(out[kind]),
                        "--chat-template", template, "--force"], check=True, capture_output=True, timeout=300)
    return out


def _rss_mib() -> float:
    if not sys.platform.startswith("linux"):
        return 0.0
    with open(f"/proc/{os.getpid()}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


@pytest.mark.parametrize("kind", list(HOSTILE))
def test_hostile_template_is_one_error_within_the_budget_from_the_api(kind, hostile, monkeypatch):
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
        th.join(60)
        took = time.monotonic() - t0
        assert not th.is_alive(), "the template still renders after 60 s"
        e = outcome[0]
        assert isinstance(e, OndeviceError), e
        assert str(hostile[kind]) in str(e) and "chat template" in str(e) and "\n" not in str(e)
        assert took < float(BUDGET) + 20
        assert _rss_mib() - rss < 200  # the render's memory is the worker's, capped there
        assert rt.generate("hello", max_tokens=3, temperature=0).stats.tokens == 3  # the runtime still works


def test_hostile_template_in_chat_reports_each_turn_and_ctrl_c_stops_the_render(hostile):
    env = {**os.environ, "ONDEVICE_TEMPLATE_SECONDS": "120"}
    p = subprocess.Popen([sys.executable, "-m", "ondevice", "chat", str(hostile["loops"]), "--no-spec", "--threads", "1",
                          "--n-ctx", "256"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    p.stdin.write(b"first\n")
    p.stdin.flush()
    time.sleep(8)  # loaded, rendering the first turn (for up to 120 s)
    t0 = time.monotonic()
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)  # closes stdin: no more turns after the interrupted one
    assert time.monotonic() - t0 < 30
    assert "(stopped)" in err.decode() and "Traceback" not in err.decode(), err.decode()
    assert p.returncode == 0, err.decode()
    # piped turns with the budget in force: each one is a one-line error naming the file, the session goes on
    env["ONDEVICE_TEMPLATE_SECONDS"] = BUDGET
    r = subprocess.run([sys.executable, "-m", "ondevice", "chat", str(hostile["recursion"]), "--no-spec", "--threads",
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


def test_serve_stays_responsive_and_stoppable_with_a_hostile_template(hostile, monkeypatch):
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
        time.sleep(2)  # the template is rendering
        t0 = time.monotonic()
        assert _get(url + "/health") == 200
        status, body = _post(url + "/v1/completions", {"model": model, "prompt": "hello", "max_tokens": 2}, timeout=30)
        assert status == 200 and body["choices"][0]["finish_reason"] == "length"
        assert time.monotonic() - t0 < 15  # answered while the template renders, not after it
        th.join(120)
        status, body = result[0]
        assert status == 400 and "chat template" in body["error"]["message"] and "took over" in body["error"]["message"]
        # SIGTERM while another hostile render runs: the server stops at once
        th = threading.Thread(target=lambda: result.append(_post(url + "/v1/chat/completions", chat)), daemon=True)
        th.start()
        time.sleep(2)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        assert time.monotonic() - t0 < 10
    finally:
        proc.kill()
        proc.wait()


# -- 2. a cut answer is never "stop" ------------------------------------------------------------------------
HOLD = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16,"  # keeps counting: no early EOS


@pytest.mark.parametrize("stream", [False, True])
def test_shutdown_mid_answer_is_an_error_never_stop(stream, smollm2):
    openai = pytest.importorskip("openai")
    from ondevice.server.run import launch

    log = tempfile.TemporaryFile()
    proc, url = launch(str(smollm2), "--threads", "1", "--n-ctx", "512", "--no-spec", stderr=log)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        got: dict = {"chunks": []}

        def ask():
            try:
                if stream:
                    for c in client.completions.create(model=model, prompt=HOLD, max_tokens=2000, temperature=0,
                                                       stream=True):
                        got["chunks"].append(c)
                    got["ended"] = "normally"
                else:
                    got["answer"] = client.completions.create(model=model, prompt=HOLD, max_tokens=2000, temperature=0)
            except Exception as e:  # noqa: BLE001 - inspected below
                got["error"] = e

        th = threading.Thread(target=ask, daemon=True)
        th.start()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # generating: a few tokens are out
            h = json.loads(urllib.request.urlopen(url + "/health", timeout=10).read())
            if h["running"] and (not stream or len(got["chunks"]) >= 3):
                break
            time.sleep(0.2)
        time.sleep(1.0)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        th.join(120)
        proc.wait(timeout=60)
        got["stop_seconds"] = time.monotonic() - t0
        log.seek(0)
        got["server"] = log.read().decode(errors="replace")[-2000:]
        assert "timeout graceful shutdown" not in got["server"], got
        assert "answer" not in got, got["answer"].choices[0].finish_reason
        finishes = [c.choices[0].finish_reason for c in got["chunks"] if c.choices]
        assert "stop" not in finishes and "length" not in finishes
        if stream:  # an error event (the client raises) or a dropped connection; never a normal end
            assert "error" in got, got
        else:
            assert isinstance(got["error"], openai.APIStatusError) and got["error"].status_code == 503, got
            assert "cut short" in got["error"].message
    finally:
        proc.kill()
        proc.wait()


# -- 3. one long message does not end the chat --------------------------------------------------------------
def test_too_long_turn_is_refused_alone_and_the_session_kept(tiny_gguf):
    from ondevice.chat import ChatSession

    with ondevice.load(tiny_gguf("llama"), drafter="none", threads=1, n_ctx=256) as rt:
        s = ChatSession(rt, system="be brief", max_tokens=8, temperature=0)
        for q in ("first", "second"):
            st = s.ask(q)
            s.commit(q, "".join(c.text for c in st))
        with pytest.raises(OndeviceError, match="too long.*conversation is kept"):
            s.ask("word " * 400)
        assert [u for u, _ in s.turns] == ["first", "second"] and s.dropped == 0
        st = s.ask("third")
        assert "".join(c.text for c in st) is not None and st.stats.tokens > 0


def test_too_long_piped_line_is_one_error_and_the_next_lines_are_answered(tiny_gguf):
    r = subprocess.run([sys.executable, "-m", "ondevice", "chat", str(tiny_gguf("llama")), "--no-spec", "--threads", "1",
                        "--n-ctx", "256", "--max-tokens", "4", "--temperature", "0", "--stats"],
                       input=b"hello\n" + b"word " * 400 + b"\nagain\n", capture_output=True, timeout=300)
    err = r.stderr.decode()
    assert r.returncode == 1, err
    assert err.count("error:") == 1 and "too long" in err
    assert err.count(" tokens · ") == 2  # both short turns were answered (--stats line per answer)


def test_template_worker_starts_from_a_process_that_held_more_than_its_memory_cap():
    """Linux keeps ru_maxrss across execve: once this process had held over ``MEMORY_BYTES`` (any model above
    ~1 GB: the Qwen2.5-Coder pair), the worker's memory watchdog saw itself over the cap at start and exited,
    so every chat render failed with "could not start the chat template worker"."""
    code = ("import ondevice.templates as T\n"
            "big = b'\\x01' * (T.MEMORY_BYTES + (128 << 20)); del big  # the high-water mark stays\n"
            "print(T.render('{{ messages[0].content }}!', [{'role': 'user', 'content': 'hi'}], source='s'))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "hi!", r.stderr
