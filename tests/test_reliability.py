"""Reliability (issue #13): no crash, no silent corruption, no stuck runtime, under Ctrl-C, misuse and odd sizes.

One regression test per defect (``test_01_...`` to ``test_13_...``), then a fault-injection test that
delivers real SIGINTs to a subprocess at chosen native calls, and the CLI under a closed pipe and Ctrl-C.
Anything that crashed the process before the fix runs in a subprocess, so that it fails instead of
killing the test session.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import PROMPT

import ondevice
from ondevice.errors import OndeviceError

TESTS = Path(__file__).resolve().parent
ROOT = Path(ondevice.__file__).resolve().parent.parent  # the code under test (subprocesses import it too)


def _python(code: str, *args: str, timeout: int = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``code`` (which may import this module's helpers) in a fresh interpreter."""
    full_env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(TESTS), os.environ.get("PYTHONPATH", "")]),
                **(env or {})}
    return subprocess.run([sys.executable, "-P", "-c", textwrap.dedent(code), *args], capture_output=True, text=True,
                          timeout=timeout, env=full_env)


def _long_ids(rt, n: int) -> list[int]:
    ids = rt.tokenize(PROMPT)
    return (ids + rt.tokenize(" " + PROMPT, add_bos=False) * n)[:n]


# -- 1. small contexts ------------------------------------------------------------------------------
def test_01_small_context_never_aborts_and_a_pair_agrees_on_one_context(tiny_gguf, tiny_mlx):
    """llama.cpp rounds n_ctx=128 up to 256 but caps n_batch at 128: a 200-token prompt (and a draft
    catching up on it in one eval) used to hit GGML_ASSERT (SIGABRT)."""
    r = _python("""
        import sys, llama_cpp, ondevice
        from test_reliability import _long_ids
        target, draft = sys.argv[1:3]
        with ondevice.load(target, drafter="none", n_ctx=128, threads=1) as rt:
            ids = _long_ids(rt, 200)
            print("plain", len(rt.generate(ids, max_tokens=4, temperature=0, gamma=0).tokens))
            assert rt.target.n_batch <= llama_cpp.llama_n_batch(rt.target._ctx), rt.target.n_batch
        with ondevice.load(target, draft, n_ctx=128, threads=1) as rt:
            res = rt.generate(ids, max_tokens=8, temperature=0, gamma=3)
            print("pair", len(res.tokens), res.stats.drafted > 0)
    """, str(tiny_gguf("llama")), str(tiny_gguf("llama_draft")))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "plain 4" in r.stdout and "pair 8 True" in r.stdout
    # A GGUF target (its context rounded up to 256) with an MLX draft (exactly 128): one context, the smaller.
    pytest.importorskip("mlx.core")
    with ondevice.load(tiny_gguf("llama"), tiny_mlx("llama_draft"), n_ctx=128, threads=1) as rt:
        assert rt.target.n_ctx == 256 and rt.drafter.backend.n_ctx == 128 and rt.n_ctx == 128
        with pytest.raises(OndeviceError, match="n_ctx is 128"):
            rt.generate(_long_ids(rt, 200), max_tokens=4)
        res = rt.generate(_long_ids(rt, 100), max_tokens=100, temperature=0, gamma=3)
        assert res.stats.stop_reason in ("context", "eos") and len(res.tokens) <= 128 - 100 + 1  # the last one pending


# -- 2. the cost probe ------------------------------------------------------------------------------
class _Trip:
    """Wraps a backend's ``eval``: raise KeyboardInterrupt after its n-th call (the call itself completes)."""

    def __init__(self, backend, n: int) -> None:
        self.backend, self.n, self.calls = backend, n, 0
        self.real = backend.eval
        backend.eval = self

    def __call__(self, *a, **kw):
        out = self.real(*a, **kw)
        self.calls += 1
        if self.calls == self.n:
            raise KeyboardInterrupt
        return out

    def remove(self) -> None:
        del self.backend.eval


def test_02_interrupted_cost_probe_leaves_nothing_stale(tiny_gguf, monkeypatch, tmp_path):
    monkeypatch.setenv("ONDEVICE_HOME", str(tmp_path))  # no cached costs: the first auto request probes
    with ondevice.load(tiny_gguf("llama"), drafter="ngram", threads=1) as rt:
        ref = rt.generate(PROMPT, max_tokens=12, temperature=0, gamma=0)
        trip = _Trip(rt.target, 4)  # inside measure(): after the synthetic prefix and the warm-up
        with pytest.raises(KeyboardInterrupt):
            rt.generate(PROMPT, max_tokens=12, temperature=0, gamma="auto")
        trip.remove()
        assert rt.generate(PROMPT, max_tokens=12, temperature=0, gamma=0).tokens == ref.tokens
        res = rt.generate(PROMPT, max_tokens=12, temperature=0, gamma="auto")
        assert res.tokens == ref.tokens and res.stats.probe_seconds > 0


def test_02_cost_probe_fits_a_small_context(tiny_mlx, monkeypatch, tmp_path):
    """An MLX context of 64 cannot hold the default probe (64 + 16 tokens): it shrinks to fit."""
    pytest.importorskip("mlx.core")
    monkeypatch.setenv("ONDEVICE_HOME", str(tmp_path))
    with ondevice.load(tiny_mlx("llama"), drafter="ngram", n_ctx=64, threads=1) as rt:
        ref = rt.generate(PROMPT, max_tokens=12, temperature=0, gamma=0)
        res = rt.generate(PROMPT, max_tokens=12, temperature=0, gamma="auto")
        assert res.tokens == ref.tokens and res.stats.probe_seconds > 0
        assert rt.target.n_past == len(rt.tokenize(PROMPT)) + 11  # the cache holds this request, not the probe
    from ondevice.backends.mlx import MLXBackend
    from ondevice.costs import measure

    tiny = MLXBackend(tiny_mlx("llama"), n_ctx=3, device="cpu")
    c = measure(tiny, reps=1)
    assert sorted(c.target_seconds) == [1, 2] and len(c.verify_costs(8)) == 8 and tiny.n_past == 0
    tiny.close()


# -- 3. Ctrl-C between llama_decode and the bookkeeping -----------------------------------------------
class _NativeTrip:
    """Stands in for a backend's llama_cpp module: after the n-th call of ``name`` returns, ``action()``."""

    def __init__(self, backend, name: str, n: int, action) -> None:
        self._lib, self._name, self._n, self._action, self.calls = backend._lib, name, n, action, 0
        self._backend = backend
        backend._lib = self

    def __getattr__(self, attr):
        real = getattr(self._lib, attr)
        if attr != self._name:
            return real

        def call(*a):
            out = real(*a)
            self.calls += 1
            if self.calls == self._n:
                self._action()
            return out

        return call

    def remove(self) -> None:
        self._backend._lib = self._lib


def _raise_interrupt():
    raise KeyboardInterrupt


def test_03_ctrl_c_right_after_llama_decode_keeps_the_runtime_usable(tiny_gguf):
    """A KeyboardInterrupt between llama_decode returning and the position bookkeeping: the next request
    that continues from there (the same prompt, or the prompt plus what was streamed) must be exact."""
    with ondevice.load(tiny_gguf("llama"), drafter="none", threads=1) as fresh:
        ids = fresh.tokenize(PROMPT)
        ref = fresh.generate(ids, max_tokens=16, temperature=0, gamma=0).tokens
    with ondevice.load(tiny_gguf("llama"), drafter="none", threads=1) as rt:
        trip = _NativeTrip(rt.target, "llama_decode", 1, _raise_interrupt)  # the prefill's decode
        with pytest.raises(KeyboardInterrupt):
            rt.generate(ids, max_tokens=16, temperature=0, gamma=0)
        trip.remove()
        assert rt.generate(ids, max_tokens=16, temperature=0, gamma=0).tokens == ref
        rt.reset()
        streamed = []
        trip = _NativeTrip(rt.target, "llama_decode", 5, _raise_interrupt)  # a decode step
        with pytest.raises(KeyboardInterrupt):
            for chunk in rt.stream(ids, max_tokens=16, temperature=0, gamma=0):
                streamed += chunk.tokens
        trip.remove()
        assert streamed == ref[: len(streamed)] and len(streamed) == 3
        assert rt.generate(ids + streamed, max_tokens=16 - len(streamed), temperature=0, gamma=0).tokens == ref[3:]
        rt.reset()
        assert rt.generate(ids, max_tokens=16, temperature=0, gamma=0).tokens == ref


# -- 4. abandoned streams ---------------------------------------------------------------------------
def test_04_an_abandoned_stream_releases_the_slot(tiny_gguf):
    with ondevice.load(tiny_gguf("llama"), drafter="ngram", threads=1) as rt:
        ref = rt.generate(PROMPT, max_tokens=8, temperature=0)
        for _ in rt.stream(PROMPT, max_tokens=200, temperature=0):
            break
        assert rt.last_stats.stop_reason == "cancelled"
        got = []
        other = threading.Thread(target=lambda: got.append(rt.generate(PROMPT, max_tokens=8, temperature=0).tokens),
                                 daemon=True)
        other.start()
        other.join(timeout=60)
        assert got == [ref.tokens], "another thread waited for an abandoned stream"
        s = rt.stream(PROMPT, max_tokens=200, temperature=0)  # kept alive, left unfinished
        next(s)
        assert rt.generate(PROMPT, max_tokens=8, temperature=0).tokens == ref.tokens  # same thread: ends it
        assert list(s) == [] and s.stats.stop_reason == "cancelled"
        next(rt.stream(PROMPT, max_tokens=200, temperature=0))
    # close() (from __exit__) ran although a stream was left unfinished


def test_04_closing_a_stream_from_another_thread_mid_pass(tiny_gguf, monkeypatch):
    """``Stream.close()`` from a thread other than the one inside ``next()`` (a UI's stop button) used to raise
    "generator already executing"; it now ends the request right after the pass in flight."""
    with ondevice.load(tiny_gguf("llama"), drafter="none", threads=1) as rt:
        ref = rt.generate(PROMPT, max_tokens=8, temperature=0)
        s = rt.stream(PROMPT, max_tokens=200, temperature=0)
        next(s)
        inside, go = threading.Event(), threading.Event()
        real = rt.target.eval

        def held(*a, **k):  # the iterating thread parks inside a target pass until the close has happened
            inside.set()
            assert go.wait(30)
            return real(*a, **k)

        monkeypatch.setattr(rt.target, "eval", held)
        got: list = []
        t = threading.Thread(target=lambda: got.append(list(s)), daemon=True)
        t.start()
        assert inside.wait(30)
        s.close()
        go.set()
        t.join(30)
        monkeypatch.undo()
        assert not t.is_alive() and len(got[0]) <= 1 and s.stats.stop_reason == "cancelled"
        assert rt.generate(PROMPT, max_tokens=8, temperature=0).tokens == ref.tokens


def test_04_next_waits_for_a_close_from_another_thread(tiny_gguf, monkeypatch):
    """A close() from another thread between two chunks runs the generator's cleanup there; the iterating
    thread's next() meanwhile used to raise "generator already executing": it now waits, and the stream ends."""
    with ondevice.load(tiny_gguf("llama"), drafter="none", threads=1) as rt:
        s = rt.stream(PROMPT, max_tokens=200, temperature=0)
        next(s)
        inside, go = threading.Event(), threading.Event()
        real = rt.slot.finish

        def held(*a, **k):  # the closing thread parks inside the generator's cleanup
            inside.set()
            assert go.wait(30)
            return real(*a, **k)

        monkeypatch.setattr(rt.slot, "finish", held)
        closer = threading.Thread(target=s.close, daemon=True)
        closer.start()
        assert inside.wait(30)
        got: list = []

        def iterate():
            try:
                got.append(list(s))
            except Exception as e:  # noqa: BLE001 - the test reports it
                got.append(e)

        t = threading.Thread(target=iterate, daemon=True)
        t.start()
        t.join(0.5)
        go.set()
        closer.join(30)
        t.join(30)
        monkeypatch.undo()
        assert not t.is_alive() and got == [[]] and s.stats.stop_reason == "cancelled", got


def test_04_cli_under_a_closed_pipe_exits_quietly(tiny_gguf):
    cmd = (f"{sys.executable} -P -m ondevice generate {tiny_gguf('llama')} -p '{PROMPT}' --max-tokens 300 "
           f"--temperature 0 --no-spec --threads 1 | head -c 20; echo \" rc=${{PIPESTATUS[0]}}\"")
    r = subprocess.run(["bash", "-c", cmd], capture_output=True, timeout=300)
    assert r.stdout.rstrip().endswith((b" rc=0", b" rc=141")), r.stdout
    assert r.stderr == b"", r.stderr


# -- 5. use after close -----------------------------------------------------------------------------
def test_05_use_after_close_is_a_clear_error_also_for_a_waiting_thread(tiny_gguf):
    r = _python("""
        import sys, threading, ondevice
        rt = ondevice.load(sys.argv[1], drafter="none", threads=1)
        s = rt.stream("The model draft", max_tokens=50, temperature=0)
        next(s)  # this thread holds the slot
        outcome = []
        def waiting():
            try:
                outcome.append(len(rt.generate("The model", max_tokens=4, temperature=0).tokens))
            except ondevice.OndeviceError as e:
                outcome.append(str(e))
        t = threading.Thread(target=waiting)
        t.start()
        t.join(0.5)  # now it waits for the slot
        rt.close()
        t.join(60)
        print("waiting thread:", outcome)
        for call in (lambda: rt.generate("hi"), lambda: rt.tokenize("hi"), rt.reset,
                     lambda: rt.chat([{"role": "user", "content": "hi"}])):
            try:
                call()
                print("no error")
            except ondevice.OndeviceError as e:
                print("error:", e)
        rt.close()
        print("closed twice")
        try:
            rt.target.eval([1])  # the backend itself refuses too, instead of touching freed memory
        except ondevice.OndeviceError as e:
            print("backend:", e)
    """, str(tiny_gguf("llama")), timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout.splitlines()
    assert out[0] in ("waiting thread: [4]", "waiting thread: ['this Runtime is closed; load() a new one']"), out
    assert out[1:5] == ["error: this Runtime is closed; load() a new one"] * 4 and out[5] == "closed twice"
    assert out[6] == "backend: model.gguf: this model was closed; load it again"


# -- 6. sliding-window MLX models ---------------------------------------------------------------------
SWA_CONFIG = dict(model_type="gemma3_text", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                  num_attention_heads=2, head_dim=32, num_key_value_heads=1, rms_norm_eps=1e-6, vocab_size=512,
                  sliding_window=8, sliding_window_pattern=2, rope_theta=10000.0, rope_local_base_freq=10000.0,
                  query_pre_attn_scalar=32, max_position_embeddings=2048)


@pytest.fixture(scope="module")
def tiny_gemma3(tiny_hf, tmp_path_factory):
    """A random Gemma 3 text model (window 8, one sliding and one global layer) as an mlx-lm directory."""
    mx = pytest.importorskip("mlx.core")
    import shutil

    from mlx.utils import tree_flatten
    from mlx_lm.models import gemma3_text

    out = tmp_path_factory.mktemp("gemma3")
    mx.random.seed(0)
    model = gemma3_text.Model(gemma3_text.ModelArgs.from_dict(SWA_CONFIG))
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (out / "config.json").write_text(json.dumps(SWA_CONFIG))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_hf["llama"] / f, out / f)
    return out


def test_06_mlx_sliding_window_rollback_stays_exact_past_the_window(tiny_gemma3):
    import mlx.core as mx
    from mlx_lm.models import gemma3_text

    from ondevice.backends.mlx import MLXBackend

    b = MLXBackend(tiny_gemma3, n_ctx=256, device="cpu")
    ids = _long_ids(b, 60)
    ref = np.array(b.model(mx.array([ids]))[0].astype(mx.float32))  # one pass, no cache: the windowed mask
    b.eval(ids[:30], logits="last")
    b.eval(ids[30:45])  # far past the window of 8
    b.rollback(20)
    assert np.array_equal(b.eval(ids[20:60]), ref[20:60])
    b.rollback(0)
    assert np.array_equal(b.eval(ids[:60]), ref)
    # Control: the window matters here (full attention gives other logits), so the check above has power.
    full = gemma3_text.Model(gemma3_text.ModelArgs.from_dict({**SWA_CONFIG, "sliding_window": 4096}))
    full.load_weights(str(tiny_gemma3 / "model.safetensors"))
    assert not np.allclose(np.array(full(mx.array([ids]))[0].astype(mx.float32))[20:], ref[20:], atol=1e-3)
    b.close()
    with ondevice.load(tiny_gemma3, drafter="ngram", threads=1) as rt:  # rejected drafts roll back across the window
        plain = rt.generate(ids, max_tokens=40, temperature=0, gamma=0)
        spec = rt.generate(ids, max_tokens=40, temperature=0, gamma=4)
        assert spec.tokens == plain.tokens and spec.stats.drafted > spec.stats.accepted
        rt.reset()
        assert rt.generate(ids[:30], max_tokens=8, temperature=0, gamma=0).tokens == \
            rt.generate(ids[:30], max_tokens=8, temperature=0, gamma=0).tokens


# -- 7. the cost cache --------------------------------------------------------------------------------
def test_07_cost_cache_is_keyed_by_device_and_written_atomically(tiny_gguf, monkeypatch, tmp_path):
    import llama_cpp

    from ondevice import costs
    from ondevice.backends.llama import LlamaBackend

    path = tiny_gguf("llama")
    cpu = LlamaBackend(path, n_ctx=256, device="cpu", threads=1)
    monkeypatch.setattr(llama_cpp, "llama_supports_gpu_offload", lambda: True)  # as a Metal build would say
    gpu = LlamaBackend(path, n_ctx=256, device="gpu", threads=1)
    assert (cpu.device, gpu.device) == ("cpu", "gpu")
    assert costs._key(cpu) != costs._key(gpu)
    gpu.close()
    # Another process's temp file is neither reused nor clobbered; the cache is whole JSON.
    monkeypatch.setenv("ONDEVICE_HOME", str(tmp_path))
    # Deterministic: a probe of this tiny model on a busy machine may time an implausible curve, which is
    # rightly never cached (tested on its own); this test is about the key and the atomic write.
    monkeypatch.setattr(costs, "plausible", lambda *a, **k: True)
    foreign = tmp_path / "costs.tmp"
    foreign.write_text("another process, half-way through")
    c = costs.cached_measure(cpu)
    assert foreign.read_text() == "another process, half-way through"
    entry = json.loads((tmp_path / "costs.json").read_text())
    assert len(entry) == 1 and [p.name for p in tmp_path.iterdir() if p.name != foreign.name] == ["costs.json"]
    assert costs.cached_measure(cpu).target_seconds == c.target_seconds  # read back from the cache
    assert cpu.n_past == 0
    cpu.close()


# -- 8. MLX devices -----------------------------------------------------------------------------------
def test_08_mlx_backends_never_change_the_process_default_device(tiny_mlx, monkeypatch):
    mx = pytest.importorskip("mlx.core")
    from ondevice.backends.mlx import MLXBackend

    def forbidden(*_):
        raise AssertionError("a backend changed the process-wide default device")

    before = mx.default_device()
    monkeypatch.setattr(mx, "set_default_device", forbidden)
    a = MLXBackend(tiny_mlx("llama"), n_ctx=128, device="cpu")
    b = MLXBackend(tiny_mlx("llama"), n_ctx=128, device=None)
    ids = a.tokenize(PROMPT)
    assert np.array_equal(a.eval(ids), b.eval(ids))
    assert mx.default_device() == before and a.device == mx.cpu
    a.close()
    b.close()


# -- 9. vocabulary masking ----------------------------------------------------------------------------
LIMIT = 256  # the smaller draft's vocabulary: ids 256..511 exist only in the target


class _SmallVocabDraft:
    """A draft that knows only the first ``LIMIT`` ids (a real backend, cut down); evaluating an id it
    does not have is an error, as it would be for a real smaller model."""

    def __init__(self, backend) -> None:
        self.inner = backend
        self.vocab_size = LIMIT
        self.n_ctx = backend.n_ctx
        self.path = backend.path

    @property
    def n_past(self) -> int:
        return self.inner.n_past

    def eval(self, tokens, logits="all"):
        assert all(0 <= t < LIMIT for t in tokens), tokens
        return self.inner.eval(tokens, logits)[:, :LIMIT]

    def rollback(self, n):
        self.inner.rollback(n)

    def close(self):
        self.inner.close()


def _pair_with_small_draft(target_path, draft_path, mask_target: bool = False):
    from ondevice.backends.llama import LlamaBackend
    from ondevice.drafters import ModelDrafter
    from ondevice.runtime import Runtime

    target = LlamaBackend(target_path, n_ctx=256, threads=1)
    if mask_target:  # the planted bug: the target's law truncated to the shared vocabulary (the old behaviour)
        real = target.eval

        def masked(tokens, logits="all"):
            out = real(tokens, logits)
            out[:, LIMIT:] = -np.inf
            return out

        target.eval = masked
    drafter = ModelDrafter(_SmallVocabDraft(LlamaBackend(draft_path, n_ctx=256, threads=1)), LIMIT, target.vocab_size)
    return Runtime(target, drafter, vocab_limit=LIMIT)


def test_09_a_draft_with_a_smaller_vocabulary_keeps_the_target_law(tiny_gguf):
    from helpers import chisquare, exact_joint_law, sampled_counts

    from ondevice import sampling

    target, draft = tiny_gguf("qwen2"), tiny_gguf("qwen2_draft")
    temperature, top_k, n = 1.0, 8, 2000
    params = sampling.SamplingParams(temperature=temperature, top_k=top_k, top_p=1.0, min_p=0.0)
    with _pair_with_small_draft(target, draft) as rt:
        ids = rt.tokenize(PROMPT)
        law = exact_joint_law(target, ids, params)
        beyond = sum(p for seq, p in law.items() if max(seq) >= LIMIT)
        assert 0.2 < beyond < 0.95, beyond  # the target really puts mass where the draft cannot go
        counts = sampled_counts(rt, ids, n, temperature, top_k, gamma=2)
        assert rt.generate(ids, max_tokens=24, temperature=temperature, top_k=top_k, top_p=1.0, min_p=0.0,
                           seed=3, gamma=2).stats.accepted > 0
        assert chisquare(counts, law, n) > 1e-3
        greedy = rt.generate(ids, max_tokens=24, temperature=0, gamma=3).tokens
    with ondevice.load(target, drafter="none", threads=1) as plain:
        assert greedy == plain.generate(ids, max_tokens=24, temperature=0, gamma=0).tokens
    with _pair_with_small_draft(target, draft, mask_target=True) as bug:  # negative control
        assert chisquare(sampled_counts(bug, ids, 300, temperature, top_k, gamma=2), law, 300) < 1e-4


# -- 10. stop strings ---------------------------------------------------------------------------------
def _assemble(pieces: list[str], stop: list[str]) -> tuple[str, list[str]]:
    """Feed ``pieces`` (one token each) through the TextAssembler: (the whole output, what each step released)."""
    from ondevice.text import TextAssembler

    table = {i: p.encode() for i, p in enumerate(pieces)}
    t = TextAssembler(table.__getitem__, stop)
    released = []
    for i in range(len(pieces)):
        released.append(t.feed(i))
        if t.stopped:
            break
    released.append(t.flush())
    return "".join(released), released


def test_10_stop_hold_back_covers_every_stop_string():
    assert _assemble(["ab", "Z", "Q"], ["Zq", "abZQ"])[0] == ""
    assert _assemble(["ab", "Z", "Q"], ["abZQ", "Zq"])[0] == ""
    assert _assemble(["ab", "Z", "q"], ["Zq", "abZQ"])[0] == "ab"
    rng = random.Random(0)
    for _ in range(3000):  # against the definition: generation ends with the first piece that completes a
        # stop string, and the text is cut at the earliest occurrence of any stop in it
        text = "".join(rng.choice("abZQq") for _ in range(rng.randint(1, 12)))
        cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(0, 4))))
        pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        stop = ["".join(rng.choice("abZQq") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        want = text
        for end in [*cuts, len(text)]:
            hits = [text[:end].find(s) for s in stop if s in text[:end]]
            if hits:
                want = text[: min(hits)]
                break
        assert _assemble(pieces, stop)[0] == want, (pieces, stop)


# -- 11. permissions of converted directories ---------------------------------------------------------
def test_11_converted_directories_get_the_users_normal_permissions(tmp_path):
    from converters.output import atomic_dir

    old = os.umask(0o022)
    try:
        with atomic_dir(tmp_path / "out") as d:
            (d / "weights.bin").write_bytes(b"x")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "out").stat().st_mode) == 0o755
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


# -- 12. astream --------------------------------------------------------------------------------------
def test_12_leaving_astream_early_ends_the_request_at_once(tiny_gguf):
    with ondevice.load(tiny_gguf("llama"), drafter="none", threads=1) as rt:
        rt.generate(PROMPT, max_tokens=2, temperature=0)

        async def leave_early():
            async for _ in rt.astream(PROMPT, max_tokens=300, temperature=0, gamma=0):
                break
            return rt.last_stats  # read right after the loop, without awaiting anything

        stats = asyncio.run(leave_early())
        assert stats is not None and stats.stop_reason == "cancelled"
        assert stats.target_forwards == 1  # nothing was computed after the consumer left

        async def cancelled_task():
            started = asyncio.Event()

            async def consume():
                async for _ in rt.astream(PROMPT, max_tokens=3000, temperature=0, gamma=0):
                    started.set()
                    await asyncio.sleep(0)

            task = asyncio.create_task(consume())
            await started.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return rt.last_stats

        stats = asyncio.run(cancelled_task())
        assert stats.stop_reason == "cancelled" and stats.tokens < 10
        assert rt.generate(PROMPT, max_tokens=2).stats.tokens == 2


# -- 13. input validation -----------------------------------------------------------------------------
def test_13_bad_request_inputs_are_one_line_errors(tiny_gguf):
    with ondevice.load(tiny_gguf("llama"), drafter="none", threads=1) as rt:
        assert rt.target.bos_id is not None
        cases = {
            "not valid text": dict(prompt="caf\udce9"),
            "empty list of token ids; pass at least one id": dict(prompt=[]),
            "must be integers; item 0 is 1.7": dict(prompt=[1.7, 2]),
            "not bytes": dict(prompt=PROMPT, stop=b"x"),
            "every stop must be a string": dict(prompt=PROMPT, stop=["ok", 3]),
            "prompt is bytes": dict(prompt=b"hello"),
            "max_tokens=None": dict(prompt=PROMPT, max_tokens=None),
        }
        for message, kw in cases.items():
            with pytest.raises(OndeviceError, match=message) as e:
                rt.generate(**kw)
            assert "\n" not in str(e.value) and "no BOS" not in str(e.value)
        assert rt.generate("", max_tokens=2, temperature=0).stats.tokens == 2  # "" starts from BOS
        assert rt.generate(np.array(rt.tokenize(PROMPT)), max_tokens=2).stats.tokens == 2
    r = subprocess.run([sys.executable, "-P", "-m", "ondevice", "generate", str(tiny_gguf("llama")), "-p", b"caf\xe9"],
                       capture_output=True, timeout=300)  # invalid UTF-8 in argv
    assert r.returncode == 2 and r.stderr.decode().count("\n") == 1 and b"not valid text" in r.stderr


# -- fault injection: real SIGINTs at chosen native calls -----------------------------------------------
# (name, which backend, function, n-th call, request); MLX layers: 2 cache updates per forward.
# The cost probe comes first: it runs at the runtime's first gamma="auto" request only (every "after" check
# below asks for "auto"). Placed later, its request would run the adaptive policy instead, whose number of
# target passes depends on timings, so the n-th call sometimes never came (a flaky test).
FAULT_POINTS = {
    "gguf": [
        ("cost probe", "target", "llama_decode", 5, dict(gamma="auto")),
        ("prefill", "target", "llama_decode", 1, dict(gamma=0, long=True)),  # the first of two prefill batches
        ("mid-decode", "target", "llama_decode", 4, dict(gamma=3)),
        ("mid-draft", "draft", "llama_decode", 3, dict(gamma=3)),
        ("rollback", "target", "llama_memory_seq_rm", 2, dict(gamma=3)),
    ],
    "mlx": [  # an MLX target (SIGINT between two layers of one forward) verifying a GGUF draft
        ("cost probe", "target", "update_and_fetch", 9, dict(gamma="auto")),
        ("prefill", "target", "update_and_fetch", 1, dict(gamma=0, long=True)),
        ("mid-decode", "target", "update_and_fetch", 7, dict(gamma=3)),
        ("mid-draft", "draft", "llama_decode", 3, dict(gamma=3)),
    ],
}


class _MethodTrip:
    """Wraps method ``name`` of ``cls`` (all instances): after its n-th call returns, ``action()``."""

    def __init__(self, cls, name: str, n: int, action) -> None:
        self.cls, self.name, self.real = cls, name, cls.__dict__[name]
        count = []

        def call(*a, **kw):
            out = self.real(*a, **kw)
            count.append(1)
            if len(count) == n:
                action()
            return out

        setattr(cls, name, call)

    def remove(self) -> None:
        setattr(self.cls, self.name, self.real)


def _fault_main(kind: str, target: str, draft: str) -> None:
    """In a subprocess: for each point, deliver a real SIGINT right after the chosen call returns, then
    check that the same runtime answers exactly like a fresh one, before and after ``reset()``."""
    sent = []

    def sigint():
        sent.append(1)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.01)  # the handler runs here at the latest

    n_ctx = 128 if kind == "gguf" else 256  # GGUF: n_batch 128, so a 200-token prefill takes two decodes
    with ondevice.load(target, drafter="none", n_ctx=n_ctx, threads=1) as fresh:
        ref = fresh.generate(PROMPT, max_tokens=24, temperature=0, gamma=0).tokens
    rt = ondevice.load(target, draft, n_ctx=n_ctx, threads=1)
    long_ids = _long_ids(rt, 200)
    report = []
    for name, which, fn, n, req in FAULT_POINTS[kind]:
        backend = rt.target if which == "target" else rt.drafter.backend
        if fn == "update_and_fetch":
            from mlx_lm.models.cache import KVCache

            trip = _MethodTrip(KVCache, fn, n, sigint)
        else:
            trip = _NativeTrip(backend, fn, n, sigint)
        try:
            rt.generate(long_ids if req.get("long") else PROMPT, max_tokens=24, temperature=0, gamma=req["gamma"])
            interrupted = False
        except KeyboardInterrupt:
            interrupted = True
        trip.remove()
        if name == "cost probe":  # the SIGINT must have landed inside the probe: no policy was made
            interrupted = interrupted and rt._adaptive is None
        outcome = []
        for step in ("after", "after reset"):
            if step == "after reset":
                rt.reset()
            try:
                got = rt.generate(PROMPT, max_tokens=24, temperature=0, gamma="auto").tokens
                outcome.append("exact" if got == ref else f"different: {got}")
            except OndeviceError as e:
                outcome.append(f"error: {e}")
        report.append(dict(point=name, interrupted=interrupted and len(sent) == 1, after=outcome[0], reset=outcome[1]))
        sent.clear()
    rt.close()
    print(json.dumps(report))


@pytest.mark.parametrize("kind", ["gguf", "mlx"])
def test_sigint_at_every_point_leaves_an_exact_runtime(kind, tiny_gguf, tiny_mlx, tmp_path, sigint_default):
    if kind == "mlx":
        pytest.importorskip("mlx.core")
    target = tiny_gguf("llama") if kind == "gguf" else tiny_mlx("llama")
    r = _python("import sys; from test_reliability import _fault_main; _fault_main(*sys.argv[1:])",
                kind, str(target), str(tiny_gguf("llama_draft")), env={"ONDEVICE_HOME": str(tmp_path)})
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout.splitlines()[-1])
    assert [p["point"] for p in report] == [p[0] for p in FAULT_POINTS[kind]]
    for p in report:
        assert p == dict(point=p["point"], interrupted=True, after="exact", reset="exact"), p


# -- Ctrl-C in `ondevice chat` ----------------------------------------------------------------------------
def test_ctrl_c_in_chat_stops_the_answer_and_keeps_the_session(tiny_gguf, tmp_path, sigint_default):
    turns = tmp_path / "turns.txt"
    turns.write_bytes(b"first question\nsecond question\n")
    slow_chat = textwrap.dedent("""
        import sys, time
        from ondevice.backends.llama import LlamaBackend
        real, calls = LlamaBackend.eval, []
        def slow(self, *a, **kw):  # 20 ms per pass at first: the answer still streams when Ctrl-C comes
            calls.append(1)
            if len(calls) < 100:
                time.sleep(0.02)
            return real(self, *a, **kw)
        LlamaBackend.eval = slow
        from ondevice.cli.main import main
        sys.argv = ["ondevice", *sys.argv[1:]]
        main()
    """)
    with open(turns, "rb") as stdin:
        p = subprocess.Popen([sys.executable, "-P", "-c", slow_chat, "chat", str(tiny_gguf("llama")), "--no-spec",
                              "--max-tokens", "1000", "--temperature", "0", "--threads", "1", "--stats"],
                             stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = p.stdout.read(1)  # the first answer is streaming
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err.decode()
    err = err.decode()
    assert "(stopped)" in err
    stats = [int(t) for t in re.findall(r"(\d+) tokens ·", err)]
    assert len(stats) == 2 and stats[0] < 100  # the first answer (249 tokens uninterrupted) stopped, the second ran
    assert first and out
