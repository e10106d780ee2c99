"""Text already on the machine, as extra training data for a drafter (``train-heads --text PATH``).

The target reads it teacher-forced: one prefill per piece gives the features and the target's own next-token
distribution at every position, at a fraction of a decode per token (recording an answer costs a decode per
token). The drafter learns the target's law on these contexts; held-out τ is still measured on the target's own
answers only.

``read_texts`` walks the files and folders named, keeps text files by suffix (sources, Markdown, plain text),
skips hidden folders, caches and binaries, and hands out the files in a seeded random order so any budget mixes
many files instead of exhausting the first folder.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np

from ondevice.errors import OndeviceError

SUFFIXES = frozenset(
    ".py .pyi .md .rst .txt .c .h .cc .cpp .hpp .rs .go .java .kt .js .ts .tsx .jsx .swift .m .rb .php .sh .sql .html "
    ".css .toml .yaml .yml .json .tex .cs .scala .lua .r .jl .zig".split())
SKIP_DIRS = frozenset("__pycache__ node_modules .git .hg .svn .venv venv .tox build dist".split())
MAX_FILE = 1 << 20  # bytes: larger files are mostly data, not prose or code
SKIPPED = "files that are empty, over 1 MiB, binary or not UTF-8 are skipped"  # ``read_texts``, for messages


def text_files(paths: Sequence[str | os.PathLike]) -> list[Path]:
    """Every text file under ``paths`` (files are taken as named, whatever their suffix), sorted.

    Raises:
        OndeviceError: a path that does not exist, or no text file found at all.
    """
    found: set[Path] = set()
    for p in map(Path, paths):
        if p.is_file():
            found.add(p)
        elif p.is_dir():
            for root, dirs, files in os.walk(p):
                dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.startswith(".")]
                found.update(Path(root) / f for f in files if Path(f).suffix.lower() in SUFFIXES)
        else:
            raise OndeviceError(f"{p}: no such file or folder (--text takes files or folders of text to train on)")
    if not found:
        raise OndeviceError(f"{', '.join(map(str, paths))}: no text files found (suffixes: .py, .md, .txt, ...)")
    return sorted(found)


def read_texts(paths: Sequence[str | os.PathLike], seed: int = 0) -> Iterator[str]:
    """The contents of ``text_files(paths)`` in a seeded random order; empty, oversized, unreadable and
    non-UTF-8 files are skipped (they are data, not text). Lazy: a budget stops reading."""
    files = text_files(paths)
    for i in np.random.default_rng(seed).permutation(len(files)):
        f = files[int(i)]
        try:
            if not 0 < f.stat().st_size <= MAX_FILE:
                continue
            raw = f.read_bytes()
        except OSError:
            continue
        if b"\0" in raw:
            continue
        try:
            yield raw.decode("utf-8")
        except UnicodeDecodeError:
            continue


def digest(pieces: Iterable[np.ndarray]) -> str:
    """A short hash of the text pieces' token ids, in order, for a fit's checkpoint key: text changed between two
    runs (same token count or not) starts a new fit instead of resuming the old text's one."""
    h = hashlib.sha256()
    for p in pieces:
        a = np.ascontiguousarray(p, np.int64)
        h.update(np.int64(len(a)).tobytes() + a.tobytes())
    return h.hexdigest()[:16]
