"""Atomic output directories and manifests: nothing half-written survives an error or Ctrl-C (``convert_draft``:
the frame of the draft converters, EAGLE-3 and DFlash)."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from ondevice.errors import OndeviceError, shown


def check_out(out: Path) -> None:
    """Refuse, before any work is done: an existing non-empty ``out``, an empty one that cannot be replaced at
    the end (a mount point, a directory the OS will not move), and an unwritable parent."""
    if out.exists() and not out.is_dir():
        raise OndeviceError(f"{shown(out)}: is a file, not a directory; --out names the directory to write (a new one)")
    if out.exists() and any(out.iterdir()):
        raise OndeviceError(f"{shown(out)}: already exists and is not empty; choose a new --out directory")
    if out.is_dir():
        _check_replaceable(out)
    parent = out.parent if str(out.parent) else Path(".")
    parent = parent.resolve()
    probe = parent
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir() or not os.access(probe, os.W_OK | os.X_OK):
        raise OndeviceError(f"{shown(out)}: cannot write to {shown(probe)}; choose a writable --out directory")


def _check_replaceable(out: Path) -> None:
    """The output is written beside ``out`` and renamed onto it at the end: an existing empty ``out`` must be
    one that can be removed. Probed now by moving it aside and back (the same rename the end does)."""
    hint = f"choose a directory inside it (e.g. --out {out / 'model'}) or a new one"
    if os.path.ismount(out):
        raise OndeviceError(f"{shown(out)}: is a mount point, which cannot be replaced by the output; {hint}")
    aside = out.parent / f".{out.name}.{secrets.token_hex(6)}.probe"
    try:
        os.rename(out, aside)
    except OSError as e:
        raise OndeviceError(f"{shown(out)}: cannot be replaced by the output ({e.strerror or e}); {hint}") from None
    os.rename(aside, out)


def _new_temp_dir(out: Path) -> Path:
    """Create a new, uniquely named directory beside ``out`` with the user's normal permissions.

    ``tempfile.mkdtemp`` would make it mode 0700, and the rename would carry that to ``out``;
    ``os.mkdir`` honours the umask, and ``a failing ``mkdir`` on an existing name keeps it ours alone.
    """
    while True:
        tmp = out.parent / f".{out.name}.{secrets.token_hex(6)}.partial"
        try:
            tmp.mkdir()
            return tmp
        except FileExistsError:
            continue


_interrupted = threading.Event()


@contextlib.contextmanager
def sigint_remembered() -> Iterator[None]:
    """Remember every Ctrl-C (SIGINT) received inside the block, for ``check_interrupted``; SIGTERM and SIGHUP
    (``kill``, a closed terminal), when nobody handles them, stop the block the same way instead of killing the
    process before its temp files are removed.

    A Ctrl-C that lands while llama.cpp calls back into Python (its log callback, called thousands of times
    by the quantizer and at load) raises inside a ctypes callback, where Python prints "Exception ignored"
    and carries on: the conversion would then finish and be kept as if nothing happened. The handler
    still raises ``KeyboardInterrupt`` at once, as the default one does; the flag catches the swallowed ones,
    and their "Exception ignored" tracebacks are not printed (the flag, not a traceback, reports them).
    Outside the main thread (no signal handlers there) the block runs unchanged.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    signals = [signal.SIGINT] + [s for s in (signal.SIGTERM, getattr(signal, "SIGHUP", None))
                                 if s is not None and signal.getsignal(s) == signal.SIG_DFL]
    previous = {s: signal.getsignal(s) for s in signals}

    def handler(signum, frame):
        _interrupted.set()
        raise KeyboardInterrupt

    hook = sys.unraisablehook

    def unraisable(u) -> None:
        if not isinstance(u.exc_value, KeyboardInterrupt):
            hook(u)

    _interrupted.clear()
    for s in signals:
        signal.signal(s, handler)
    sys.unraisablehook = unraisable
    try:
        yield
    finally:
        sys.unraisablehook = hook
        for s, h in previous.items():
            signal.signal(s, h)
        _interrupted.clear()


def check_interrupted() -> None:
    """Raise ``KeyboardInterrupt`` if a Ctrl-C was received (and perhaps swallowed) in ``sigint_remembered``."""
    if _interrupted.is_set():
        raise KeyboardInterrupt


@contextlib.contextmanager
def atomic_dir(out: Path) -> Iterator[Path]:
    """Yield a temp dir beside ``out``; rename it to ``out`` only if the block succeeds and no Ctrl-C was
    received meanwhile (``sigint_remembered``)."""
    check_out(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = _new_temp_dir(out)
    except OSError as e:
        raise OndeviceError(f"{shown(out)}: cannot write there ({e.strerror}); choose a writable --out directory") from e
    try:
        with sigint_remembered():
            yield tmp
            check_interrupted()
        if out.exists():
            out.rmdir()  # empty, checked above
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def write_manifest(directory: Path, manifest: dict) -> None:
    (directory / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def convert_draft(src: str | Path, target: str | Path, out: str | Path, *, arch: str, dtype: str,
                  open_draft: Callable, check: Callable, write: Callable, verify: Callable | None) -> dict:
    """Convert a draft checkpoint for ``target`` into ``out/model.gguf`` + ``out/manifest.json``, atomically:
    ``out`` is refused before any work, the draft and its target are read and checked against each other before
    a byte is written, and nothing is left behind on any error, refusal or Ctrl-C.

    Args:
        src: the draft checkpoint directory; target: its target (HF directory or GGUF, ``target_info``).
        out: a new directory.
        arch, dtype: the GGUF's architecture and matrix dtype (recorded in the manifest).
        open_draft: ``src`` → the draft read and checked on its own.
        check: (draft, target) → the target layer ids it reads (refusing a draft made for another target).
        write: (draft, target, ids, GGUF path) → writes the GGUF; returns the summary.
        verify: (draft, GGUF path, target) → ``summary["verify"]``; None: not verified.
    Returns:
        ``write``'s summary with ``verify``, ``out`` and ``seconds``.
    """
    import time

    from converters.eagle3_source import target_info

    t0 = time.perf_counter()
    out = Path(out)
    check_out(out)
    draft = open_draft(src)
    tgt = target_info(target)
    ids = check(draft, tgt)
    with atomic_dir(out) as tmp:
        summary = write(draft, tgt, ids, tmp / "model.gguf")
        if verify is not None:
            summary["verify"] = verify(draft, tmp / "model.gguf", tgt)
        write_manifest(tmp, {"source": str(Path(src).resolve()), "format": "gguf", "arch": arch,
                             "target": str(tgt.path.resolve()), "target_layers": ids, "dtype": dtype})
    summary["out"] = str(out)
    summary["seconds"] = round(time.perf_counter() - t0, 3)
    return summary
