"""Throughput through ``ondevice serve`` ÷ the same requests on a direct ``Runtime``; prints JSON.

For each prompt of the suite (scripts/prompts): one untimed call on each side (so every timed call finds
its prompt cached), then for each repeat, interleaved: the direct ``Runtime.chat`` call, then the same
chat request to the server whole, then streamed. Greedy with a fixed γ, so both do
exactly the same target passes (the texts are checked equal). tok/s is generated tokens ÷ wall time seen
by the caller (for the server: the HTTP client, request sent → last byte).

    python scripts/bench_serve.py [--model smollm2-135m-instruct] [--per-class 2] [--max-tokens 64] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import httpx

from ondevice.bench.run import CLASSES, load_prompts, machine
from ondevice.loader import load
from ondevice.server.run import launch


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--classes", default=",".join(CLASSES))
    ap.add_argument("--per-class", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--n-ctx", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=None, help="llama.cpp threads for both (default: all cores)")
    a = ap.parse_args()
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
    print(json.dumps({"machine": machine(), "config": {**vars(a), **gen}, "runs": runs,
                      "summary": {f"median_{k}": v for k, v in summary.items()}}, indent=2))


if __name__ == "__main__":
    main()
