"""``BatchEngine`` under interruption: Ctrl-C in a reader, an error in one slot's prefill, a failed batched
decode, and a runtime closed mid-batch leave every other slot's answer exact (token for token, or an exact
prefix for a request that was cut), and the engine answers exactly afterwards (no stale cells)."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

import ondevice
from ondevice.batching import BatchEngine
from ondevice.errors import OndeviceError

PROMPTS = ["Three primary colours are", "def fibonacci(n):", "Once upon a time, in a small village,"]
OPTS = dict(max_tokens=24, temperature=0)


@pytest.fixture(scope="module")
def alone(tiny_gguf):
    path = tiny_gguf("llama")
    with ondevice.load(path, drafter="none", n_ctx=256, threads=1) as rt:
        want = [rt.generate(p, **OPTS).tokens for p in PROMPTS]
    assert all(len(w) == OPTS["max_tokens"] for w in want)  # no early end: every slot is cut where planted
    return path, want


def _engine(path, n=3):
    rt = ondevice.load(path, drafter="none", parallel=n, n_ctx=256, threads=1)
    return rt, BatchEngine(rt)


def _drain(stream):
    for _ in stream:
        pass
    return stream.tokens


@pytest.mark.skipif(not hasattr(signal, "pthread_kill"), reason="needs POSIX signals")
def test_ctrl_c_in_one_reader_cancels_its_slot_only(alone):
    path, want = alone
    rt, eng = _engine(path)
    with rt:
        eng.on_step = lambda ids: time.sleep(0.02)  # the reader below waits for chunks most of the time
        with rt._lock:
            streams = [eng.stream(p, **OPTS) for p in PROMPTS]
        it = iter(streams[1])
        next(it)
        timer = threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGINT))
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            for _ in it:  # Ctrl-C arrives while this thread waits for the slot's next chunk
                pass
        timer.join()
        assert streams[1].cancelled  # leaving the stream by the exception cancelled its request
        assert [_drain(streams[i]) for i in (0, 2)] == [want[0], want[2]]
        cut = streams[1]
        assert cut.stats.stop_reason == "cancelled" and 0 < len(cut.tokens) < len(want[1])
        assert cut.tokens == want[1][: len(cut.tokens)]
        assert eng.active == 0
        assert [r.tokens for r in eng.generate_many(PROMPTS, **OPTS)] == want  # and the engine goes on exactly


def test_an_error_in_one_slots_prefill_leaves_the_others_exact(alone, monkeypatch):
    path, want = alone
    rt, eng = _engine(path)
    with rt:
        real = rt.target.eval_seqs

        def eval_seqs(items, hidden=False, outputs=None):
            if outputs is not None and items[0][0] == 1:  # the prefill of sequence 1's prompt
                raise OndeviceError("planted prefill failure")
            return real(items, hidden, outputs)

        monkeypatch.setattr(rt.target, "eval_seqs", eval_seqs)
        with rt._lock:
            streams = [eng.stream(p, **OPTS) for p in PROMPTS]
        with pytest.raises(OndeviceError, match="planted"):
            _drain(streams[1])
        assert streams[1].stats.stop_reason == "error" and streams[1].tokens == []
        assert [_drain(streams[i]) for i in (0, 2)] == [want[0], want[2]]
        monkeypatch.setattr(rt.target, "eval_seqs", real)
        assert [r.tokens for r in eng.generate_many(PROMPTS, **OPTS)] == want


def test_a_failed_batched_decode_ends_the_running_slots_and_leaves_no_stale_cells(alone, monkeypatch):
    path, want = alone
    rt, eng = _engine(path)
    with rt:
        real, calls = rt.target.eval_seqs, []

        def eval_seqs(items, hidden=False, outputs=None):
            if outputs is None:
                calls.append(len(items))
                if len(calls) == 5:  # the fifth batched step: llama_decode fails (e.g. out of memory)
                    raise OndeviceError("planted decode failure")
            return real(items, hidden, outputs)

        monkeypatch.setattr(rt.target, "eval_seqs", eval_seqs)
        with rt._lock:
            streams = [eng.stream(p, **OPTS) for p in PROMPTS]
        for s, w in zip(streams, want, strict=True):
            with pytest.raises(OndeviceError, match="planted"):
                _drain(s)
            assert s.stats.stop_reason == "error" and s.tokens == w[:4]  # exact up to the failed step
        assert eng.active == 0
        # the sequences were emptied (what a failed decode left there is unknown): a follow-up that would reuse
        # their prefix evaluates it again and answers as alone
        assert [r.tokens for r in eng.generate_many(PROMPTS, **OPTS)] == want


def test_closing_the_runtime_mid_batch_cuts_every_answer_at_an_exact_prefix(alone):
    path, want = alone
    rt, eng = _engine(path)
    eng.on_step = lambda ids: time.sleep(0.01)
    with rt._lock:
        streams = [eng.stream(p, **OPTS) for p in PROMPTS]
    next(iter(streams[0]))
    rt.close()  # serve's shutdown (Ctrl-C) cancels the batch the same way
    for s, w in zip(streams, want, strict=True):
        _drain(s)
        assert s.stats.stop_reason == "cancelled" and s.tokens == w[: len(s.tokens)] and len(s.tokens) < len(w)
