"""Models where users keep them (HF cache, Ollama, LM Studio), local discovery and draft="auto".

Every store is a real on-disk layout holding real tiny models: the HF cache is built in the layout
huggingface_hub reads (models--ORG--REPO/{blobs,snapshots/REV,refs/main}) and resolved through
huggingface_hub itself with HF_HUB_OFFLINE=1; Ollama's is manifest JSON + sha256-named blobs.
Downloads are tested at the huggingface_hub call boundary only (no network here).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TINY_CACHE, _converted

import ondevice
from ondevice import autodraft, discovery, sources
from ondevice.costs import Costs
from ondevice.errors import OndeviceError

REV = "0123456789abcdef0123456789abcdef01234567"


def _tiny(name: str, quant: str = "q8_0", edit_vocab=None, **kw) -> Path:
    """A tiny GGUF (cached on disk): make_tiny_hf(**kw) → our converter; ``edit_vocab`` edits tokenizer.json first."""
    from ondevice.testing import make_tiny_hf

    hf = TINY_CACHE / "hf" / f"sources-{name}"
    if not (hf / "model.safetensors").is_file():
        make_tiny_hf(hf, **kw)
        if edit_vocab:
            tj = json.loads((hf / "tokenizer.json").read_text())
            edit_vocab(tj["model"]["vocab"])
            (hf / "tokenizer.json").write_text(json.dumps(tj))
    return _converted(TINY_CACHE / "gguf" / f"sources-{name}-{quant}", "model.gguf", hf, to="gguf", quant=quant) / "model.gguf"


def _swap_two(vocab: dict) -> None:
    """Same 512 tokens, but ids 300 and 301 exchange their texts (LM Studio's vocab_size check would pass)."""
    a, b = (t for t, i in vocab.items() if i in (300, 301))
    vocab[a], vocab[b] = vocab[b], vocab[a]


def hf_put(cache: Path, repo: str, files: dict[str, Path]) -> Path:
    """Store ``files`` (name → source) as huggingface_hub lays out a download; returns the snapshot dir."""
    base = cache / f"models--{repo.replace('/', '--')}"
    snap = base / "snapshots" / REV
    for name, src in files.items():
        data = src.read_bytes()
        blob = base / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snap / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (base / "refs").mkdir(exist_ok=True)
    (base / "refs" / "main").write_text(REV)
    return snap


def ollama_put(root: Path, name: str, tag: str, blob_src: Path | None, digest: str | None = None) -> Path:
    """An Ollama manifest (+ its sha256-named model blob unless ``blob_src`` is None)."""
    data = blob_src.read_bytes() if blob_src else b""
    digest = digest or hashlib.sha256(data).hexdigest()
    if blob_src:
        (root / "blobs").mkdir(parents=True, exist_ok=True)
        (root / "blobs" / f"sha256-{digest}").write_bytes(data)
    manifest = root / "manifests" / "registry.ollama.ai" / "library" / name / tag
    manifest.parent.mkdir(parents=True, exist_ok=True)
    manifest.write_text(json.dumps({"schemaVersion": 2, "layers": [
        {"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}", "size": len(data) or 123},
        {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:" + "0" * 64, "size": 10}]}))
    return manifest


@pytest.fixture(scope="module")
def models(tiny_hf):
    """The tiny models: a 12-layer target, its 2-layer draft, and decoys."""
    return {
        "target": _tiny("target", n_layers=12, seed=3),
        "target_f16": _tiny("target", "f16", n_layers=12, seed=3),
        "draft": _tiny("draft", n_layers=2, seed=3, perturb_seed=7, perturb_scale=0.03),
        "big": _tiny("big", n_layers=8, seed=4),  # compatible, but 0.67 of the target's size
        "swapped": _tiny("swapped", n_layers=2, seed=5, edit_vocab=_swap_two),  # same vocab size, other texts
        "qwen2": _tiny("qwen2", arch="qwen2", n_layers=2, seed=6),  # another architecture and vocabulary
        "qwen2_hf": tiny_hf["qwen2"],
    }


@pytest.fixture()
def stores(models, tmp_path, monkeypatch):
    """HF cache + Ollama store + LM Studio folder in tmp, pointed at by the environment (offline)."""
    hub = tmp_path / "hf" / "hub"
    hf_put(hub, "tiny/target-GGUF", {"tiny-target-Q8_0.gguf": models["target"], "tiny-target-F16.gguf": models["target_f16"]})
    hf_put(hub, "tiny/qwen2-mlx", {f.name: f for f in models["qwen2_hf"].iterdir() if f.is_file()})
    ollama = tmp_path / "ollama"
    ollama_put(ollama, "tinydraft", "latest", models["draft"])
    lms = tmp_path / "lmstudio"
    for rel, src in {"decoys/tiny-swapped-GGUF/tiny-swapped-Q8_0.gguf": models["swapped"],
                     "decoys/tiny-qwen2-GGUF/tiny-qwen2-Q8_0.gguf": models["qwen2"],
                     "decoys/tiny-big-GGUF/tiny-big-Q8_0.gguf": models["big"]}.items():
        (lms / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, lms / rel)
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "OLLAMA_MODELS": str(ollama),
           "ONDEVICE_LMSTUDIO_MODELS": str(lms), "ONDEVICE_HOME": str(tmp_path / "home")}
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return {"hub": hub, "ollama": ollama, "lmstudio": lms, "env": env, "tmp": tmp_path}


def _greedy(model, **kw) -> list[int]:
    with ondevice.load(model, drafter="none", n_ctx=128, **kw) as rt:
        return rt.generate("the model", max_tokens=6, temperature=0, gamma=0).tokens


def test_every_kind_of_name_resolves_loads_and_generates(stores, models):
    hub = stores["hub"]
    snap = hub / "models--tiny--target-GGUF" / "snapshots" / REV
    assert sources.resolve("hf:tiny/target-GGUF:Q8_0") == snap / "tiny-target-Q8_0.gguf"
    assert sources.resolve("hf:tiny/target-GGUF:tiny-target-F16.gguf") == snap / "tiny-target-F16.gguf"
    assert sources.resolve("hf:tiny/target-GGUF@main:f16") == snap / "tiny-target-F16.gguf"
    assert sources.resolve("tiny/target-GGUF:Q8_0") == snap / "tiny-target-Q8_0.gguf"  # bare: only the HF cache has it
    assert sources.resolve("hf:tiny/qwen2-mlx") == hub / "models--tiny--qwen2-mlx" / "snapshots" / REV
    blob = sources.resolve("ollama:tinydraft")
    assert blob.parent == stores["ollama"] / "blobs" and blob.name.startswith("sha256-")
    assert sources.resolve("ollama:tinydraft:latest") == blob
    lms = stores["lmstudio"]
    assert sources.resolve("lmstudio:decoys/tiny-big-GGUF") == lms / "decoys/tiny-big-GGUF/tiny-big-Q8_0.gguf"
    assert sources.resolve("lmstudio:tiny-swapped-Q8_0") == lms / "decoys/tiny-swapped-GGUF/tiny-swapped-Q8_0.gguf"
    assert sources.resolve("smollm2-135m-instruct") is None and sources.resolve("./x.gguf") is None

    reference = _greedy(models["target"])
    assert _greedy("hf:tiny/target-GGUF:Q8_0") == reference  # the same file, read in place
    assert _greedy("tiny/target-GGUF:Q8_0") == reference
    assert _greedy("ollama:tinydraft") == _greedy(models["draft"])
    assert _greedy("lmstudio:tiny-big") == _greedy(models["big"])
    if shutil.which("true") and __import__("importlib").util.find_spec("mlx_lm") is not None:
        assert len(_greedy("hf:tiny/qwen2-mlx")) == 6


def test_cached_names_never_reach_the_network(stores, monkeypatch):
    """With HF_HUB_OFFLINE unset and every socket refused, cached hf: names and local stores still resolve."""
    monkeypatch.delenv("HF_HUB_OFFLINE")

    def refuse(*a, **k):
        raise AssertionError("network access")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    assert sources.resolve("hf:tiny/target-GGUF:Q8_0").name == "tiny-target-Q8_0.gguf"
    assert sources.resolve("tiny/qwen2-mlx").is_dir()
    assert len(discovery.local_models()) == 7
    with pytest.raises(OndeviceError, match="no repo of that name.*say hf:nobody/nothing to download"):
        sources.resolve("nobody/nothing")  # a bare name never downloads


def test_models_local_lists_every_store(stores):
    rows = {r["name"]: r for r in discovery.local_models()}
    assert set(rows) == {
        "hf:tiny/qwen2-mlx", "hf:tiny/target-GGUF:tiny-target-F16.gguf", "hf:tiny/target-GGUF:tiny-target-Q8_0.gguf",
        "lmstudio:decoys/tiny-big-GGUF/tiny-big-Q8_0.gguf", "lmstudio:decoys/tiny-qwen2-GGUF/tiny-qwen2-Q8_0.gguf",
        "lmstudio:decoys/tiny-swapped-GGUF/tiny-swapped-Q8_0.gguf", "ollama:tinydraft:latest"}
    t = rows["hf:tiny/target-GGUF:tiny-target-Q8_0.gguf"]
    assert (t["format"], t["arch"], t["quant"], t["vocab_size"]) == ("gguf", "llama", "Q8_0", 512)
    assert t["size"] == Path(t["path"]).stat().st_size
    assert rows["hf:tiny/target-GGUF:tiny-target-F16.gguf"]["quant"] == "F16"
    mlx = rows["hf:tiny/qwen2-mlx"]
    assert (mlx["format"], mlx["arch"], mlx["vocab_size"]) == ("mlx", "qwen2", 512)
    # the fingerprint is of token texts: same tokenizer → same; same count but two texts swapped → different
    fp = {n: r["fingerprint"] for n, r in rows.items()}
    assert fp["ollama:tinydraft:latest"] == t["fingerprint"] == fp["lmstudio:decoys/tiny-big-GGUF/tiny-big-Q8_0.gguf"]
    assert fp["lmstudio:decoys/tiny-swapped-GGUF/tiny-swapped-Q8_0.gguf"] != t["fingerprint"]
    assert fp["hf:tiny/qwen2-mlx"] == fp["lmstudio:decoys/tiny-qwen2-GGUF/tiny-qwen2-Q8_0.gguf"]  # GGUF ≡ tokenizer.json

    # the CLI, as a user runs it (offline, the stores from the environment)
    env = {**os.environ, **stores["env"]}
    out = subprocess.run([sys.executable, "-m", "ondevice", "models", "--local", "--json"], env=env,
                         capture_output=True, text=True, check=True)
    doc = json.loads(out.stdout)
    assert {m["name"] for m in doc["models"]} == set(rows) and doc["stores"]["ollama"] == str(stores["ollama"])


def test_fingerprints_are_cached_by_path_size_and_mtime(stores, monkeypatch):
    first = discovery.local_models()
    assert (Path(stores["env"]["ONDEVICE_HOME"]) / "fingerprints.json").is_file()
    read = []
    for fn in ("_gguf_facts", "_dir_facts"):
        orig = getattr(discovery, fn)
        monkeypatch.setattr(discovery, fn, lambda path, orig=orig: read.append(Path(path).name) or orig(path))
    assert discovery.local_models() == first and read == []  # nothing re-read
    f = stores["lmstudio"] / "decoys/tiny-big-GGUF/tiny-big-Q8_0.gguf"
    os.utime(f, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns + 10**9))  # touched: its facts are read again
    assert discovery.local_models() == first and read == ["tiny-big-Q8_0.gguf"]
    assert discovery.local_models() == first and read == ["tiny-big-Q8_0.gguf"]  # and cached again


def _cli_error(env, *args) -> str:
    out = subprocess.run([sys.executable, "-m", "ondevice", *args], env={**os.environ, **env}, capture_output=True, text=True)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), out.stderr
    return lines[0]


def test_one_line_errors(stores, models):
    root = stores["ollama"]
    ollama_put(root, "nomodel", "latest", None, digest="ab" * 32)  # manifest without its blob
    (root / "manifests/registry.ollama.ai/library/broken").mkdir(parents=True)
    (root / "manifests/registry.ollama.ai/library/broken/latest").write_text("{not json")
    second = stores["tmp"] / "lmstudio2"
    (second / "tiny/target-GGUF").mkdir(parents=True)
    shutil.copyfile(models["draft"], second / "tiny/target-GGUF/x-Q8_0.gguf")
    env = {**stores["env"], "ONDEVICE_LMSTUDIO_MODELS": os.pathsep.join([str(stores["lmstudio"]), str(second)])}
    assert "corrupt Ollama manifest" in _cli_error(env, "info", "ollama:broken")
    assert "has no such file; run `ollama pull nomodel` again" in _cli_error(env, "info", "ollama:nomodel")
    msg = _cli_error(env, "info", "tiny/target-GGUF:Q8_0")
    assert "ambiguous" in msg and "hf:tiny/target-GGUF" in msg and "lmstudio:tiny/target-GGUF" in msg
    assert f"no manifest at {root}/manifests/registry.ollama.ai/library/nothere/7b" in _cli_error(env, "info", "ollama:nothere:7b")
    msg = _cli_error(env, "info", "hf:tiny/uncached")
    assert "not in the Hugging Face cache" in msg and "HF_HUB_OFFLINE is set" in msg
    assert "holds 2 GGUF files" in _cli_error(env, "info", "hf:tiny/target-GGUF")
    assert "no GGUF matching 'Q2_K'" in _cli_error(env, "info", "hf:tiny/target-GGUF:Q2_K")
    assert "nothing of that name in LM Studio" in _cli_error(env, "info", "lmstudio:nope")
    # a broken store entry is listed with its error, the rest still work
    rows = {r["name"]: r for r in discovery.local_models()}
    assert "corrupt" in rows["ollama:broken:latest"]["error"] and "fingerprint" in rows["ollama:tinydraft:latest"]
    # truncated blob: the manifest's size disagrees
    blob = sources.resolve("ollama:tinydraft")
    blob.write_bytes(blob.read_bytes()[:1000])
    with pytest.raises(OndeviceError, match="truncated download"):
        sources.resolve("ollama:tinydraft")


def test_auto_draft_picks_the_compatible_small_model_and_explains(stores, models):
    with ondevice.load("hf:tiny/target-GGUF:Q8_0", draft="auto", n_ctx=256) as rt:
        choice = rt.draft_choice
        assert choice["drafter"] == "model" and choice["draft"] == "ollama:tinydraft:latest", choice["reason"]
        assert rt.drafter.name == "model" and "expected" in choice["reason"]
        verdicts = {re.split("[/:]", c["name"])[-1]: c for c in choice["candidates"]}
        assert verdicts["tiny-swapped-Q8_0.gguf"]["reason"].startswith("vocabulary differs (512 tokens, same count")
        assert verdicts["tiny-qwen2-Q8_0.gguf"]["reason"].startswith("vocabulary differs")
        assert verdicts["qwen2-mlx"]["reason"].startswith("vocabulary differs")
        assert verdicts["tiny-big-Q8_0.gguf"]["reason"].startswith("not much smaller (0.6")
        assert verdicts["tiny-target-F16.gguf"]["reason"].startswith("not much smaller")
        assert [c["name"] for c in choice["candidates"] if c["ok"]] == ["ollama:tinydraft:latest"]
        spec = rt.generate("the model draft", max_tokens=16, temperature=0, gamma=3)
        assert spec.stats.drafted > 0
    assert spec.tokens == _greedy_n(models["target"], 16)  # exact: greedy speculative == greedy plain

    # the CLI says it too (--json carries draft_choice)
    out = subprocess.run([sys.executable, "-m", "ondevice", "generate", "hf:tiny/target-GGUF:Q8_0", "-p", "the", "--draft",
                          "auto", "--max-tokens", "4", "--json", "--n-ctx", "256"], env={**os.environ, **stores["env"]},
                         capture_output=True, text=True, check=True)
    assert json.loads(out.stdout)["draft_choice"]["draft"] == "ollama:tinydraft:latest"
    out = subprocess.run([sys.executable, "-m", "ondevice", "check-pair", "hf:tiny/target-GGUF:Q8_0"],
                         env={**os.environ, **stores["env"]}, capture_output=True, text=True, check=True)
    assert "ollama:tinydraft:latest" in out.stdout and "not much smaller" in out.stdout


def _greedy_n(model, n: int) -> list[int]:
    with ondevice.load(model, drafter="none", n_ctx=256) as rt:
        return rt.generate("the model draft", max_tokens=n, temperature=0, gamma=0).tokens


def test_auto_draft_without_a_compatible_model_uses_ngram(stores, monkeypatch):
    shutil.rmtree(stores["ollama"])  # the only compatible small model
    with ondevice.load("hf:tiny/target-GGUF:Q8_0", draft="auto", n_ctx=128) as rt:
        assert rt.drafter.name == "ngram" and rt.draft_choice["drafter"] == "ngram"
        assert rt.draft_choice["reason"].startswith("no compatible, much smaller model among the 5 other local models")
        assert rt.generate("the model", max_tokens=4, temperature=0).stats.tokens == 4


def test_auto_draft_falls_back_when_no_draft_would_pay(stores, monkeypatch):
    """A compatible draft that costs as much as the target: the cost model says n-gram (negative control:
    the same draft at a cost ratio of 0.05 is chosen)."""
    def measured(ratio):
        return lambda target, draft: Costs({1: 1.0, 2: 1.1, 4: 1.3, 8: 2.0, 16: 3.5}, ratio)

    monkeypatch.setattr("ondevice.costs.cached_measure", measured(1.0))
    with ondevice.load("hf:tiny/target-GGUF:Q8_0", draft="auto", n_ctx=128) as rt:
        assert rt.drafter.name == "ngram"
        assert rt.draft_choice["reason"].startswith("no local draft would pay: the best, ollama:tinydraft:latest")
    monkeypatch.setattr("ondevice.costs.cached_measure", measured(0.05))
    with ondevice.load("hf:tiny/target-GGUF:Q8_0", draft="auto", n_ctx=128) as rt:
        assert rt.draft_choice["draft"] == "ollama:tinydraft:latest" and rt.drafter.name == "model"


def test_expected_speedup():
    costs = Costs({1: 1.0, 2: 1.05, 4: 1.2, 8: 1.8, 16: 3.0}, 0.1)
    speedup, gamma = autodraft.expected_speedup(costs, alpha=0.7)
    assert speedup > 1.5 and 2 <= gamma <= 8
    assert autodraft.expected_speedup(Costs({1: 1.0, 2: 2.0, 4: 4.0}, 1.0), alpha=0.7)[0] < 1.0
