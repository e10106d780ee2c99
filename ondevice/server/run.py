"""Running the server as a process: bind the socket first, serve a loaded runtime with uvicorn until a signal,
and ``launch`` (a subprocess for tests and benchmarks)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from ondevice.errors import OndeviceError
from ondevice.server.app import Server
from ondevice.server.driver import READ_SECONDS
from ondevice.server.guard import LOOPBACK

GRACE_SECONDS = 30  # the longest a signal waits for the pass in progress before connections are dropped
NO_AUTH_WHY = ("without an API key (--no-auth): anyone on the network can use the model, and so can any web page "
               "that a browser on the network opens (it can send requests to this address)")


def check_exposure(host: str, api_key: str | None, no_auth: bool = False) -> None:
    """Refuse to serve other machines without an API key unless ``no_auth`` says so explicitly.

    Raises:
        OndeviceError: ``host`` is not loopback and neither ``api_key`` nor ``no_auth`` is given, or both are.
    """
    if api_key and no_auth:
        raise OndeviceError("--api-key and --no-auth contradict each other; give one of them")
    if host not in LOOPBACK and not api_key and not no_auth:
        raise OndeviceError(f"--host {host} lets other machines reach the server: set --api-key KEY (or "
                            "ONDEVICE_API_KEY) so only clients holding it can use the model, or pass --no-auth to "
                            "serve without one")


def exposure_warning(host: str, port: int, api_key: str | None) -> str | None:
    """The warning printed when serving off loopback (None on loopback)."""
    if host in LOOPBACK:
        return None
    return (f"warning: serving on {host}:{port}: anyone who can reach this machine can use the model"
            + ("" if api_key else "; " + NO_AUTH_WHY))


def open_socket(host: str = "127.0.0.1", port: int = 8080):
    """Bind the listening socket (before the model loads, so a busy port fails fast).

    Returns:
        A bound ``socket.socket`` to pass to ``serve(sock=...)``.
    Raises:
        OndeviceError: the address cannot be resolved or the port is in use.
    """
    import socket

    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise OndeviceError(f"--host {host}: cannot resolve this address ({e.strerror})") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise OndeviceError(f"cannot listen on {host}:{port}: {e.strerror}; choose another --port or stop the "
                            "program that holds it") from None
    return sock


def serve(models, model_id: str | None = None, *, host: str = "127.0.0.1", port: int = 8080,
          api_key: str | None = None, no_auth: bool = False, allowed_hosts: Sequence[str] = (), max_queue: int = 16,
          cors_origins: list[str] | None = None, read_seconds: float | None = None,
          max_connections: int | None = None, log_level: str = "warning", sock=None) -> None:
    """Serve until Ctrl-C (the caller frees the models afterwards: ``Models.close_all`` or ``Runtime.close``).

    Args:
        models: the served models (``ondevice.server.models.Models``), or one loaded ``Runtime`` served as
            ``model_id`` until exit.
        model_id: with a ``Runtime``: the model name clients use.
        host, port: where to listen (127.0.0.1 by default; anything else prints a warning).
        api_key: require ``Authorization: Bearer api_key`` (or ``x-api-key``) on /v1 routes (needed off loopback).
        no_auth: serve off loopback without an API key (a warning says what that exposes).
        allowed_hosts: Host header names to answer besides loopback names, IP addresses and ``host``
            (``--allowed-host``: a name this machine is reached by, e.g. through a proxy).
        max_queue: requests that may wait per model behind its running one (more get 503).
        cors_origins: browser origins allowed to call the API from other pages ("*" = any).
        read_seconds: the longest a client may take to send a request (its head, then its body; default
            ``driver.READ_SECONDS``).
        max_connections: open connections at most (more get 503; default ``connections.max_connections``).
        sock: a socket from ``open_socket(host, port)`` (bound here when None).
    """
    import uvicorn

    from ondevice.server import connections
    from ondevice.server.models import Models

    check_exposure(host, api_key, no_auth)
    read_seconds = read_seconds or READ_SECONDS
    sock = sock or open_socket(host, port)
    port = sock.getsockname()[1]

    loopback = host in LOOPBACK
    warning = exposure_warning(host, port, api_key)
    if warning:
        print(warning, file=sys.stderr)
    if cors_origins and "*" in cors_origins:
        print("warning: --cors-origin '*': any web page you open can call this server", file=sys.stderr)
    one = None if isinstance(models, Models) else models
    app = Server(one, model_id, models=None if one is not None else models, api_key=api_key, max_queue=max_queue,
                 cors_origins=cors_origins, loopback_only=loopback, allowed_hosts=[host, *allowed_hosts],
                 read_seconds=read_seconds)
    from ondevice import templates

    templates.warm()  # the first chat request does not wait for the template worker to start
    # On a signal the running jobs are cancelled at once and end after the native pass in progress (a long
    # prefill on a busy machine can take seconds); only then is the connection closed. A second Ctrl-C forces.
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=GRACE_SECONDS,
                            lifespan="off", server_header=False,
                            **connections.uvicorn_options(max_connections or connections.max_connections(max_queue),
                                                          read_seconds))

    class _Uvicorn(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:  # Ctrl-C: end the running generation now, not after a timeout
            app.models.close()
            templates.shutdown()  # a chat template rendering now fails at once
            super().handle_exit(sig, frame)

    server = _Uvicorn(config)
    shown = f"[{host}]" if ":" in host else host
    names = ", ".join(app.models.ids)
    print(f"ondevice serve: {names} on http://{shown}:{port}/ (OpenAI and Anthropic APIs at /v1; Ctrl-C stops)",
          file=sys.stderr)
    try:
        server.run(sockets=[sock])
    finally:
        app.models.close()


def launch(model: str, *args: str, host: str = "127.0.0.1", api_key: str | None = None, timeout: float = 120.0,
           stderr=None):
    """Start ``ondevice serve MODEL ARGS`` in a subprocess on a free loopback port and wait until it answers.

    Args:
        model: the model argument of ``ondevice serve``.
        args: further command-line options (e.g. "--n-ctx", "512").
        host: the address to bind (passed as --host) and to poll.
        api_key: passed through the ONDEVICE_API_KEY environment variable (not the command line).
        timeout: seconds to wait for /health.
        stderr: a file for the server's stderr (default: a temporary file, quoted if it fails to start).
    Returns:
        ``(process, base_url)``; terminate the process when done.
    Raises:
        OndeviceError: the server exited or did not answer in time (its stderr tail is in the message).
    """
    import os
    import socket
    import subprocess
    import tempfile
    import time
    import urllib.request

    with socket.socket() as s:
        s.bind((host, 0))
        port = s.getsockname()[1]
    env = {**os.environ, **({"ONDEVICE_API_KEY": api_key} if api_key else {})}
    log = stderr if stderr is not None else tempfile.TemporaryFile()
    proc = subprocess.Popen([sys.executable, "-P", "-m", "ondevice", "serve", model, "--host", host, "--port", str(port), *args],
                            stdout=subprocess.DEVNULL, stderr=log, env=env)
    url = f"http://{host}:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            time.sleep(0.1)
    proc.kill()
    proc.wait()
    log.seek(0)
    tail = " | ".join(log.read().decode("utf-8", "replace").strip().splitlines()[-3:])
    raise OndeviceError(f"`ondevice serve {model}` did not start on port {port}: {tail or 'no output'}")
