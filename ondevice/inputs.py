"""Checks on request inputs (prompt, stop strings, integer options): one-line errors, no silent coercion."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

from ondevice.errors import OndeviceError


def check_text(text: str, what: str) -> None:
    """Refuse text that cannot be encoded as UTF-8 (lone surrogates: invalid UTF-8 bytes in argv or a file
    decoded with ``surrogateescape``)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise OndeviceError(
            f"{what} contains {text[e.start]!r} at character {e.start}, which is not valid text "
            "(invalid UTF-8 in the input?); pass UTF-8 text"
        ) from None


def token_ids(prompt: Sequence, vocab_size: int, bos_id: int | None) -> list[int]:
    """Validate a prompt given as token ids: a non-empty sequence of integers inside the vocabulary."""
    import numpy as np

    if isinstance(prompt, (bytes, bytearray)):
        raise OndeviceError("prompt is bytes: decode it to a str, or pass a list of token ids")
    try:
        seq = list(prompt)
    except TypeError:
        raise OndeviceError(f"prompt must be a str or a list of token ids, not {type(prompt).__name__}") from None
    if not seq:
        hint = f" (e.g. [{bos_id}], this model's BOS)" if bos_id is not None else ""
        raise OndeviceError(f"prompt is an empty list of token ids; pass at least one id{hint}, or a string")
    for i, x in enumerate(seq):
        if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)):
            raise OndeviceError(f"prompt token ids must be integers; item {i} is {x!r}")
        if not 0 <= x < vocab_size:
            raise OndeviceError(f"prompt token id {x} (item {i}) is outside the vocabulary (size {vocab_size})")
    return [int(x) for x in seq]


MAX_STOPS = 16  # stop strings per request (OpenAI allows 4; generous, and bounded)
MAX_STOP_CHARS = 512  # characters per stop string


def stop_strings(stop) -> list[str]:
    """``None``, one string or a sequence of strings → a list of strings (at most ``MAX_STOPS``, each at most
    ``MAX_STOP_CHARS`` characters)."""
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    elif isinstance(stop, (bytes, bytearray)):
        raise OndeviceError(f"stop={stop!r}: stop strings are text; pass a str, not bytes")
    try:
        stops = list(stop)
    except TypeError:
        raise OndeviceError(f"stop={stop!r}: pass a string or a list of strings") from None
    if len(stops) > MAX_STOPS:
        raise OndeviceError(f"stop: {len(stops)} stop strings given; pass at most {MAX_STOPS}")
    for s in stops:
        if not isinstance(s, str):
            raise OndeviceError(f"stop={stop!r}: every stop must be a string; {s!r} is a {type(s).__name__}")
        if len(s) > MAX_STOP_CHARS:
            raise OndeviceError(f"stop: a stop string of {len(s)} characters; each may have at most {MAX_STOP_CHARS}")
        check_text(s, "a stop string")
    return stops


def integer(name: str, value, minimum: int, hint: str = "") -> int:
    """An integer option (an integral float such as 8.0 is accepted) that is at least ``minimum``."""
    ok = not isinstance(value, (bool, str, bytes)) and isinstance(value, numbers.Real)  # numpy scalars too
    if not ok or not math.isfinite(value) or int(value) != value or value < minimum:
        raise OndeviceError(f"{name}={value!r}: must be an integer >= {minimum}{hint}")
    return int(value)


def why_missing(path) -> str:
    """Why ``path`` cannot be opened, in words: "a symlink loop", "a broken link to X" or "no such file"."""
    import errno
    import os

    try:
        os.stat(path)
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "a symlink loop (its links lead back to themselves); fix or remove the link"
        if os.path.islink(path):
            return f"a broken link to {os.readlink(path)}"
        return "no such file"
    return "not a regular file"
