"""``ondevice serve`` measured from HTTP clients; prints JSON. Three modes (``--mode``):

``direct`` (default): throughput through the server ÷ the same requests on a direct ``Runtime``. For each prompt
of the suite (scripts/prompts): one untimed call on each side (so every timed call finds its prompt cached), then
for each repeat, interleaved: the direct ``Runtime.chat`` call, then the same chat request to the server whole,
then streamed. Greedy with a fixed γ, so both do exactly the same target passes (the texts are checked equal).
tok/s is generated tokens ÷ wall time seen by the caller (for the server: the HTTP client, request sent → last
byte).

``concurrent``: 1/2/4/8 clients (``--clients``) at once against ``serve --parallel N`` and against a one-at-a-time
server (the requests then queue, FIFO), both plain (``--no-spec``) and up side by side, the two alternated
``--repeats`` times: aggregate tok/s, per-request latency and time to first token (streamed), the answers checked
equal, the speed-up of the run with the median one, and the load average around each run.

``prompt-cache``: a ~2k-token system prompt (``--system-tokens``) sent to ``serve --prompt-cache DIR`` (an empty
folder), then the server is restarted and a request with the same system prompt and another question is sent:
time to first token cold vs restored from disk, and ``usage.prompt_tokens_details.cached_tokens``; with
``--parallel N`` (N >= 2) the request goes through the batched slots. Repeated ``--repeats`` times (a fresh folder
each time).

    python scripts/bench_serve.py [--mode direct|concurrent|prompt-cache] [--model smollm2-135m-instruct] ...
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time

import httpx

from ondevice.bench.run import CLASSES, load_prompts, machine
from ondevice.loader import load
from ondevice.server.run import launch
from ondevice.threads import default_threads


def _server(client: httpx.Client, url: str, model: str, msgs: list, gen: dict, stream: bool) -> tuple[str, int, float]:
    body = {"model": model, "messages": msgs, "stream": stream, **gen}
    if stream:
        body["stream_options"] = {"include_usage": True}
    t0 = time.perf_counter()
    if not stream:
        r = client.post(url + "/v1/chat/completions", json=body)
        r.raise_for_status()
        d = r.json()
        return d["choices"][0]["message"]["content"], d["usage"]["completion_tokens"], time.perf_counter() - t0
    text, tokens = [], 0
    with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if ev["choices"]:
                text.append(ev["choices"][0]["delta"].get("content") or "")
            elif ev.get("usage"):
                tokens = ev["usage"]["completion_tokens"]
    return "".join(text), tokens, time.perf_counter() - t0


def direct(a) -> dict:
    """The ``direct`` mode (see the module's docstring)."""
    gen = {"temperature": 0, "max_tokens": a.max_tokens, "gamma": a.gamma}
    prompts = load_prompts(a.classes.split(","), per_class=a.per_class)
    proc, url = launch(a.model, "--n-ctx", str(a.n_ctx), *(["--threads", str(a.threads)] if a.threads else []))
    runs = []
    try:
        with load(a.model, n_ctx=a.n_ctx, threads=a.threads) as rt, httpx.Client(timeout=600) as client:
            model_id = client.get(url + "/v1/models").json()["data"][0]["id"]
            for p in prompts:
                msgs = [{"role": "user", "content": p["prompt"]}]
                rt.chat(msgs, **gen)  # untimed: every timed call below then finds the prompt in its cache
                _server(client, url, model_id, msgs, gen, False)
                for rep in range(a.repeats):
                    t0 = time.perf_counter()
                    res = rt.chat(msgs, **gen)
                    direct = res.stats.tokens / (time.perf_counter() - t0)
                    row = {"prompt_id": p["id"], "class": p["class"], "repeat": rep, "tokens": res.stats.tokens,
                           "direct_tokens_per_second": direct}
                    for mode, stream in (("server", False), ("server_stream", True)):
                        text, tokens, secs = _server(client, url, model_id, msgs, gen, stream)
                        if text != res.text or tokens != res.stats.tokens:
                            raise SystemExit(f"{p['id']}: the server's {mode} answer differs from the direct one")
                        row[f"{mode}_tokens_per_second"] = tokens / secs
                        row[f"{mode}_ratio"] = row[f"{mode}_tokens_per_second"] / direct
                    runs.append(row)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    summary = {k: statistics.median(r[k] for r in runs) for k in
               ("direct_tokens_per_second", "server_tokens_per_second", "server_stream_tokens_per_second",
                "server_ratio", "server_stream_ratio")}
    return {"machine": machine(), "config": {**vars(a), **gen}, "runs": runs,
            "summary": {f"median_{k}": v for k, v in summary.items()}}


def _stream(client: httpx.Client, url: str, body: dict, t0: float | None = None) -> dict:
    """One streamed chat request: its text, usage, latency and time to first token (seconds from ``t0``, default
    now: a queued request's wait counts)."""
    t0 = time.perf_counter() if t0 is None else t0
    text, first, use = [], None, {}
    with client.stream("POST", url + "/v1/chat/completions",
                       json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            ev = json.loads(line[6:])
            if ev["choices"]:
                piece = ev["choices"][0]["delta"].get("content") or ""
                if piece and first is None:
                    first = time.perf_counter() - t0
                text.append(piece)
            elif ev.get("usage"):
                use = ev["usage"]
    return {"text": "".join(text), "usage": use, "latency": time.perf_counter() - t0, "ttft": first}


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _clients(url: str, model: str, questions: list[str], gen: dict) -> tuple[list[dict], float]:
    """Every question sent at once, one client thread each; (results in order, wall seconds)."""
    out: list = [None] * len(questions)

    def ask(i: int) -> None:
        with httpx.Client(timeout=600) as c:
            msg = [{"role": "user", "content": questions[i]}]
            out[i] = _stream(c, url, {"model": model, "messages": msg, **gen}, t0)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(questions))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if any(r is None for r in out):
        raise SystemExit("a client failed (see the traceback above)")
    return out, time.perf_counter() - t0


def _summary(res: list[dict], wall: float) -> dict:
    tokens = sum(r["usage"].get("completion_tokens", 0) for r in res)
    lat, ttft = [r["latency"] for r in res], [r["ttft"] or r["latency"] for r in res]
    return {"tokens": tokens, "seconds": round(wall, 3), "tokens_per_second": round(tokens / wall, 2),
            "latency_mean": round(statistics.mean(lat), 3), "latency_max": round(max(lat), 3),
            "ttft_mean": round(statistics.mean(ttft), 3), "ttft_max": round(max(ttft), 3)}


QUESTIONS = [f"Count from {i} to {i + 40}, separated by commas." for i in range(1, 9)]  # long, distinct answers


def concurrent(a) -> dict:
    """The ``concurrent`` mode (see the module's docstring)."""
    ks = [int(k) for k in a.clients.split(",")]
    n = a.parallel or max(ks)
    gen = {"temperature": 0, "max_tokens": a.max_tokens}
    threads = a.threads or default_threads()  # one count for both (each server would pick its own at load)
    common = ["--n-ctx", str(a.n_ctx), "--no-spec", "--max-queue", "64", "--threads", str(threads)]
    par, purl = launch(a.model, *common, "--parallel", str(n))
    try:
        one, ourl = launch(a.model, *common)
        try:
            model_id = httpx.get(purl + "/v1/models").json()["data"][0]["id"]
            _clients(purl, model_id, QUESTIONS[:1], gen)  # warm-up of both (first decode, page cache)
            _clients(ourl, model_id, QUESTIONS[:1], gen)
            rows = []
            for k in ks:
                qs = [QUESTIONS[i % len(QUESTIONS)] for i in range(k)]
                runs = []
                for _ in range(a.repeats):  # alternated: a change of the machine's load hits both alike
                    before = _load()
                    b = _clients(purl, model_id, qs, gen)
                    o = _clients(ourl, model_id, qs, gen)
                    runs.append({"batched": b, "one_at_a_time": o, "load": [before, _load()]})
                speed = [r["one_at_a_time"][1] / r["batched"][1] for r in runs]
                med = sorted(range(len(runs)), key=speed.__getitem__)[len(runs) // 2]
                r = runs[med]
                rows.append({"clients": k, "batched": _summary(*r["batched"]),
                             "one_at_a_time": _summary(*r["one_at_a_time"]), "speedup": round(speed[med], 3),
                             "speedups": sorted(round(x, 3) for x in speed), "load_average": r["load"],
                             "answers_equal": all([x["text"] for x in q["batched"][0]] ==
                                                  [x["text"] for x in q["one_at_a_time"][0]] for q in runs)})
        finally:
            one.terminate()
            one.wait(timeout=30)
    finally:
        par.terminate()
        par.wait(timeout=30)
    return {"machine": machine(), "config": {**vars(a), "parallel": n, "threads": threads, **gen}, "rows": rows}


def _system_prompt(tokens: int) -> str:
    """About ``tokens`` tokens of rules (≈ 22 tokens a rule on SmolLM2's tokenizer)."""
    return "You are a careful assistant. Follow these rules.\n" + "\n".join(
        f"Rule {i}: when asked about item {i * 7 % 101}, answer in at most {i % 9 + 2} words." for i in range(tokens // 22))


def prompt_cache(a) -> dict:
    """The ``prompt-cache`` mode (see the module's docstring)."""
    import tempfile

    gen = {"temperature": 0, "max_tokens": 16}
    system = _system_prompt(a.system_tokens)
    threads = a.threads or default_threads()  # one count for both runs
    opts = ["--n-ctx", str(a.n_ctx), "--threads", str(threads),
            *(["--parallel", str(a.parallel)] if a.parallel and a.parallel > 1 else [])]
    runs = []
    for rep in range(a.repeats):
        with tempfile.TemporaryDirectory(prefix="ondevice-bench-pc-") as d:
            got = []
            for phase, question in (("cold", "What does rule 3 say?"), ("restored", "And rule 5?")):
                proc, url = launch(a.model, *opts, "--prompt-cache", d)  # a fresh server: a restart
                try:
                    model_id = httpx.get(url + "/v1/models").json()["data"][0]["id"]
                    msgs = [{"role": "system", "content": system}, {"role": "user", "content": question}]
                    load = _load()
                    with httpx.Client(timeout=600) as c:
                        r = _stream(c, url, {"model": model_id, "messages": msgs, **gen})
                finally:
                    proc.terminate()
                    proc.wait(timeout=30)
                u = r["usage"]
                cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                got.append({"phase": phase, "prompt_tokens": u.get("prompt_tokens"), "cached_tokens": cached,
                            "reused": round(cached / u["prompt_tokens"], 3), "ttft": round(r["ttft"], 3),
                            "latency": round(r["latency"], 3), "load_average": load})
            runs.append({"repeat": rep, "cold": got[0], "restored": got[1],
                         "ttft_ratio": round(got[1]["ttft"] / got[0]["ttft"], 3)})
    ratios = sorted(r["ttft_ratio"] for r in runs)
    return {"machine": machine(), "config": {**vars(a), "threads": threads, **gen}, "runs": runs,
            "summary": {"median_ttft_ratio": ratios[len(ratios) // 2], "ttft_ratios": ratios,
                        "min_reused": min(r["restored"]["reused"] for r in runs),
                        "pass": ratios[len(ratios) // 2] <= 0.6 and all(r["restored"]["reused"] >= 0.8 for r in runs)}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=("direct", "concurrent", "prompt-cache"), default="direct")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--classes", default=",".join(CLASSES), help="direct: prompt classes of the suite")
    ap.add_argument("--per-class", type=int, default=2, help="direct: prompts per class")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--gamma", type=int, default=4, help="direct: draft length")
    ap.add_argument("--n-ctx", type=int, default=None, help="default: 2048 (direct), 512 (concurrent), 4096")
    ap.add_argument("--threads", type=int, default=None,
                    help="llama.cpp threads for both sides (default: the cores free now, one count for both)")
    ap.add_argument("--clients", default="1,2,4,8", help="concurrent: clients at once, per row")
    ap.add_argument("--parallel", type=int, default=None, help="slots of the batched server (default: most clients)")
    ap.add_argument("--system-tokens", type=int, default=2000, help="prompt-cache: size of the system prompt")
    ap.add_argument("--json", default=None, help="also write the report here")
    a = ap.parse_args(argv)
    a.n_ctx = a.n_ctx or {"direct": 2048, "concurrent": 512, "prompt-cache": 4096}[a.mode]
    report = {"direct": direct, "concurrent": concurrent, "prompt-cache": prompt_cache}[a.mode](a)
    text = json.dumps(report, indent=2)
    print(text)
    if a.json:
        from ondevice.atomic import write_text

        write_text(a.json, text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
