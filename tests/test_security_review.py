"""Findings of the security review of issue #41's hardening (each test failed before its fix)."""

from __future__ import annotations

import asyncio
import json


async def _ok(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def _call(guard, host: str, path: str = "/health", method: str = "POST", headers: dict | None = None) -> int:
    """One request through the ASGI guard in process: its status."""
    sent: list = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    hdrs = [(b"host", host.encode())] + [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    scope = {"type": "http", "method": method, "path": path, "root_path": "", "query_string": b"", "headers": hdrs,
             "scheme": "http", "http_version": "1.1", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}
    asyncio.run(guard(scope, receive, send))
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    if sent[0]["status"] != 200:
        json.loads(body)  # refusals are JSON errors
    return sent[0]["status"]


def test_api_key_guards_every_model_route_not_only_v1():
    """Before: only paths starting with /v1 needed the key, so llama.cpp's ``POST /rerank`` (the same reranker
    as /v1/rerank) ran the model for anyone on the network of a server started with --api-key."""
    from ondevice.server.guard import Guard

    guard = Guard(_ok, api_key="k", cors_origins=[], loopback_only=False, allowed_hosts=["0.0.0.0"])
    for path in ("/rerank", "/v1/rerank", "/anything/else", "//v1/chat/completions"):
        assert _call(guard, "192.168.1.5:8080", path) == 401, path
        assert _call(guard, "192.168.1.5:8080", path, headers={"authorization": "Bearer k"}) == 200, path
    # the chat page and the health check stay open (the page asks for the key itself)
    assert _call(guard, "192.168.1.5:8080", "/", method="GET") == 200
    assert _call(guard, "192.168.1.5:8080", "/health", method="GET") == 200
    assert _call(guard, "192.168.1.5:8080", "/rerank", method="OPTIONS") == 200


def test_bracketed_host_with_trailing_junk_is_not_loopback():
    """Before: a Host of ``[::1]evil.example`` was read as ``::1`` and answered as a loopback name."""
    from ondevice.server.guard import Guard

    guard = Guard(_ok, api_key=None, cors_origins=[], loopback_only=True, allowed_hosts=["127.0.0.1"])
    for host in ("[::1]evil.example", "[::1].evil.example:80", "[::1]:80x", "[::1]:"):
        assert _call(guard, host) == 403, host
    for host in ("[::1]", "[::1]:8080", "[::1]:80", "LOCALHOST.", "127.0.0.1.:8080", "localhost:8080"):
        assert _call(guard, host) == 200, host
    for host in ("localhost.evil.example", "127.0.0.1.nip.io", "evil.example:80:localhost", "", "[::2]:80"):
        assert _call(guard, host) == 403, host


def _gguf(n_kv: int, body: bytes, n_tensors: int = 0) -> bytes:
    import struct

    return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv) + body


def test_gguf_file_refuses_header_counts_before_gguf_reader(tmp_path):
    """``ondevice info`` reads through ``GGUFFile`` (gguf.GGUFReader), which trusts every count. Before: a 65-byte
    file declaring an array of 2**62 bytes made it allocate for minutes (6.6 GB after 120 s), and arrays nested
    50,000 deep surfaced as a RecursionError. Now the capped header walk refuses them first, in well under a
    second, with one line naming the file (run in a child so that the old behaviour fails the test by its
    timeout instead of eating this machine's memory)."""
    import struct
    import subprocess
    import sys

    def key(name: bytes) -> bytes:
        return struct.pack("<Q", len(name)) + name

    cases = {
        "hugecount.gguf": (_gguf(1, key(b"z") + struct.pack("<IIQ", 9, 0, 1 << 62) + b"\0" * 16), "4611686018427387904"),
        "deep.gguf": (_gguf(1, key(b"x") + struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * 5000
                            + struct.pack("<IQ", 0, 0)), "nested more than"),
        "tensors.gguf": (_gguf(0, b"\0" * 64, n_tensors=1 << 40), "1099511627776 tensors"),
    }
    for name, (data, says) in cases.items():
        path = tmp_path / name
        path.write_bytes(data)
        code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))\n"
                "from ondevice.errors import OndeviceError\nfrom ondevice.formats.gguf import GGUFFile\n"
                "try:\n    GGUFFile(sys.argv[1])\nexcept OndeviceError as e:\n    print(e)\n")
        r = subprocess.run([sys.executable, "-P", "-c", code, str(path)], capture_output=True, text=True, timeout=60)
        out = r.stdout.strip()
        assert r.returncode == 0 and str(path) in out and says in out and "\n" not in out, (name, out, r.stderr[-300:])


def test_deeply_nested_json_body_is_a_400():
    """Before: a body of 100,000 '[' raised RecursionError out of ``read_body`` (an unhandled 500)."""
    import pytest

    from ondevice.server.driver import read_body
    from ondevice.server.errors import ApiError

    class Request:
        headers: dict = {}

        async def stream(self):
            yield b"[" * 100_000

    with pytest.raises(ApiError) as e:
        asyncio.run(read_body(Request()))
    assert e.value.status == 400 and "nested too deeply" in str(e.value)


def test_sandbox_reason_escapes_the_programs_control_characters():
    """The eval prints ``reason()`` (the last line the model's program wrote to stderr) on the terminal. Before:
    an escape sequence in it reached the terminal as is (OSC 52 writes the clipboard in many terminals; a bidi
    override reorders the line)."""
    from ondevice.quality.sandbox import SandboxResult

    line = "AssertionError\x1b]52;c;cHduZWQ=\x07 \x1b[2J\u202eok\x9b"
    r = SandboxResult(ok=False, returncode=1, timed_out=False, stdout="", stderr="Traceback\n" + line + "\n", seconds=0.1)
    why = r.reason()
    assert why.isprintable() and why.startswith("AssertionError") and "\\x1b]52;c;cHduZWQ=\\x07" in why, why
    assert "\\u202e" in why and "\\x9b" in why
    ok = SandboxResult(ok=False, returncode=1, timed_out=False, stdout="", stderr="NameError: name 'é' is not defined\n",
                       seconds=0.1)
    assert ok.reason() == "NameError: name 'é' is not defined"


def test_template_error_from_the_model_file_is_escaped_and_bounded():
    """``raise_exception`` text comes from the model file and ends in the one-line error the CLI prints. Before:
    escape sequences and newlines in it reached the terminal as is, at any length."""
    import pytest

    from ondevice.errors import OndeviceError
    from ondevice.templates import render

    hostile = "{{ raise_exception('bad\\x1b]52;c;cHduZWQ=\\x07\\nsecond line\\u202e' ~ 'x' * 100000) }}"
    with pytest.raises(OndeviceError) as e:
        render(hostile, [{"role": "user", "content": "hi"}], source="m.gguf")
    msg = str(e.value)
    assert msg.isprintable() and "\\x1b]52;c;cHduZWQ=\\x07\\x0asecond line\\u202e" in msg, msg[:300]
    assert len(msg) < 3000
