"""The one exception type users see: a single line that names the file and the fix."""

from __future__ import annotations


class OndeviceError(Exception):
    """A user-facing error. ``str(err)`` is one line; the CLI prints it and exits 2."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split()))
