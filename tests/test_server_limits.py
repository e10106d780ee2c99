"""``ondevice serve``'s smaller hardening (issue #41 item 11): a deadline for reading a request (head and body),
a connection cap, a chat page no other site may frame, and error messages that never show where the server
keeps its files. Tiny models on a free loopback port; every request to 127.0.0.1.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import pytest

httpx = pytest.importorskip("httpx")

READ_TIMEOUT = 1.0
SLACK = 10.0  # seconds beyond the deadline a loaded machine may take to act on it


@pytest.fixture(scope="module")
def raising_model(tiny_gguf, tmp_path_factory):
    """A tiny GGUF whose chat template raises: its error names the model file."""
    out = tmp_path_factory.mktemp("limits") / "raises.gguf"
    subprocess.run([sys.executable, "-P", "-m", "gguf.scripts.gguf_new_metadata", str(tiny_gguf("llama")), str(out),
                    "--chat-template", "{{ raise_exception('no chat here') }}", "--force"], check=True,
                   capture_output=True, timeout=300)
    return out


@pytest.fixture(scope="module")
def server(raising_model):
    from ondevice.server.run import launch

    proc, url = launch(str(raising_model), "--threads", "1", "--n-ctx", "64", "--no-spec",
                       "--read-timeout", str(READ_TIMEOUT))
    yield url
    proc.terminate()
    proc.wait(timeout=30)


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=READ_TIMEOUT + SLACK)


def _read_all(s: socket.socket) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and how long that took."""
    t0, data = time.monotonic(), b""
    while True:
        try:
            part = s.recv(65536)
        except TimeoutError:
            raise AssertionError(f"the server kept the connection open over {READ_TIMEOUT + SLACK:g} s") from None
        if not part:
            return data, time.monotonic() - t0
        data += part


def test_a_trickled_body_gets_408_and_the_connection_closes(server):
    """Before: a client announcing 100 bytes and sending 10 held its connection (and a task) for ever."""
    with _connect(server) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"model\": ")
        data, took = _read_all(s)
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), data[:200]
    err = json.loads(body)["error"]
    assert err["code"] == "request_timeout" and "--read-timeout" in err["message"]
    assert READ_TIMEOUT * 0.9 <= took < READ_TIMEOUT + SLACK


def test_a_trickled_head_is_dropped(server):
    """Before: a request head that never ends held its connection for ever (uvicorn has no head deadline)."""
    with _connect(server) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        data, took = _read_all(s)
    assert data == b"" and took < READ_TIMEOUT + SLACK
    assert httpx.get(server + "/health", timeout=30).status_code == 200  # the server itself is fine


def test_page_cannot_be_framed(server):
    r = httpx.get(server + "/", timeout=30)
    assert r.status_code == 200 and "frame-ancestors 'none'" in r.headers["content-security-policy"]
    assert r.headers["x-frame-options"] == "DENY"


def test_errors_name_files_by_base_name(server, raising_model):
    """Before: "chat template of /tmp/.../raises.gguf raised ..." told every client where the files live."""
    model = httpx.get(server + "/v1/models", timeout=30).json()["data"][0]["id"]
    r = httpx.post(server + "/v1/chat/completions", timeout=60,
                   json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    msg = r.json()["error"]["message"]
    assert r.status_code == 400 and "raises.gguf" in msg and "no chat here" in msg
    assert str(raising_model.parent) not in msg and "/" not in msg.split("raises.gguf")[0][-2:], msg
    # any message: paths of this machine by base name; URL paths and addresses untouched
    from ondevice.server.errors import ApiError

    e = ApiError(500, f"internal error: FileNotFoundError: [Errno 2] No such file: '{sys.prefix}/lib/x.so'")
    assert str(e) == "internal error: FileNotFoundError: [Errno 2] No such file: 'x.so'"
    for kept in ("POST /v1/chat/completions: Method Not Allowed", "answers http://127.0.0.1:8080/v1 only"):
        assert str(ApiError(405, kept)) == kept
    r = httpx.get(server + "/v1/models/other", timeout=30)  # was a 500 (an ApiError raised in a plain route)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_connection_cap(tiny_gguf):
    """--max-connections N: N connections are served at once, one more gets 503 (before: no cap at all)."""
    from ondevice.server.run import launch

    n = 3
    proc, url = launch(str(tiny_gguf("llama")), "--threads", "1", "--n-ctx", "64", "--no-spec",
                       "--max-connections", str(n))
    idle: list[socket.socket] = []
    try:
        with httpx.Client(timeout=30) as c:
            idle += [_connect(url) for _ in range(n - 1)]
            time.sleep(0.5)  # accepted by the server
            assert c.get(url + "/health").status_code == 200
        idle.append(_connect(url))
        time.sleep(0.5)
        with httpx.Client(timeout=30) as c:
            assert c.get(url + "/health").status_code == 503
        for s in idle:
            s.close()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and httpx.get(url + "/health", timeout=30).status_code != 200:
            time.sleep(0.1)
        assert httpx.get(url + "/health", timeout=30).status_code == 200
    finally:
        for s in idle:
            s.close()
        proc.terminate()
        proc.wait(timeout=30)
