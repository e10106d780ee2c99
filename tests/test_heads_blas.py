"""The Medusa heads' numpy runs with BLAS on one thread (``drafters.heads.one_blas_thread``): OpenBLAS's spinning
workers took the target's cores after each head step (docs/eagle.md, session 20). Checked where the heads run and
where their cost is timed (``draft="auto"`` judges them by ``seconds_per_token``)."""

from __future__ import annotations

import numpy as np
import pytest

threadpoolctl = pytest.importorskip("threadpoolctl")

from ondevice.drafters import heads as hd  # noqa: E402


def _blas_threads() -> list[int]:
    got = [i["num_threads"] for i in threadpoolctl.threadpool_info() if i["user_api"] == "blas"]
    if not got:
        pytest.skip("numpy's BLAS here is not one threadpoolctl controls (e.g. Accelerate on macOS): nothing to hold")
    return got


def test_seconds_per_token_times_the_heads_on_one_blas_thread():
    seen = []

    class FakeHeads:
        d, s_h = 8, 1.0

        def embed(self, ids):
            return np.zeros((len(ids), 8), np.float32)

        def step(self, k, h, e):
            seen.append(_blas_threads())
            return h

        def draft_logits(self, h):
            return np.zeros((1, 16), np.float32)

    before = _blas_threads()
    hd.seconds_per_token(FakeHeads(), reps=2)
    assert seen and all(t == [1] * len(before) for t in seen)
    assert _blas_threads() == before  # restored after


def test_proposal_runs_on_one_blas_thread(monkeypatch):
    seen = []
    monkeypatch.setattr(hd.Drafter, "proposal", lambda self, ask: seen.append(_blas_threads()))
    before = _blas_threads()
    hd.HeadsDrafter.proposal(object.__new__(hd.HeadsDrafter), None)
    assert seen == [[1] * len(before)] and _blas_threads() == before
