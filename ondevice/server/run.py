"""Running the server as a process: bind the socket first, serve a loaded runtime with uvicorn until a signal,
and ``launch`` (a subprocess for tests and benchmarks)."""

from __future__ import annotations

import sys

from ondevice.errors import OndeviceError
from ondevice.server.app import Server
from ondevice.server.guard import LOOPBACK

GRACE_SECONDS = 30  # the longest a signal waits for the pass in progress before connections are dropped


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


def serve(runtime, model_id: str, *, host: str = "127.0.0.1", port: int = 8080, api_key: str | None = None,
          max_queue: int = 16, cors_origins: list[str] | None = None, log_level: str = "warning", sock=None) -> None:
    """Serve ``runtime`` until Ctrl-C (the caller closes the runtime afterwards).

    Args:
        runtime: a loaded ``Runtime``.
        model_id: the model name clients use.
        host, port: where to listen (127.0.0.1 by default; anything else prints a warning).
        api_key: require ``Authorization: Bearer api_key`` on /v1 routes.
        max_queue: requests that may wait behind the running one (more get 503).
        cors_origins: browser origins allowed to call the API from other pages ("*" = any).
        sock: a socket from ``open_socket(host, port)`` (bound here when None).
    """
    import uvicorn

    sock = sock or open_socket(host, port)
    port = sock.getsockname()[1]

    loopback = host in LOOPBACK
    if not loopback:
        print(f"warning: serving on {host}:{port}: anyone who can reach this machine can use the model"
              + ("" if api_key else " (no --api-key set)"), file=sys.stderr)
    if cors_origins and "*" in cors_origins:
        print("warning: --cors-origin '*': any web page you open can call this server", file=sys.stderr)
    app = Server(runtime, model_id, api_key=api_key, max_queue=max_queue, cors_origins=cors_origins,
                 loopback_only=loopback)
    if runtime.target.chat_template:
        from ondevice import templates

        templates.warm()  # the first /v1/chat/completions does not wait for the template worker to start
    # On a signal the running job is cancelled at once and ends after the native pass in progress (a long
    # prefill on a busy machine can take seconds); only then is the connection closed. A second Ctrl-C forces.
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=GRACE_SECONDS,
                            lifespan="off", server_header=False)

    class _Uvicorn(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:  # Ctrl-C: end the running generation now, not after a timeout
            from ondevice import templates

            app.engine.close()
            templates.shutdown()  # a chat template rendering now fails at once
            super().handle_exit(sig, frame)

    server = _Uvicorn(config)
    shown = f"[{host}]" if ":" in host else host
    print(f"ondevice serve: {model_id} on http://{shown}:{port}/ (OpenAI API at /v1; Ctrl-C stops)", file=sys.stderr)
    try:
        server.run(sockets=[sock])
    finally:
        app.engine.close()


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
