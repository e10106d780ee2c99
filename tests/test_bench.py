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
