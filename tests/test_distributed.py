"""A target sharded over 2 ranks on loopback (MLX ring backend), tiny models: exact, guarded, never hangs."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import PROMPT

mx = pytest.importorskip("mlx.core", reason="MLX is not installed (pip install 'ondevice[mlx]')")
if not mx.distributed.is_available():
    pytest.skip("this MLX build has no distributed backend", allow_module_level=True)

ROOT = Path(__file__).resolve().parent.parent

# One rank of a job: runs cfg["jobs"] in order; rank 0 prints one JSON line per job.
WORKER = textwrap.dedent('''
    import json, os, sys, time
    import numpy as np
    cfg = json.loads(sys.argv[1])
    rank = int(os.environ.get("MLX_RANK", "0"))
    if cfg.get("plant") == "rng":  # planted bug: each rank draws different random numbers
        real = np.random.default_rng
        np.random.default_rng = lambda seed=None: real(None if seed is None else seed + 1000 * rank)
    if cfg.get("plant") == "residual":  # planted bug: resample from p instead of the residual
        from ondevice import sampling
        sampling.residual = lambda p, q: p
    import ondevice
    from ondevice.errors import OndeviceError
    for job in cfg["jobs"]:
        out = {}
        try:
            with ondevice.load(job["model"], job.get("draft"), drafter=job.get("drafter"), device="cpu") as rt:
                for name, req in job["requests"].items():
                    seeds = req.pop("seeds", None)
                    if seeds:
                        counts = {}
                        for s in range(seeds):
                            key = " ".join(map(str, rt.generate(req["prompt"], seed=s, **req["kw"]).tokens))
                            counts[key] = counts.get(key, 0) + 1
                        out[name] = counts
                    else:
                        r = rt.generate(req["prompt"], **req["kw"])
                        out[name] = {"tokens": r.tokens, "stats": {k: getattr(r.stats, k) for k in
                                     ("world_size", "shard", "collectives", "collectives_per_token", "target_forwards")}}
        except OndeviceError as e:
            out["error"] = str(e)
        print(json.dumps(out), flush=True)
''')


def _ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _spawn(tmp_path, cfg: dict, n: int = 2, env: dict | None = None, cwds: list | None = None) -> list[subprocess.Popen]:
    """Start ``n`` ranks with the environment mlx's ring backend reads (MLX_RANK, MLX_HOSTFILE)."""
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in _ports(n)]))
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    procs = []
    for r in range(n):
        e = {**os.environ, "PYTHONPATH": str(ROOT), "MLX_RANK": str(r), "MLX_HOSTFILE": str(hostfile), **(env or {})}
        procs.append(subprocess.Popen([sys.executable, "-P", str(script), json.dumps(cfg)], env=e, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, cwd=cwds[r] if cwds else None))
    return procs


def _run(tmp_path, cfg: dict, timeout: float = 240, **kw) -> tuple[list[dict], str, list[int]]:
    procs = _spawn(tmp_path, cfg, **kw)
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=timeout))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    assert outs[1][0] == "", "only rank 0 may write to stdout"
    return [json.loads(line) for line in outs[0][0].splitlines()], outs[0][1] + outs[1][1], [p.returncode for p in procs]


def _single(model, draft=None, **kw):
    import ondevice

    with ondevice.load(model, draft, drafter=None if draft else "none", device="cpu") as rt:
        return rt.generate(PROMPT, **kw)


def _margin_at(model, tokens_ref: list[int], tokens_got: list[int]) -> float:
    """Top-1 minus top-2 logit of the single-process target where the two streams first differ."""
    from ondevice.backends.mlx import MLXBackend

    i = next(k for k, (a, b) in enumerate(zip(tokens_ref, tokens_got, strict=False)) if a != b)
    b = MLXBackend(model, n_ctx=256, device="cpu")
    ids = b.tokenize(PROMPT) + tokens_ref[:i]
    row = np.sort(b.eval(ids, logits="last")[-1])
    b.close()
    return float(row[-1] - row[-2])


def _greedy_job(model, draft):
    kw = dict(max_tokens=40, temperature=0)
    return {"model": str(model), "draft": str(draft), "requests": {
        "model_g3": {"prompt": PROMPT, "kw": {**kw, "gamma": 3}},
        "plain": {"prompt": PROMPT, "kw": {**kw, "gamma": 0}},
        "model_auto": {"prompt": PROMPT, "kw": {**kw, "gamma": "auto"}},
    }}, {"model": str(model), "drafter": "ngram", "requests": {"ngram_g4": {"prompt": PROMPT, "kw": {**kw, "gamma": 4}}}}


@pytest.mark.parametrize("shard", ["tensor", "pipeline"])
def test_sharded_greedy_equals_single_process(tiny_hf, tiny_mlx, tmp_path, shard):
    # tensor: our converted MLX model (mixed float dtypes); pipeline: the fp16 HF checkpoint, which mlx-lm
    # also loads (its pipeline passes activations in the embedding's dtype, so it needs one float dtype)
    model, draft = (tiny_mlx("qwen2"), tiny_mlx("qwen2_draft")) if shard == "tensor" else (tiny_hf["qwen2"], tiny_hf["qwen2_draft"])
    ref = _single(model, max_tokens=40, temperature=0, gamma=0).tokens
    results, err, rcs = _run(tmp_path, {"jobs": list(_greedy_job(model, draft))}, env={"ONDEVICE_SHARD": shard})
    assert rcs == [0, 0], err
    got = {**results[0], **results[1]}
    for name in ("plain", "model_g3", "model_auto", "ngram_g4"):
        r = got[name]
        assert r["stats"]["world_size"] == 2 and r["stats"]["shard"] == shard
        if r["tokens"] != ref:  # all-reduce order may flip a near-tie: allowed only there
            margin = _margin_at(model, ref, r["tokens"])
            assert margin < 1e-2, f"{name}: diverged from the single process where the margin is {margin}"
    assert got["model_g3"]["stats"]["target_forwards"] < got["plain"]["stats"]["target_forwards"]
    per_tok = got["plain"]["stats"]["collectives_per_token"]
    assert got["model_g3"]["stats"]["collectives_per_token"] < per_tok  # speculation amortizes the round trips


@pytest.mark.slow  # 2 × 500 requests over 2 ranks: ~5 min on the loaded 2-core box, ~1.5 min idle
def test_sharded_sampling_matches_target_law(tiny_mlx, tmp_path):
    from helpers import chisquare, exact_law

    from ondevice import sampling
    from ondevice.backends.mlx import MLXBackend

    target, draft = tiny_mlx("qwen2"), tiny_mlx("qwen2_draft")
    T, top_k, n = 1.0, 6, 500
    b = MLXBackend(target, n_ctx=256, device="cpu")
    ids = b.tokenize(PROMPT)
    law = exact_law(b, ids, sampling.SamplingParams(temperature=T, top_k=top_k, top_p=1.0, min_p=0.0))
    b.close()
    req = {"prompt": ids, "seeds": n, "kw": dict(max_tokens=3, temperature=T, top_k=top_k, top_p=1.0, min_p=0.0, gamma=2)}
    job = {"model": str(target), "draft": str(draft), "requests": {"counts": req}}

    def counts(**kw):
        results, err, rcs = _run(tmp_path, {"jobs": [job], **kw})
        assert rcs == [0, 0], err
        return {tuple(int(t) for t in k.split()): v for k, v in results[0]["counts"].items()}

    assert chisquare(counts(), law, n) > 1e-3
    assert chisquare(counts(plant="residual"), law, n) < 1e-4  # negative control: the test can fail


def test_divergence_guard_fires_on_rank_dependent_rng(tiny_mlx, tmp_path):
    req = {"prompt": PROMPT, "kw": dict(max_tokens=20, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, gamma=2, seed=7)}
    job = {"model": str(tiny_mlx("qwen2")), "draft": str(tiny_mlx("qwen2_draft")), "requests": {"r": req}}
    results, err, rcs = _run(tmp_path, {"jobs": [job], "plant": "rng"}, timeout=60)
    assert "ranks diverged" in results[0]["error"], results
    results, err, rcs = _run(tmp_path, {"jobs": [job]}, timeout=60)  # control: the same request, one RNG
    assert rcs == [0, 0] and "error" not in results[0], err


def test_killed_rank_ends_the_run_with_a_clear_error(tiny_mlx, tmp_path, time_scale):
    req = {"prompt": PROMPT, "seeds": 100000, "kw": dict(max_tokens=30, temperature=1.0, gamma=2)}
    job = {"model": str(tiny_mlx("qwen2")), "drafter": "ngram", "requests": {"forever": req}}
    procs = _spawn(tmp_path, {"jobs": [job]})
    time.sleep(time_scale(8))  # loaded and generating
    assert procs[0].poll() is None, procs[0].communicate()
    procs[1].kill()
    t0, limit = time.perf_counter(), time_scale(10)
    try:
        _, err = procs[0].communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        procs[0].kill()
        pytest.fail(f"rank 0 still running {limit:.0f} s after rank 1 was killed")
    assert time.perf_counter() - t0 < limit
    assert procs[0].returncode != 0
    assert "rank 1" in err and ("exited unexpectedly" in err or "lost" in err), err


def test_unshardable_models_are_one_line_errors(tiny_hf, tiny_mlx, tiny_gguf, tmp_path):
    from ondevice.testing import make_tiny_hf

    one_kv = make_tiny_hf(tmp_path / "kv1", arch="qwen2", seed=3, num_key_value_heads=1)
    jobs = [{"model": str(one_kv), "drafter": "none", "requests": {}},
            {"model": str(tiny_gguf("qwen2")), "drafter": "none", "requests": {}},
            {"model": str(tiny_mlx("qwen2")), "drafter": "none", "requests": {"ok": {"prompt": PROMPT, "kw": {"max_tokens": 4}}}}]
    # a relative path that exists in rank 0's directory only: a model missing on one machine
    (tmp_path / "r0").mkdir()
    (tmp_path / "r1").mkdir()
    (tmp_path / "r0" / "not-on-this-machine").symlink_to(tiny_mlx("qwen2"))
    jobs.insert(2, {**jobs[2], "model": "not-on-this-machine"})
    results, err, rcs = _run(tmp_path, {"jobs": jobs}, cwds=[tmp_path / "r0", tmp_path / "r1"])
    assert "1 key/value heads cannot be split evenly over 2 ranks" in results[0]["error"]
    assert "must be an MLX model directory" in results[1]["error"]
    assert "rank(s) [1] could not load the model" in results[2]["error"]
    assert "error: rank 1:" in err and "not-on-this-machine" in err  # rank 1 says what it lacks
    assert err.count("error: rank 1:") == 1  # the errors every rank shares are printed once, by rank 0
    assert len(results[3]["ok"]["tokens"]) == 4  # the job survives its refused loads
    results, err, rcs = _run(tmp_path, {"jobs": [jobs[3]]}, env={"ONDEVICE_SHARD": "pipeline"})
    assert "cannot shard" in results[0]["error"] or "mix" in results[0]["error"]


def test_mlx_launch_cli_json_is_one_document(tiny_mlx, tmp_path):
    model = tiny_mlx("qwen2")
    ref = _single(model, max_tokens=16, temperature=0, gamma=0).tokens
    port = _ports(1)[0]
    cmd = ["mlx.launch", "--backend", "ring", "-n", "2", "--starting-port", str(port), "--",
           sys.executable, "-P", "-m", "ondevice", "generate", str(model), "-p", PROMPT, "--ngram", "--gamma", "3",
           "--temperature", "0", "--max-tokens", "16", "--device", "cpu", "--json"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["stats"]["world_size"] == 2 and doc["tokens"] == ref


def test_launch_writes_a_hostfile_and_runs_mlx_launch(tmp_path):
    from ondevice.distributed.tools import hostfile

    doc = hostfile(["127.0.0.1", "localhost"])
    assert doc == {"backend": "ring", "hosts": [{"ssh": "127.0.0.1", "ips": ["127.0.0.1"]},
                                                {"ssh": "localhost", "ips": ["127.0.0.1"]}]}
    p = subprocess.run([sys.executable, "-P", "-m", "ondevice", "launch", "--hosts", "127.0.0.1,127.0.0.1", "--dry-run", "--",
                        "generate", "M", "-p", "hi there"], capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stderr
    assert "mlx.launch --hostfile" in p.stdout and "-m ondevice generate M -p 'hi there'" in p.stdout
    for args, msg in [(["--hosts", "127.0.0.1"], "at least two hosts"),
                      (["--hosts", "127.0.0.1,no-such-host.invalid"], "cannot resolve"),
                      (["--hosts", "a,b", "--backend", "jaccl"], "mlx.distributed_config"),
                      (["--hostfile", str(tmp_path / "none.json")], "no such file"), ([], "either --hosts or --hostfile")]:
        p = subprocess.run([sys.executable, "-P", "-m", "ondevice", "launch", *args, "--", "generate", "M"],
                           capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert p.returncode == 2 and msg in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_link_latency_prediction_favours_speculation_as_latency_grows():
    from ondevice.distributed.tools import predict_link

    costs = {"target_seconds": {"1": 0.010, "2": 0.011, "4": 0.013, "8": 0.018}, "draft_seconds": 0.001}
    low, high = (predict_link(costs, latency_ms=ms, world_size=2, n_layers=24) for ms in (0.01, 1.0))
    assert high["collectives_per_pass"] == 49 and "not measurements" in high["note"]
    for a, b in zip(low["by_alpha"], high["by_alpha"], strict=True):
        assert b["predicted_speedup"] > a["predicted_speedup"] > 0.5
    assert high["predicted_plain_tokens_per_second"] < low["predicted_plain_tokens_per_second"]


def test_bench_summary_reads_what_sharded_stats_record():
    from ondevice.distributed.sharded import DistStats
    from ondevice.distributed.tools import bench_summary

    def run(mode, forwards, coll):
        s = DistStats(tokens=10, target_forwards=forwards, world_size=2, shard="tensor", collectives_per_token=coll,
                      seconds_per_pass=0.01, tokens_per_second=50.0)
        return {"mode": mode, "tokens": s.tokens, "tokens_per_second": s.tokens_per_second, **s.bench_fields()}

    out = bench_summary({"runs": [run("plain", 10, 5.0), run("draft_g3", 5, 2.6), {"mode": "mlx_lm", "tokens": 3}]},
                        show=False)
    assert set(out) == {"plain", "draft_g3"}
    assert out["draft_g3"]["target_passes_per_token"] == 0.5 and out["plain"]["collectives_per_token"] == 5.0


def test_serve_under_mlx_launch_answers_with_sharded_stats(tiny_mlx, sigint_default):
    import urllib.request

    port, ring = _ports(2)
    cmd = ["mlx.launch", "--backend", "ring", "-n", "2", "--starting-port", str(ring), "--", sys.executable, "-P", "-m",
           "ondevice", "serve", str(tiny_mlx("qwen2")), "--ngram", "--port", str(port), "--device", "cpu"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    body = json.dumps({"model": "qwen2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6,
                       "temperature": 0}).encode()
    try:
        deadline, doc = time.time() + 120, None
        while doc is None and time.time() < deadline and p.poll() is None:
            try:
                req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body,
                                             {"Content-Type": "application/json"})
                doc = json.loads(urllib.request.urlopen(req, timeout=60).read())
            except OSError:
                time.sleep(1)
        assert doc is not None, p.stderr.read() if p.poll() is not None else "server did not answer"
        assert doc["usage"]["completion_tokens"] == 6 and doc["ondevice"]["world_size"] == 2
    finally:
        os.killpg(p.pid, 2)  # Ctrl-C in a terminal: the launcher and every rank get SIGINT; rank 0 decides
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, 9)
            pytest.fail("the job did not stop within 20 s of Ctrl-C")
        for _ in range(40):  # every rank ends too, not just the launcher
            try:
                os.killpg(p.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.5)
        else:
            os.killpg(p.pid, 9)
            pytest.fail("a rank outlived the job by 20 s")


def test_plan_sharding_names_what_mlx_lm_offers(tmp_path):
    from types import SimpleNamespace

    from ondevice.distributed.mlx_backend import plan_sharding
    from ondevice.errors import OndeviceError

    cfg = {"model_type": "llama", "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 512}
    neither = SimpleNamespace(model=SimpleNamespace(layers=[1, 2]))
    tensor_only = SimpleNamespace(shard=lambda g: None, model=SimpleNamespace(layers=[1, 2]))
    with pytest.raises(OndeviceError, match="cannot shard a gpt2 model; run it on one machine"):
        plan_sharding(neither, {**cfg, "model_type": "gpt2"}, 2, "auto", tmp_path)
    with pytest.raises(OndeviceError, match="by pipeline parallelism; it offers tensor"):
        plan_sharding(tensor_only, cfg, 2, "pipeline", tmp_path)
    with pytest.raises(OndeviceError, match="4 attention heads cannot be split evenly over 3 ranks"):
        plan_sharding(tensor_only, cfg, 3, "auto", tmp_path)
    with pytest.raises(OndeviceError, match="ONDEVICE_SHARD='rows'"):
        plan_sharding(tensor_only, cfg, 2, "rows", tmp_path)
    assert plan_sharding(tensor_only, cfg, 2, "auto", tmp_path) == "tensor"


@pytest.mark.parametrize("shard", ["tensor", "pipeline"])
def test_no_code_from_a_model_folder_runs_when_sharded(tiny_hf, tmp_path, shard):
    """mlx-lm's sharded_load trusts a folder's auto_map; the sharded backend loads its tokenizer without it."""
    from test_security_store import with_auto_map

    marker = tmp_path / "MARKER"
    model = with_auto_map(tiny_hf["qwen2"], tmp_path / "evil", marker)
    job = {"model": str(model), "drafter": "none", "requests": {"r": {"prompt": PROMPT, "kw": {"max_tokens": 4}}}}
    results, err, rcs = _run(tmp_path, {"jobs": [job]}, env={"ONDEVICE_SHARD": shard,
                                                              "HF_MODULES_CACHE": str(tmp_path / "modules")})
    assert rcs == [0, 0] and len(results[0]["r"]["tokens"]) == 4, (results, err)
    assert not marker.exists(), "the model folder's code ran"
