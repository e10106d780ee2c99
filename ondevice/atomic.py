"""Whole-file writes: a reader, or another process writing the same file, never sees half a file."""

from __future__ import annotations

import os
from pathlib import Path


def _umask() -> int:
    """The process umask (reading it means setting it for an instant)."""
    old = os.umask(0o022)
    os.umask(old)
    return old


def write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` through a temp file of our own (a unique name beside it), then rename.

    Concurrent writers each rename a whole file of their own: the last one wins, none is corrupted.
    """
    import tempfile  # lazily: not needed at start-up

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; the file is the user's like any other
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
