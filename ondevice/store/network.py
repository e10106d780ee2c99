"""Fail fast when a download's server cannot be reached (offline), instead of a client's retries."""

from __future__ import annotations

import os

from ondevice.errors import OndeviceError

PROXY_VARS = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")


def check_reachable(url: str, what: str, fix: str, timeout: float = 5.0) -> None:
    """Open (and close) a TCP connection to ``url``'s host, at most ``timeout`` seconds.

    Skipped behind a proxy, which only the HTTP client knows how to use.

    Args:
        url: the endpoint, e.g. https://huggingface.co.
        what: the start of the error message (what was being done).
        fix: the end of the error message (what to do).
    Raises:
        OndeviceError: "{what} HOST cannot be reached (REASON); {fix}".
    """
    import socket
    from urllib.parse import urlparse

    if any(os.environ.get(k) for k in PROXY_VARS):
        return
    u = urlparse(url)
    host, port = u.hostname or url, u.port or (443 if u.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as e:
        raise OndeviceError(f"{what} {host} cannot be reached ({e.strerror or type(e).__name__}); {fix}") from None
