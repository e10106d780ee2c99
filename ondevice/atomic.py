"""Whole-file writes: a reader, or another process writing the same file, never sees half a file."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def _umask() -> int:
    """The process umask (reading it means setting it for an instant)."""
    old = os.umask(0o022)
    os.umask(old)
    return old


@contextmanager
def replacing(path: str | os.PathLike) -> Iterator[str]:
    """A temp file of our own beside ``path`` (a unique name) to write whole, renamed onto ``path`` when the block
    ends without an exception and removed when it raises. Concurrent writers each rename a whole file of their
    own: the last one wins, none is corrupted.

    Yields:
        the temp file's path (empty, mode 0666 less the umask, like any file the user makes).
    """
    import tempfile  # lazily: not needed at start-up

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; the file is the user's like any other
        os.close(fd)
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` whole (``replacing``)."""
    with replacing(path) as tmp, open(tmp, "w") as f:
        f.write(text)
