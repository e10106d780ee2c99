"""``--parallel N`` with ``--prompt-cache DIR``: a batched slot restores a long prompt prefix from disk (after a
restart too), stores what it prefilled, reports ``Stats.cached_tokens`` (and the OpenAI usage's
``prompt_tokens_details.cached_tokens``) as the one-at-a-time path does, and answers as alone."""

from __future__ import annotations

import pytest

from ondevice.batching import BatchEngine
from ondevice.loader import load
from ondevice.server.openai_api import usage

SYSTEM = " ".join(f"Rule {i}: answer with care, cite item {i * 7 % 13} and keep the tone plain." for i in range(8))
QUESTIONS = [" Question: what does rule 3 say?", " Question: and rule 5?", " Question: is rule 1 plain?"]


def _alone(path, prompts):
    out = []
    with load(path, drafter="none", n_ctx=1024, threads=1) as rt:
        for p in prompts:
            rt.reset()
            out.append(rt.generate(p, max_tokens=12, temperature=0).tokens)
    return out


def _batched(path, cache_dir, prompts):
    with load(path, drafter="none", n_ctx=1024, threads=1, parallel=3, prompt_cache=cache_dir) as rt:
        eng = BatchEngine(rt)
        with rt._lock:  # every request queued before the first step
            streams = [eng.stream(p, max_tokens=12, temperature=0) for p in prompts]
        for s in streams:
            for _ in s:
                pass
        return [(s.tokens, s.stats) for s in streams]


def test_batched_slots_restore_and_store_prefixes_on_disk(tiny_gguf, tmp_path):
    path = tiny_gguf("llama")
    first = [SYSTEM + QUESTIONS[0]]
    prompts = [SYSTEM + q for q in QUESTIONS]
    want = _alone(path, prompts)
    (tokens, stats), = _batched(path, tmp_path, first)  # cold: evaluated, then stored by the batch
    assert tokens == want[0] and stats.cached_tokens == 0 and stats.prompt_eval_tokens == stats.prompt_tokens
    assert len(list(tmp_path.glob("*.kvc"))) == 1
    got = _batched(path, tmp_path, prompts)  # a restart: three slots restore the common system prompt
    assert [t for t, _ in got] == want
    for _, stats in got:
        assert stats.cached_tokens >= 0.8 * stats.prompt_tokens
        assert stats.prompt_eval_tokens == stats.prompt_tokens - stats.cached_tokens
        assert usage(stats)["prompt_tokens_details"]["cached_tokens"] == stats.cached_tokens
    assert got[0][1].cached_tokens == got[0][1].prompt_tokens - 1  # all of it stored but its last token


def test_batched_slots_without_a_prompt_cache_report_in_memory_reuse(tiny_gguf):
    path = tiny_gguf("llama")
    with load(path, drafter="none", n_ctx=1024, threads=1, parallel=2) as rt:
        eng = BatchEngine(rt)
        a = eng.generate(SYSTEM + QUESTIONS[0], max_tokens=4, temperature=0)
        b = eng.generate(SYSTEM + QUESTIONS[1], max_tokens=4, temperature=0)  # the same sequence's prefix
    assert a.stats.cached_tokens == 0 and b.stats.cached_tokens > 0.8 * b.stats.prompt_tokens
    assert b.stats.prompt_eval_tokens == b.stats.prompt_tokens - b.stats.cached_tokens



def test_serve_parallel_restart_reports_cached_tokens(tiny_gguf, tmp_path):
    """``serve --parallel 2 --prompt-cache DIR``, restarted: the repeated system prompt comes from disk and the
    OpenAI usage says so; the text equals the cold server's."""
    httpx = pytest.importorskip("httpx")
    from ondevice.server.run import launch

    path = tiny_gguf("llama")
    got = []
    for _ in range(2):
        proc, url = launch(str(path), "--n-ctx", "1024", "--threads", "1", "--parallel", "2", "--no-spec",
                           "--prompt-cache", str(tmp_path))
        try:
            model_id = httpx.get(url + "/v1/models").json()["data"][0]["id"]
            r = httpx.post(url + "/v1/completions", json={"model": model_id, "prompt": SYSTEM + QUESTIONS[0],
                                                          "max_tokens": 8, "temperature": 0}, timeout=120).json()
            got.append((r["choices"][0]["text"], r["usage"]))
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    (cold_text, cold), (text, warm) = got
    assert text == cold_text and cold["prompt_tokens_details"]["cached_tokens"] == 0
    assert warm["prompt_tokens_details"]["cached_tokens"] == warm["prompt_tokens"] - 1


def test_one_folder_serves_parallel_and_one_at_a_time_runtimes(tiny_gguf, tmp_path):
    """llama.cpp serialises a sequence differently with one KV buffer per sequence: each layout restores only its
    own files, and neither deletes the other's (a server run with and without --parallel on one folder)."""
    path = tiny_gguf("llama")
    prompt = SYSTEM + QUESTIONS[0]
    _, = _batched(path, tmp_path, [prompt])  # parallel=3 stores its file
    with load(path, drafter="none", n_ctx=1024, threads=1, prompt_cache=tmp_path) as rt:
        one = rt.generate(prompt, max_tokens=12, temperature=0)
    assert one.stats.cached_tokens == 0  # the parallel file is not this layout's
    assert len(list(tmp_path.glob("*.kvc"))) == 2  # it was kept, and the one-at-a-time runtime stored its own
    (tokens, stats), = _batched(path, tmp_path, [prompt])
    assert tokens == one.tokens and stats.cached_tokens == stats.prompt_tokens - 1
    with load(path, drafter="none", n_ctx=1024, threads=1, prompt_cache=tmp_path) as rt:
        again = rt.generate(prompt, max_tokens=12, temperature=0)
    assert again.tokens == one.tokens and again.stats.cached_tokens == again.stats.prompt_tokens - 1
