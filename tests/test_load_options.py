"""``ondevice.load`` options for the target's cache: KV-cache types reach llama.cpp through ``load`` and the CLI,
bad values and formats that cannot honour them are one-line errors (never silently dropped)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from ondevice.backends import open_backend
from ondevice.cli.main import app
from ondevice.errors import OndeviceError
from ondevice.loader import load, size_bytes


def test_load_passes_cache_types_and_speculation_stays_exact(tiny_gguf):
    path = tiny_gguf("llama")
    prompt = "one two three four one two three four one two"
    with load(path, drafter="none", n_ctx=256, threads=1, cache_type_k="q8_0", cache_type_v="Q8_0") as rt:
        assert (rt.target.cache_type_k, rt.target.cache_type_v) == ("q8_0", "q8_0")
        plain = rt.generate(prompt, max_tokens=24, temperature=0).tokens
    with load(path, drafter="ngram", n_ctx=256, threads=1, cache_type_k="q8_0", cache_type_v="q8_0") as rt:
        assert rt.generate(prompt, max_tokens=24, temperature=0, gamma=3).tokens == plain
    with load(path, drafter="none", n_ctx=256, threads=1) as rt:  # the default stays f16
        assert (rt.target.cache_type_k, rt.target.cache_type_v) == ("f16", "f16")


def test_bad_cache_type_is_one_line_error(tiny_gguf):
    with pytest.raises(OndeviceError, match=r"cache_type_k='q5': choose a KV-cache type among f16, q8_0, q4_0"):
        load(tiny_gguf("llama"), drafter="none", n_ctx=64, cache_type_k="q5")


def test_mlx_or_coreml_model_refuses_a_quantized_cache(tmp_path):
    mlx = tmp_path / "m"
    mlx.mkdir()
    (mlx / "config.json").write_text("{}")
    (mlx / "model.safetensors").write_bytes(b"")
    with pytest.raises(OndeviceError, match=r"m: cache_type_k=q8_0 cache_type_v=f16: KV-cache types are llama.cpp's; "
                                            "a mlx model"):
        open_backend(mlx, n_ctx=64, cache_type_k="q8_0")
    pkg = tmp_path / "x.mlpackage"
    pkg.mkdir()
    with pytest.raises(OndeviceError, match="a coreml model keeps its own cache"):
        open_backend(pkg, n_ctx=64, cache_type_v="q4_0", device="mil")


def test_size_bytes():
    assert size_bytes(1000, "s") == 1000
    assert size_bytes("4GiB", "s") == 4 << 30
    assert size_bytes("512MB", "s") == 512_000_000
    assert size_bytes("1.5k", "s") == 1500
    for bad in ("lots", "-1", "0", True):
        with pytest.raises(OndeviceError, match="prompt_cache_size="):
            size_bytes(bad, "prompt_cache_size")


def test_cli_cache_types_reach_the_backend(tiny_gguf, monkeypatch):
    seen = {}
    import ondevice.loader as loader

    real = loader.open_backend

    def spy(path, **kw):
        seen.update(kw)
        return real(path, **kw)

    monkeypatch.setitem(loader.build.__kwdefaults__, "open_target", spy)  # the opener build() defaults to
    r = CliRunner().invoke(app, ["generate", str(tiny_gguf("llama")), "-p", "hello there", "--no-spec", "--max-tokens",
                                 "4", "--n-ctx", "128", "--threads", "1", "--cache-type-k", "q4_0", "--cache-type-v",
                                 "q8_0", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["stats"]["tokens"] == 4
    assert (seen["cache_type_k"], seen["cache_type_v"]) == ("q4_0", "q8_0")
    r = CliRunner().invoke(app, ["generate", str(tiny_gguf("llama")), "-p", "x", "--cache-type-v", "f8"])
    assert r.exit_code == 2 and "cache_type_v='f8'" in r.output


def test_runtime_embed(tiny_gguf):
    import numpy as np

    from ondevice.embed import embedder_for

    with load(tiny_gguf("llama"), drafter="none", n_ctx=128, threads=1) as rt:
        one, two = rt.embed("hello there"), rt.embed(["hello there", "bye"])
        assert one.shape[0] == 1 and two.shape[0] == 2
        assert np.allclose(np.linalg.norm(two, axis=1), 1, atol=1e-4)
        assert np.array_equal(one[0], embedder_for(rt).embed(["hello there"])[0][0])


def test_parallel_takes_a_prompt_cache_and_refuses_cache_types(tiny_gguf, tmp_path):
    path = tiny_gguf("llama")
    with pytest.raises(OndeviceError, match="cache_type_k / cache_type_v with parallel: not yet"):
        load(path, drafter="none", n_ctx=128, parallel=2, cache_type_v="q8_0")
    with pytest.raises(OndeviceError, match="cache_type_v='q9'"):
        load(path, drafter="none", n_ctx=128, parallel=2, cache_type_v="q9")
    prompt = " ".join(f"item {i} costs {i * 3} coins." for i in range(12))
    runs = []
    for _ in range(2):
        with load(path, drafter="none", n_ctx=256, threads=1, parallel=2, prompt_cache=tmp_path) as rt:
            runs.append(rt.generate(prompt, max_tokens=8, temperature=0))
    assert runs[0].tokens == runs[1].tokens
    assert runs[0].stats.cached_tokens == 0 and runs[1].stats.cached_tokens == runs[1].stats.prompt_tokens - 1
