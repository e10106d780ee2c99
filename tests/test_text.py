"""Text assembly (``ondevice.text``): stop strings are bounded at request validation and matched in time
linear in the new text (security issue #41 item 7: a 40k-character stop once cost 12 ms per token)."""

from __future__ import annotations

import random
import time

import pytest

from ondevice import GenerateRequest
from ondevice.errors import OndeviceError
from ondevice.inputs import MAX_STOP_CHARS, MAX_STOPS
from ondevice.text import TextAssembler


def _feed_seconds(stop: list[str], pieces: list[str]) -> float:
    """Seconds to feed every piece (one token each), the assembler built beforehand; best of 3."""
    table = {i: p.encode() for i, p in enumerate(pieces)}
    best = float("inf")
    for _ in range(3):
        t = TextAssembler(table.__getitem__, stop)
        t0 = time.perf_counter()
        for i in range(len(pieces)):
            t.feed(i)
        best = min(best, time.perf_counter() - t0)
        assert not t.stopped
    return best


def test_a_long_stop_costs_what_a_short_one_does_per_token():
    """6,400 characters of output that keep partly matching the stops: a 40,000-character stop (longer than any
    request may pass, built here directly) costs about what a 9-character one does. The quadratic suffix check
    it replaces took 5.2 s here against 0.02 s."""
    rng = random.Random(0)
    pieces = ["".join(rng.choice("xy ") for _ in range(8)) for _ in range(800)]
    short = _feed_seconds(["xyxyxyxyz"], pieces)
    long = _feed_seconds(["xy" * 20_000], pieces)
    assert long < 5 * short + 0.05, (long, short)


def test_stops_are_bounded_at_request_validation():
    GenerateRequest(stop=["x" * MAX_STOP_CHARS] * MAX_STOPS)  # at the limits: accepted
    with pytest.raises(OndeviceError, match=f"at most {MAX_STOPS}"):
        GenerateRequest(stop=["a"] * (MAX_STOPS + 1))
    with pytest.raises(OndeviceError, match=f"at most {MAX_STOP_CHARS}") as e:
        GenerateRequest(stop=["a", "x" * (MAX_STOP_CHARS + 1)])
    assert "\n" not in str(e.value)
