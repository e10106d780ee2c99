"""``--parallel N`` (``ondevice.batching.BatchEngine``): requests decoded together in one llama.cpp batch give
the answers they give one at a time, token for token; each slot keeps its own rng, stop, limit and cancel."""

from __future__ import annotations

import pytest

import ondevice
from ondevice.batching import BatchEngine
from ondevice.errors import OndeviceError

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "Three primary colours are"]


def _alone(path, requests, **load):
    """Each (prompt, options) generated one at a time on a usual one-sequence runtime."""
    with ondevice.load(path, drafter="none", **load) as rt:
        return [rt.generate(p, **o) for p, o in requests]


def _together(path, requests, parallel=4, **load):
    """All requests submitted before the batch starts (the worker waits on the runtime's lock), then read."""
    with ondevice.load(path, drafter="none", parallel=parallel, **load) as rt:
        eng = BatchEngine(rt)
        with rt._lock:  # the worker cannot admit anything before every request is queued
            streams = [eng.stream(p, **o) for p, o in requests]
        out = []
        for s in streams:
            for _ in s:
                pass
            out.append((s.tokens, s.text, s.stats))
        return out, eng


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=0.9, top_p=0.95)])
def test_four_concurrent_answers_equal_their_one_at_a_time_answers(smollm2, sampling):
    reqs = [(p, dict(max_tokens=40, seed=100 + i, **sampling)) for i, p in enumerate(PROMPTS)]
    alone = _alone(smollm2, reqs, n_ctx=512)
    together, eng = _together(smollm2, reqs, n_ctx=512)
    assert eng.max_active == 4
    for a, (tokens, text, stats) in zip(alone, together, strict=True):
        assert tokens == a.tokens and text == a.text
        assert stats.stop_reason == a.stats.stop_reason and stats.tokens == a.stats.tokens


def test_tiny_model_greedy_and_seeded_equal_alone_with_different_limits_and_stops(tiny_gguf):
    path = tiny_gguf("llama")
    alone_tokens = _alone(path, [(PROMPTS[0], dict(max_tokens=30, temperature=0))], n_ctx=256, threads=1)[0].text
    stop = alone_tokens[8:11]  # a stop string that occurs in the first answer
    reqs = [(PROMPTS[0], dict(max_tokens=30, temperature=0, stop=[stop])),
            (PROMPTS[1], dict(max_tokens=7, temperature=0)),
            (PROMPTS[2], dict(max_tokens=25, temperature=1.0, seed=3)),
            (PROMPTS[3], dict(max_tokens=12, temperature=0.7, top_k=20, seed=4))]
    alone = _alone(path, reqs, n_ctx=256, threads=1)
    together, _ = _together(path, reqs, n_ctx=256, threads=1)
    assert alone[0].stats.stop_reason == "stop" and alone[1].stats.stop_reason == "length"
    for a, (tokens, text, stats) in zip(alone, together, strict=True):
        assert (tokens, text, stats.stop_reason, stats.tokens) == (a.tokens, a.text, a.stats.stop_reason, a.stats.tokens)


def test_every_active_slot_advances_every_step(tiny_gguf):
    reqs = [(p, dict(max_tokens=10, temperature=0)) for p in PROMPTS]
    seen: list[list[int]] = []
    with ondevice.load(tiny_gguf("llama"), drafter="none", parallel=4, n_ctx=256, threads=1) as rt:
        eng = BatchEngine(rt)
        eng.on_step = seen.append
        with rt._lock:
            streams = [eng.stream(p, **o) for p, o in reqs]
        for s in streams:
            for _ in s:
                pass
    # every step held every unfinished request: request i took part in exactly its first forwards steps
    forwards = [s.stats.target_forwards for s in streams]
    assert max(forwards) == 10 and len(seen) == 10
    for step, ids in enumerate(seen):
        assert ids == [i for i in range(4) if forwards[i] > step]


def test_more_requests_than_slots_wait_and_join_between_steps(tiny_gguf):
    path = tiny_gguf("llama")
    reqs = [(p + suffix, dict(max_tokens=6 + 3 * i, temperature=0))
            for i, (p, suffix) in enumerate((p, s) for s in ("", " and") for p in PROMPTS)]
    alone = _alone(path, reqs, n_ctx=256, threads=1)
    together, eng = _together(path, reqs, parallel=3, n_ctx=256, threads=1)
    assert eng.max_active == 3 and eng.active == 0
    assert [t for t, _, _ in together] == [a.tokens for a in alone]


def test_a_cancelled_slot_frees_at_once_and_leaves_the_others_exact(smollm2):
    reqs = [(p, dict(max_tokens=30, temperature=0)) for p in PROMPTS]
    alone = _alone(smollm2, reqs, n_ctx=512)
    with ondevice.load(smollm2, drafter="none", parallel=4, n_ctx=512) as rt:
        eng = BatchEngine(rt)
        with rt._lock:
            streams = [eng.stream(p, **o) for p, o in reqs]
        first = next(iter(streams[1]))
        assert first.tokens == alone[1].tokens[:1]
        streams[1].close()  # a client that disconnects after its first token
        dropped = streams[2]
        dropped.cancel()
        for i in (0, 3):
            for _ in streams[i]:
                pass
            assert streams[i].tokens == alone[i].tokens
        for _ in dropped:
            pass
        assert dropped.stats.stop_reason == "cancelled" and dropped.tokens == alone[2].tokens[: len(dropped.tokens)]
        assert len(dropped.tokens) < 30 and eng.active == 0
        # the runtime's one-at-a-time path works again afterwards, on the same cache
        assert rt.generate(PROMPTS[0], max_tokens=30, temperature=0).tokens == alone[0].tokens


def test_a_slot_error_ends_that_slot_only(tiny_gguf, monkeypatch):
    path = tiny_gguf("llama")
    reqs = [(p, dict(max_tokens=8, temperature=0)) for p in PROMPTS[:3]]
    alone = _alone(path, reqs, n_ctx=256, threads=1)
    with ondevice.load(path, drafter="none", parallel=3, n_ctx=256, threads=1) as rt:
        eng = BatchEngine(rt)
        real = eng._advance

        def advance(s, row, seconds):
            if s == 1 and eng._active[s].out.stats.tokens == 2:
                raise RuntimeError("planted failure in slot 1")
            real(s, row, seconds)

        monkeypatch.setattr(eng, "_advance", advance)
        with rt._lock:
            streams = [eng.stream(p, **o) for p, o in reqs]
        with pytest.raises(RuntimeError, match="planted"):
            for _ in streams[1]:
                pass
        assert streams[1].stats.stop_reason == "error"
        for i in (0, 2):
            for _ in streams[i]:
                pass
            assert streams[i].tokens == alone[i].tokens


def test_parallel_refused_where_it_cannot_be_exact(tiny_gguf):
    with ondevice.load(tiny_gguf("llama"), drafter="none", n_ctx=256, threads=1) as rt:
        with pytest.raises(OndeviceError, match="parallel=N"):
            BatchEngine(rt)
    with pytest.raises(OndeviceError, match="parallel=0"):
        ondevice.load(tiny_gguf("llama"), parallel=0)
    with ondevice.load(tiny_gguf("llama"), drafter="none", n_ctx=256, threads=1, parallel=2) as rt:
        assert rt.n_ctx == rt.target.n_ctx_seq == 256  # each slot keeps the context asked for
        with pytest.raises(OndeviceError, match="n_ctx is 256"):
            BatchEngine(rt).stream(list(range(1, 300)))


def test_serve_parallel_four_clients_equal_their_one_at_a_time_answers(smollm2):
    """``ondevice serve --parallel 4``: four concurrent chat requests (two streamed) answer as one at a time does;
    a client that disconnects mid-answer frees its slot (health shows nothing running afterwards)."""
    import socket
    import threading

    httpx = pytest.importorskip("httpx")
    from ondevice.server.run import launch

    questions = [f"Say the number {i} in words, then stop." for i in range(4)]
    with ondevice.load(smollm2, drafter="none", n_ctx=512) as rt:
        want = [rt.chat([{"role": "user", "content": q}], temperature=0, max_tokens=24).text for q in questions]
    proc, url = launch(str(smollm2), "--n-ctx", "512", "--threads", "1", "--parallel", "4", "--no-spec")
    try:
        model_id = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        leaver = socket.create_connection((url.split("//")[1].split(":")[0], int(url.rsplit(":", 1)[1])))
        body = f'{{"model":"{model_id}","prompt":"1, 2, 3, 4, 5,","max_tokens":400,"stream":true}}'.encode()
        leaver.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        assert leaver.recv(1024).startswith(b"HTTP/1.1 200")
        got: list = [None] * 4

        def ask(i: int) -> None:
            msg = {"model": model_id, "messages": [{"role": "user", "content": questions[i]}], "temperature": 0,
                   "max_tokens": 24}
            try:
                if i % 2:
                    with httpx.stream("POST", url + "/v1/chat/completions", json={**msg, "stream": True},
                                      timeout=120) as r:
                        parts = [line[6:] for line in r.iter_lines() if line.startswith("data: {")]
                    import json

                    got[i] = "".join(json.loads(p)["choices"][0]["delta"].get("content") or "" for p in parts
                                     if json.loads(p)["choices"])
                else:
                    got[i] = httpx.post(url + "/v1/chat/completions", json=msg, timeout=120).json()[
                        "choices"][0]["message"]["content"]
            except Exception as e:  # noqa: BLE001 - reported by the assertion below
                got[i] = e

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        most = 0
        while any(t.is_alive() for t in threads):  # how many run at once, while the chats are answered
            most = max(most, httpx.get(url + "/health").json()["running"])
            if most >= 3:
                leaver.close()  # disconnects while the others decode
        leaver.close()
        for t in threads:
            t.join(120)
        assert got == want
        assert most >= 3  # one at a time would show 1
        for _ in range(100):
            if httpx.get(url + "/health").json()["running"] == 0:
                break
            import time

            time.sleep(0.1)
        assert httpx.get(url + "/health").json()["running"] == 0
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_constraints_and_logprobs_per_slot_equal_alone(tiny_gguf):
    """A slot's grammar and logprobs are its own: a JSON-constrained sampled request, a logprobs request and a
    free one decoded together give what each gives alone (tokens, text, every logprob)."""
    path = tiny_gguf("llama")
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
              "required": ["name", "n"]}
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    reqs = [(PROMPTS[0], dict(response_format=rf, max_tokens=40, temperature=0.8, seed=5, top_logprobs=3)),
            (PROMPTS[1], dict(max_tokens=12, temperature=0, logprobs=True)),
            (PROMPTS[2], dict(max_tokens=12, temperature=0.5, seed=9))]
    with ondevice.load(path, drafter="none", n_ctx=256, threads=1) as rt:
        alone = [rt.generate(p, **o) for p, o in reqs]
    with ondevice.load(path, drafter="none", parallel=3, n_ctx=256, threads=1) as rt:
        eng = BatchEngine(rt)
        with rt._lock:
            streams = [eng.stream(p, **o) for p, o in reqs]
        for s, a in zip(streams, alone, strict=True):
            for _ in s:
                pass
            assert (s.tokens, s.text, s.logprobs) == (a.tokens, a.text, a.logprobs)
    assert alone[0].logprobs and alone[2].logprobs is None and alone[0].text.startswith("{")


def test_a_full_slot_stops_at_its_context_and_a_dropped_stream_frees_its_slot(tiny_gguf):
    import gc

    path = tiny_gguf("llama")
    with ondevice.load(path, drafter="none", n_ctx=256, threads=1) as rt:
        long = rt.tokenize(" ".join(["word"] * 400))[:250]
        alone = rt.generate(long, max_tokens=100, temperature=0)
    assert alone.stats.stop_reason == "context"
    with ondevice.load(path, drafter="none", parallel=2, n_ctx=256, threads=1) as rt:
        eng = BatchEngine(rt)
        with rt._lock:
            full = eng.stream(long, max_tokens=100, temperature=0)
            eng.stream(PROMPTS[1], max_tokens=30, temperature=0)  # dropped at once, never read
            gc.collect()
        for _ in full:
            pass
        assert (full.tokens, full.stats.stop_reason) == (alone.tokens, "context")
        assert eng.active == 0 and eng.steps == len(alone.tokens)  # the dropped one never took a step


def test_a_stream_closed_before_its_first_chunk_frees_its_slot(tiny_gguf):
    """A BatchEngine request starts before its stream is read; closing the stream before its first chunk ends
    the request (was: the generator, never started, closed without its cleanup, and the slot decoded on)."""
    with ondevice.load(tiny_gguf("llama"), drafter="none", parallel=2, n_ctx=256, threads=1) as rt:
        eng, steps = BatchEngine(rt), []
        eng.on_step = steps.append
        with rt._lock:
            closed = eng.stream(PROMPTS[1], max_tokens=60, temperature=0)
            closed.close()
            other = eng.stream(PROMPTS[0], max_tokens=20, temperature=0)
        for _ in other:
            pass
        assert steps and all(len(s) == 1 for s in steps), steps  # the closed one never took a step
        assert closed.stats.stop_reason == "cancelled" and closed.tokens == [] and list(closed) == []


def test_runtime_close_ends_a_running_batch(tiny_gguf):
    rt = ondevice.load(tiny_gguf("llama"), drafter="none", parallel=2, n_ctx=256, threads=1)
    eng = BatchEngine(rt)
    streams = [eng.stream(p, max_tokens=200, temperature=0) for p in PROMPTS[1:3]]
    next(iter(streams[0]))
    rt.close()  # cancels the batch (it holds the runtime's turn), waits for it, frees the model
    for s in streams:
        for _ in s:
            pass
        assert s.stats.stop_reason == "cancelled" and len(s.tokens) < 200
    with pytest.raises(OndeviceError, match="closed"):
        eng.stream(PROMPTS[0])


def test_a_follow_up_reuses_its_slots_prefix_and_answers_as_alone(smollm2):
    """Chat turns: a request that continues an earlier one (prompt + answer + more) is given the sequence that
    holds that prefix and evaluates only the rest; the answers equal a fresh one-at-a-time runtime's. The
    one-slot path of the same runtime continues from sequence 0 too."""
    opts = dict(max_tokens=16, temperature=0)
    with ondevice.load(smollm2, drafter="none", n_ctx=512) as rt:
        first = [rt.tokenize(p) for p in PROMPTS[:3]]
        r1 = []
        for ids in first:
            rt.reset()
            r1.append(rt.generate(ids, **opts).tokens)
        more = rt.tokenize(" And then", add_bos=False)
        follow = [ids + ans + more for ids, ans in zip(first, r1, strict=True)]
        want = []
        for ids in follow:
            rt.reset()
            want.append(rt.generate(ids, **opts).tokens)
    with ondevice.load(smollm2, drafter="none", n_ctx=512, parallel=3) as rt:
        eng = BatchEngine(rt)
        assert [r.tokens for r in eng.generate_many(first, **opts)] == r1
        res = eng.generate_many(follow[::-1], **opts)  # in another order: each finds its own sequence
        assert [r.tokens for r in res] == want[::-1]
        assert all(r.stats.prompt_eval_tokens == len(more) + 1 for r in res)  # its answer's last token + the rest
        one = rt.generate(follow[0] + want[0], **opts)  # sequence 0 held follow[0]'s turn: the one-slot path goes on
        assert one.stats.prompt_eval_tokens <= len(want[0]) + 1
        rt.reset()
        assert one.tokens == rt.generate(follow[0] + want[0], **opts).tokens
        assert [r.tokens for r in eng.generate_many(follow, **opts)] == want  # after a reset: all evaluated again


def test_one_at_a_time_speculation_on_a_parallel_runtime_stays_exact(tiny_gguf):
    """The runtime's own path on a ``parallel=N`` runtime speculates with chains (trees need one KV buffer) on
    sequence 0 and answers as plain decoding does."""
    path, draft = tiny_gguf("llama"), tiny_gguf("llama_draft")
    prompt = "1 2 3 4 5 6 7 8 9 10 1 2 3 4 5 6 7 8 9 10 1 2 3"
    want = _alone(path, [(prompt, dict(max_tokens=30, temperature=0))], n_ctx=256, threads=1)[0].tokens
    for kind in ("ngram", "model"):
        with ondevice.load(path, draft if kind == "model" else None, drafter=kind, parallel=2, n_ctx=256,
                           threads=1) as rt:
            r = rt.generate(prompt, max_tokens=30, temperature=0, gamma=3)
            assert r.tokens == want and r.stats.drafted > 0
            assert BatchEngine(rt).generate(prompt, max_tokens=30, temperature=0).tokens == want


def test_a_long_prompt_prefills_in_chunks_between_the_others_steps(tiny_gguf):
    """A prompt longer than ``n_batch`` joins one chunk per step: the running slot keeps getting tokens meanwhile,
    and both answers equal their one-at-a-time answers."""
    path = tiny_gguf("llama")
    with ondevice.load(path, drafter="none", n_ctx=1024, threads=1) as rt:
        long = rt.tokenize(" ".join(str(i) for i in range(600)))[:900]
    reqs = [(PROMPTS[1], dict(max_tokens=120, temperature=0)), (long, dict(max_tokens=5, temperature=0))]
    alone = _alone(path, reqs, n_ctx=1024, threads=1)
    log: list = []
    with ondevice.load(path, drafter="none", parallel=2, n_ctx=1024, threads=1) as rt:
        eng = BatchEngine(rt)
        assert rt.target.n_batch < len(long)
        real = eng._prefill
        eng._prefill = lambda s: (log.append(("prefill", s)), real(s))
        eng.on_step = lambda ids: log.append(("step", tuple(ids)))
        first = eng.stream(*reqs[0][:1], **reqs[0][1])
        next(iter(first))  # running alone
        second = eng.stream(reqs[1][0], **reqs[1][1])
        results = []
        for s in (first, second):
            for _ in s:
                pass
            results.append(s.tokens)
    assert results == [a.tokens for a in alone]
    chunks = [i for i, e in enumerate(log) if e == ("prefill", 1)]
    assert len(chunks) == 2 and ("step", (0,)) in log[chunks[0] + 1 : chunks[1]]  # slot 0 stepped between them
