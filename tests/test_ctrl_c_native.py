"""Ctrl-C while llama.cpp calls back into Python (its log callback runs during model load and context
creation): raised inside a ctypes callback, KeyboardInterrupt is printed as "Exception ignored" and dropped,
so `ondevice generate` went on to answer with exit 0. ``_ctrl_c_deferred`` holds it until the native call
returns. Simulated with libc's qsort calling a Python comparator (a native call with Python callbacks)."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal

import pytest

from ondevice.backends.llama import _ctrl_c_deferred

CMP = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int))


def _native_call_interrupted_inside_a_callback() -> list[int]:
    """qsort 64 ints; the first comparison sends this process SIGINT (Ctrl-C during the native call)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    calls = []

    def cmp(a, b):
        calls.append(1)
        if len(calls) == 1:
            os.kill(os.getpid(), signal.SIGINT)
        return a[0] - b[0]

    arr = (ctypes.c_int * 64)(*range(64, 0, -1))
    libc.qsort(arr, 64, ctypes.sizeof(ctypes.c_int), CMP(cmp))
    return list(arr)


def test_ctrl_c_inside_a_native_callback_is_delivered_after_the_call(monkeypatch, sigint_default):
    import sys

    dropped = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: dropped.append(u.exc_type))
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    try:  # negative control: without the guard ctypes drops the interrupt
        _native_call_interrupted_inside_a_callback()
    except KeyboardInterrupt:
        pytest.fail("this Python did not drop the interrupt: the test cannot show the guard's effect")
    assert dropped == [KeyboardInterrupt]
    with pytest.raises(KeyboardInterrupt):
        with _ctrl_c_deferred():
            assert _native_call_interrupted_inside_a_callback() == list(range(1, 65))  # callbacks ran whole
    assert dropped == [KeyboardInterrupt]  # nothing more dropped
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
