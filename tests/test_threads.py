"""The default thread count leaves the cores other processes use."""

from __future__ import annotations


def test_default_threads_counts_free_physical_cores(monkeypatch):
    from ondevice import threads

    monkeypatch.setattr(threads, "usable_cpus", lambda: 8)
    monkeypatch.setattr(threads, "physical_cores", lambda: 4)  # SMT: 8 logical CPUs on 4 cores
    for busy, want in ((0.0, 4), (3.0, 4), (5.0, 3), (7.0, 1), (30.0, 1)):
        monkeypatch.setattr(threads, "busy_cpus", lambda b=busy: b)
        assert threads.default_threads() == want, (busy, want)
    monkeypatch.setattr(threads, "usable_cpus", lambda: 2)
    monkeypatch.setattr(threads, "physical_cores", lambda: 2)
    monkeypatch.setattr(threads, "busy_cpus", lambda: 1.0)  # one CPU-bound process on a 2-core machine
    assert threads.default_threads() == 1
    monkeypatch.undo()
    from ondevice.backends.llama import LlamaBackend

    assert "default_threads" in LlamaBackend.__init__.__code__.co_names  # the backend's default is this one


def _os_threads(want: int | None = None, settle: float = 0.5, timeout: float = 10.0) -> int:
    """OS threads of this process once the count has held for ``settle`` seconds (given ``want``: as soon as it is
    ``want``; either at most ``timeout``): a freed team's threads and a joined thread leave /proc/self/task a moment
    after they end (a count read at once counted them, and a negative control then saw no new team)."""
    import os
    import time

    t0 = now = time.monotonic()
    last, since = len(os.listdir("/proc/self/task")), now
    while now - t0 < timeout and last != want and (want is not None or now - since < settle):
        time.sleep(0.02)
        n, now = len(os.listdir("/proc/self/task")), time.monotonic()
        if n != last:
            last, since = n, now
    return last


def _worker_counts(rt, freed: bool = True) -> tuple[int, int, int]:
    """OS threads before a request on a new thread, on it before the request and after it (on that thread; with
    ``freed``, waiting up to the timeout for the count it started with)."""
    import threading

    box = []
    before = _os_threads()

    def work():
        box.append(_os_threads())  # this thread, nothing decoded on it yet
        rt.generate("hello there", max_tokens=3, temperature=0)
        box.append(_os_threads(box[0] if freed else None))  # the request has ended, still on this thread

    t = threading.Thread(target=work)
    t.start()
    t.join()
    return before, box[0], box[1]


def _openmp_runtime(tiny_gguf):
    """A 2-thread runtime that has decoded once on this thread (skips where llama.cpp runs without libgomp)."""
    import sys

    import pytest

    import ondevice
    from ondevice import threads

    if not sys.platform.startswith("linux"):
        pytest.skip("OpenMP teams: llama.cpp uses OpenMP on Linux builds only (macOS: ggml's thread pool)")
    rt = ondevice.load(tiny_gguf("llama"), drafter="none", n_ctx=256, threads=2)
    rt.generate("hello there", max_tokens=3, temperature=0)
    if not threads._find_gomp():
        rt.close()
        pytest.skip("this llama.cpp build runs without libgomp: no OpenMP teams to free")
    return rt


def test_a_thread_frees_its_openmp_team_when_its_request_ends(tiny_gguf, monkeypatch):
    """A request on a second thread (as ``serve`` decodes) leaves no OpenMP team behind on either thread: two teams
    on 2 CPUs make libgomp stop spinning (1.5-1.6x slower decodes idle, scripts/bench_spin.py). Negative control:
    with the release patched out, the worker's team thread outlives its request."""
    import ondevice.runtime

    with _openmp_runtime(tiny_gguf) as rt:
        before, start, end = _worker_counts(rt)
        assert end == start, f"the worker's OpenMP team outlived its request ({start} -> {end} OS threads)"
        assert start == before + 1  # the main thread's team (from the first request) was freed too

        monkeypatch.setattr(ondevice.runtime, "release_omp_team", lambda: None)
        _, start, end = _worker_counts(rt, freed=False)
        assert end == start + 1, "negative control: without the release the worker keeps a team thread"


def test_the_team_freed_is_llama_cpps_not_another_libgomps(tiny_gguf, tmp_path, monkeypatch):
    """Another libgomp in the process (a wheel's renamed copy: sentencepiece, torch, scikit-learn bundle one) is not
    the one llama.cpp's teams live in: pausing it freed nothing, and teams piled up again."""
    import ctypes
    import os
    import shutil

    from ondevice import threads

    with _openmp_runtime(tiny_gguf) as rt:
        with open("/proc/self/maps") as f:
            gomp = sorted({ln.split(None, 5)[-1].strip() for ln in f if "/libgomp" in ln})
        decoy = tmp_path / "libgomp-decoy.so.1"  # a second libgomp, first in path order under /tmp
        shutil.copy(gomp[0], decoy)
        ctypes.CDLL(str(decoy), mode=os.RTLD_LOCAL)
        monkeypatch.setattr(threads, "_gomp", None)  # found again, now with the decoy loaded
        rt.generate("hello there", max_tokens=3, temperature=0)  # the main thread's team, freed at its end
        before, start, end = _worker_counts(rt)
        assert end == start, f"the worker's OpenMP team outlived its request ({start} -> {end} OS threads)"
        assert start == before + 1, "the main thread's team outlived its request"


def test_load_frees_the_openmp_team_its_own_decodes_made(tiny_gguf, monkeypatch):
    """``load(draft="auto")`` times the target on the loading thread (``costs.cached_measure``, uncached on a first
    run): that thread's team outlived the load, beside every request of a server decoding on threads of its own."""
    import ondevice
    import ondevice.autodraft

    def timed(target, **_):  # what choose_draft's cost probe does on the loading thread, without a candidate
        target.eval(target.tokenize("hello there, a prompt to time"), logits="last")
        return None, {"drafter": "ngram", "draft": None}

    with _openmp_runtime(tiny_gguf):  # skips without libgomp
        pass
    monkeypatch.setattr(ondevice.autodraft, "choose_draft", timed)
    with ondevice.load(tiny_gguf("llama"), draft="auto", n_ctx=256, threads=2) as rt:
        loaded = _os_threads()
        rt.generate("hello there", max_tokens=3, temperature=0)  # ends by freeing this thread's team
        assert loaded == _os_threads(loaded), "the loading thread kept the team of its cost probe"


def test_embeddings_free_the_openmp_team_they_made(tiny_gguf):
    """``Runtime.embed`` decodes on the caller's thread outside a request's turn (``serve`` runs /v1/embeddings on
    its event loop's executor threads, which live on): that thread's team outlived the call, beside every later
    generation."""
    import threading

    with _openmp_runtime(tiny_gguf) as rt:
        rt.embed("warm up: the embedder's context is made here")
        box = []

        def work():
            box.append(_os_threads())
            rt.embed(["hello there", "another text to embed"])
            box.append(_os_threads(box[0]))

        t = threading.Thread(target=work)
        t.start()
        t.join()
        assert box[1] == box[0], f"the thread's OpenMP team outlived its embeddings ({box[0]} -> {box[1]} OS threads)"
