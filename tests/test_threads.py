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


def _os_threads() -> int:
    import os

    return len(os.listdir("/proc/self/task"))


def test_a_thread_frees_its_openmp_team_when_its_request_ends(tiny_gguf, monkeypatch):
    """A request on a second thread (as ``serve`` decodes) leaves no OpenMP team behind on either thread: two teams
    on 2 CPUs make libgomp stop spinning (1.5-1.6x slower decodes idle, scripts/bench_spin.py). Negative control:
    with the release patched out, the worker's team thread outlives its request."""
    import sys
    import threading

    import pytest

    import ondevice
    import ondevice.runtime
    from ondevice import threads

    if not sys.platform.startswith("linux"):
        pytest.skip("OpenMP teams: llama.cpp uses OpenMP on Linux builds only (macOS: ggml's thread pool)")
    with ondevice.load(tiny_gguf("llama"), drafter="none", n_ctx=256, threads=2) as rt:
        rt.generate("hello there", max_tokens=3, temperature=0)
        if not threads._find_gomp():
            pytest.skip("this llama.cpp build runs without libgomp: no OpenMP teams to free")

        def counts() -> tuple[int, int]:
            box = []
            before = _os_threads()

            def work():
                box.append(_os_threads())  # this thread, nothing decoded on it yet
                rt.generate("hello there", max_tokens=3, temperature=0)
                box.append(_os_threads())  # the request has ended, still on this thread

            t = threading.Thread(target=work)
            t.start()
            t.join()
            return before, box[0], box[1]

        before, start, end = counts()
        assert end == start, f"the worker's OpenMP team outlived its request ({start} -> {end} OS threads)"
        assert start == before + 1  # the main thread's team (from the first request) was freed too

        monkeypatch.setattr(ondevice.runtime, "release_omp_team", lambda: None)
        _, start, end = counts()
        assert end == start + 1, "negative control: without the release the worker keeps a team thread"
