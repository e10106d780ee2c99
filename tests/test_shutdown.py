"""Stopping work in progress: ``close()`` refuses a request waiting for its turn without waiting for it, and a
server stopped mid-answer or during the cost probe stops at once and never reports a cut answer as finished."""

from __future__ import annotations

import json
import os
import signal
import tempfile
import threading
import time
import urllib.request

import pytest

import ondevice
from ondevice.errors import OndeviceError

PROMPT = "The model draft and the target verify"


def test_close_refuses_a_waiting_request_and_does_not_wait_for_it(tiny_gguf, monkeypatch, time_scale):
    from ondevice.backends.llama import LlamaBackend

    real = LlamaBackend.eval

    def slow(self, *a, **kw):  # 50 ms a pass: B's 64 tokens would take over 3 s
        time.sleep(0.05)
        return real(self, *a, **kw)

    monkeypatch.setattr(LlamaBackend, "eval", slow)
    rt = ondevice.load(tiny_gguf("llama"), drafter="none", threads=1, n_ctx=512)
    started, b_out = threading.Event(), []

    def a_streams():
        try:
            for _ in rt.stream(PROMPT, max_tokens=400, temperature=0, gamma=0):
                started.set()
        except OndeviceError:
            pass
        started.set()

    def b_waits():
        try:
            b_out.append(rt.generate(PROMPT, max_tokens=64, temperature=0, gamma=0))
        except OndeviceError as e:
            b_out.append(e)

    a = threading.Thread(target=a_streams)
    a.start()
    assert started.wait(60)
    b = threading.Thread(target=b_waits)
    b.start()
    time.sleep(0.5)  # B is waiting for the slot A holds
    t0 = time.monotonic()
    rt.close()
    took = time.monotonic() - t0
    a.join(30)
    b.join(30)
    assert isinstance(b_out[0], OndeviceError) and "closed" in str(b_out[0]), b_out[0]
    assert took < time_scale(2.0)  # one pass of A, not B's whole answer


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


def test_sigterm_during_the_cost_probe_stops_at_once(smollm2, tmp_path, time_scale):
    """The first gamma=auto request measures costs (seconds); a shutdown must not wait for it."""
    import urllib.request

    from ondevice.server.run import launch

    log = tmp_path / "serve.log"
    with open(log, "wb") as f:
        env_home = os.environ.get("ONDEVICE_HOME")
        os.environ["ONDEVICE_HOME"] = str(tmp_path / "home")  # no cached costs: the first request probes
        try:
            proc, url = launch(str(smollm2), "--threads", "1", "--n-ctx", "512", stderr=f)
        finally:
            os.environ.pop("ONDEVICE_HOME") if env_home is None else os.environ.__setitem__("ONDEVICE_HOME", env_home)
        try:
            body = json.dumps({"model": "x", "prompt": "1, 2, 3,", "max_tokens": 50}).encode()
            model = json.loads(urllib.request.urlopen(url + "/v1/models", timeout=30).read())["data"][0]["id"]
            body = json.dumps({"model": model, "prompt": "1, 2, 3,", "max_tokens": 50}).encode()
            req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
            th = threading.Thread(target=lambda: _ignore(urllib.request.urlopen, req, timeout=120), daemon=True)
            th.start()
            time.sleep(1.5)  # the request is in the probe
            t0 = time.monotonic()
            proc.terminate()
            proc.wait(timeout=60)
            took = time.monotonic() - t0
        finally:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert "timeout graceful shutdown exceeded" not in text, text
    assert took < time_scale(30), took  # the pass in progress, not the whole probe or answer


def _ignore(fn, *a, **kw):
    try:
        fn(*a, **kw)
    except Exception:  # noqa: BLE001 - the answer does not matter here
        pass
