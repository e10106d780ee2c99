"""`ondevice bench`: a quick run on a tiny model produces JSON that follows the documented schema."""

from __future__ import annotations

import json
import subprocess
import sys

import jsonschema

from ondevice.bench.run import SCHEMA


def test_bench_json_follows_schema(tiny_gguf, tmp_path):
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "-P", "-m", "ondevice", "bench", str(tiny_gguf("llama")), "--draft", str(tiny_gguf("llama_draft")),
                        "--ngram", "--max-tokens", "8", "--repeats", "2", "--per-class", "1", "--gamma", "sweep",
                        "--anchors", "--json", str(out), "--plot", str(tmp_path / "plots")],
                       capture_output=True, text=True, timeout=600, env={**__import__("os").environ, "ONDEVICE_HOME": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    jsonschema.validate(doc, SCHEMA)
    modes = {row["mode"] for row in doc["runs"]}
    assert {"plain", "draft_g1", "draft_g8", "draft_auto", "ngram_g4", "ngram_auto",
            "llama_cpp_create_completion", "llama_cpp_prompt_lookup"} <= modes
    assert {row["class"] for row in doc["runs"]} == {"code", "edit", "summary", "chat"}
    assert all(r["repeat"] in (0, 1) for r in doc["runs"])
    assert set(doc["costs"]["verify_cost"]) >= {"1", "2", "4", "8", "16"} and doc["costs"]["verify_cost"]["1"] == 1.0
    assert any(row["bound"] is not None for row in doc["summary"])
    assert len(list((tmp_path / "plots").glob("*.png"))) == 3


def test_bench_mlx_anchors(tiny_mlx, tmp_path):
    """An MLX target and draft: the anchors are mlx-lm's stream_generate, plain and with draft_model."""
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "-P", "-m", "ondevice", "bench", str(tiny_mlx("llama")), "--draft", str(tiny_mlx("llama_draft")),
                        "--classes", "code", "--max-tokens", "8", "--repeats", "1", "--per-class", "1", "--gamma", "3",
                        "--anchors", "--device", "cpu", "--json", str(out)],
                       capture_output=True, text=True, timeout=600, env={**__import__("os").environ, "ONDEVICE_HOME": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    jsonschema.validate(doc, SCHEMA)
    runs = {row["mode"]: row for row in doc["runs"]}
    assert {"plain", "draft_g3", "mlx_lm_stream_generate", "mlx_lm_stream_generate_draft_g3"} <= set(runs)
    assert runs["mlx_lm_stream_generate"]["tokens"] >= 1 and runs["mlx_lm_stream_generate"]["tokens_per_second"] > 0


def test_bench_synthetic_costs_and_predictions(tmp_path):
    from converters.synthetic import synthetic_costs

    doc = synthetic_costs("tiny", draft_config="tiny", cache_dir=tmp_path)
    assert set(doc["costs"]["verify_cost"]) == {str(k) for k in range(1, 17)}
    assert doc["prediction"] and all(p["predicted_speedup"] > 0 for p in doc["prediction"])
    assert "prediction" in doc["note"]


def test_quick_bench_is_small_and_reads_the_cached_cost_curve(tiny_gguf, tmp_path, monkeypatch):
    """``ondevice bench MODEL --ngram`` (no --per-class / --repeats) is the quick run. Before: the whole suite
    (28 prompts × 3 repeats × 2 modes = 168 requests) and a fresh cost probe, retried up to 3 times while a
    loaded machine made it implausible, beside the runtime's own (cached) probe: over 5 minutes with one core
    busy. Now: 2 prompts per class × 2 repeats, and the cost curve of ``costs.cached_measure``, probed once
    (attempts=1) and read back by the runtime and by the next run (no probe at all)."""
    from typer.testing import CliRunner

    import ondevice.bench.run as bench_run
    import ondevice.costs as costs
    from ondevice.cli.main import app

    monkeypatch.setenv("ONDEVICE_HOME", str(tmp_path / "home"))
    probes: list[int] = []

    def probe(target, draft=None, *, attempts=3, **kw):  # a plausible curve, whatever this machine's load
        probes.append(attempts)
        return costs.Costs({k: 0.01 * (1 + 0.1 * (k - 1)) for k in costs.probe_shape(target, draft)[0]})

    monkeypatch.setattr(costs, "measure", probe)
    monkeypatch.setattr(bench_run, "measure", probe, raising=False)  # where the bench imported its own
    for run in range(2):
        out = tmp_path / f"bench{run}.json"
        r = CliRunner().invoke(app, ["bench", str(tiny_gguf("llama")), "--ngram", "--max-tokens", "4", "--threads", "1",
                                     "--json", str(out)])
        assert r.exit_code == 0, (r.output, r.exception)
        doc = json.loads(out.read_text())
        assert len(doc["runs"]) == 4 * 2 * 2 * 2, len(doc["runs"])  # classes × prompts × repeats × (plain, ngram)
        assert doc["config"]["repeats"] == 2 and "quick run" in r.output
        assert probes == [1], probes  # run 0: one probe, not retried; run 1: the cached curve, no probe
    # sizes given: as asked (all prompts of a class, the default 3 repeats)
    out = tmp_path / "sized.json"
    r = CliRunner().invoke(app, ["bench", str(tiny_gguf("llama")), "--ngram", "--max-tokens", "2", "--threads", "1",
                                 "--classes", "chat", "--per-class", "1", "--json", str(out)])
    assert r.exit_code == 0 and len(json.loads(out.read_text())["runs"]) == 1 * 3 * 2, r.output
