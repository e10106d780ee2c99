"""The one exception type users see: a single line that names the file and the fix."""

from __future__ import annotations


class OndeviceError(Exception):
    """A user-facing error. ``str(err)`` is one line; the CLI prints it and exits 2."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split()))


def shown(path) -> str:
    """A file or folder as an error message names it: relative to the working directory when inside it,
    ``~/…`` when inside the home directory, else as given (a relative path or a catalog name unchanged). A
    message says no more of this machine's layout than the user typed, and stays short (#41 item 11)."""
    import os

    text = os.fsdecode(os.fspath(path)) if isinstance(path, (str, bytes, os.PathLike)) else str(path)
    if not os.path.isabs(text):
        return text
    full = os.path.normpath(text)
    try:
        cwd = os.getcwd()
    except OSError:  # the working directory was removed
        cwd = None
    for base, prefix in ((cwd, ""), (os.path.expanduser("~"), "~")):
        if not base or os.path.dirname(base) == base:  # unknown, or the root: nothing to shorten
            continue
        if full == base:
            return prefix or "."
        if full.startswith(base.rstrip(os.sep) + os.sep):
            rel = full[len(base.rstrip(os.sep)) + 1 :]
            return f"{prefix}{os.sep}{rel}" if prefix else rel
    return text
