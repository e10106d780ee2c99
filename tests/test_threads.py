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
