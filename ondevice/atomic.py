"""Whole-file writes: a reader, or another process writing the same file, never sees half a file, and a crash
or power loss right after the rename leaves the old file or the new one, never an empty or partial one."""

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


def fsync_dir(directory: str | os.PathLike) -> None:
    """Make a rename inside ``directory`` durable (a no-op where folders cannot be opened, e.g. Windows)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on a folder; the data itself was synced
    finally:
        os.close(fd)


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def replacing(path: str | os.PathLike, *, suffix: str = ".tmp") -> Iterator[str]:
    """A temp file of our own beside ``path`` (a unique name) to write whole; when the block ends without an
    exception its data is fsynced, it is renamed onto ``path`` and the folder is synced; when the block raises
    it is removed and ``path`` is untouched. Concurrent writers each rename a whole file of their own: the last
    one wins, none is corrupted.

    Args:
        path: the file to (re)place.
        suffix: the temp file's suffix (``.partial`` for downloads).
    Yields:
        the temp file's path (empty, mode 0666 less the umask, like any file the user makes).
    """
    import tempfile  # lazily: not needed at start-up

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix, dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; the file is the user's like any other
        os.close(fd)
        yield tmp
        _fsync_file(tmp)  # the data reaches the disk before the name does
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` whole (``replacing``)."""
    with replacing(path) as tmp, open(tmp, "w") as f:
        f.write(text)
