"""``ondevice serve`` off loopback (issue #41 item 8): an API key or an explicit ``--no-auth``, and a Host
allow-list against DNS rebinding.

Nothing here listens anywhere but 127.0.0.1: the off-loopback rules are tried on the ASGI guard in process,
and on the command line with 192.0.2.1 (RFC 5737 documentation address, never this machine's), refused
before any socket is bound.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

httpx = pytest.importorskip("httpx")


def _serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-P", "-m", "ondevice", "serve", *args], capture_output=True, text=True,
                          timeout=120)


def test_off_loopback_needs_an_api_key_or_an_explicit_no_auth():
    """Before: `--host ADDR` without a key served anyone (a warning only) and --no-auth did not exist."""
    r = _serve("no-such-model", "--host", "192.0.2.1", "--port", "0")
    err = r.stderr.strip()
    assert r.returncode == 2 and len(err.splitlines()) == 1, err
    assert "--api-key" in err and "--no-auth" in err and "192.0.2.1" in err
    r = _serve("no-such-model", "--host", "192.0.2.1", "--port", "0", "--api-key", "k", "--no-auth")
    assert r.returncode == 2 and "contradict" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    # --no-auth is accepted: the run gets as far as binding (which fails: the address is not this machine's)
    r = _serve("no-such-model", "--host", "192.0.2.1", "--port", "0", "--no-auth")
    assert r.returncode == 2 and "cannot listen on 192.0.2.1" in r.stderr, r.stderr


def test_no_auth_warning_says_why():
    from ondevice.server.run import check_exposure, exposure_warning

    check_exposure("0.0.0.0", None, no_auth=True)  # allowed, explicitly
    check_exposure("127.0.0.1", None)  # loopback needs nothing
    w = exposure_warning("0.0.0.0", 8080, None)
    assert "--no-auth" in w and "web page" in w and "browser" in w
    assert "web page" not in exposure_warning("0.0.0.0", 8080, "key") and exposure_warning("127.0.0.1", 8080, None) is None


async def _ok(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def _call(guard, host: str, path: str = "/health", headers: dict | None = None) -> tuple[int, dict]:
    """One request through the ASGI guard in process: (status, JSON body or {})."""
    import json

    sent: list = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    hdrs = [(b"host", host.encode())] + [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    scope = {"type": "http", "method": "GET", "path": path, "root_path": "", "query_string": b"", "headers": hdrs,
             "scheme": "http", "http_version": "1.1", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}
    asyncio.run(guard(scope, receive, send))
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], (json.loads(body) if body.startswith(b"{") else {})


def test_host_allow_list_off_loopback_refuses_rebound_names():
    """Bound to 0.0.0.0: loopback names, IP addresses (no rebinding goes through an IP literal), the bound
    address and --allowed-host names are answered; any other name is a 403 naming the fix.
    Before: off loopback the Host header was not checked at all (and Guard took no allowed_hosts)."""
    from ondevice.server.guard import Guard

    guard = Guard(_ok, api_key="k", cors_origins=[], loopback_only=False, allowed_hosts=["0.0.0.0", "ondevice.lan"])
    for host in ("127.0.0.1:8080", "localhost:8080", "[::1]:8080", "192.168.1.5:8080", "[fe80::1]:8080",
                 "ondevice.lan:8080", "ONDEVICE.LAN.", "0.0.0.0:8080"):
        assert _call(guard, host)[0] == 200, host
    for host in ("evil.example:8080", "attacker.test", "ondevice.lan.evil.example", "192.168.1.5.nip.io", ""):
        status, body = _call(guard, host)
        err = body["error"]
        assert (status, err["code"]) == (403, "forbidden_host"), host
        assert "--allowed-host" in err["message"] and "\n" not in err["message"]
    # an IP host still needs the key on /v1
    assert _call(guard, "192.168.1.5:8080", "/v1/models")[0] == 401
    assert _call(guard, "192.168.1.5:8080", "/v1/models", {"authorization": "Bearer k"})[0] == 200
    # on loopback, IP addresses other than loopback are refused as before, and --allowed-host adds names
    guard = Guard(_ok, api_key=None, cors_origins=[], loopback_only=True, allowed_hosts=["127.0.0.1", "proxy.lan"])
    assert [_call(guard, h)[0] for h in ("localhost", "proxy.lan:80", "192.168.1.5", "evil.example")] == [200, 200, 403, 403]


def test_allowed_host_on_a_real_server(tiny_gguf):
    """--allowed-host NAME on a loopback server: that Host is answered, others still refused (was: no such option)."""
    from ondevice.server.run import launch

    proc, url = launch(str(tiny_gguf("llama")), "--threads", "1", "--n-ctx", "64", "--allowed-host", "proxy.lan")
    try:
        assert httpx.get(url + "/health", headers={"Host": "proxy.lan"}, timeout=30).status_code == 200
        r = httpx.get(url + "/health", headers={"Host": "other.lan"}, timeout=30)
        assert r.status_code == 403 and "--allowed-host other.lan" in r.json()["error"]["message"]
        assert httpx.get(url + "/health", timeout=30).status_code == 200
    finally:
        proc.terminate()
        proc.wait(timeout=30)
