"""Models where users keep them (HF cache, Ollama, LM Studio), local discovery and draft="auto".

Every store is a real on-disk layout holding real tiny models: the HF cache is built in the layout
huggingface_hub reads (models--ORG--REPO/{blobs,snapshots/REV,refs/main}) and resolved through
huggingface_hub itself with HF_HUB_OFFLINE=1; Ollama's is manifest JSON + sha256-named blobs.
Downloads are tested at the huggingface_hub call boundary only (no network here).
"""

from __future__ import annotations

import hashlib
import importlib.util
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
from ondevice import autodraft
from ondevice.costs import Costs
from ondevice.errors import OndeviceError
from ondevice.store import catalog, discovery, fetch, lookup, sources

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
    # These files test name resolution and draft choice, not conversion: the 8- and 12-layer random models
    # are chaotic enough that q8_0 activation rounding alone moves their argmax past the verify gate.
    return _converted(TINY_CACHE / "gguf" / f"sources-{name}-{quant}", "model.gguf", hf, to="gguf", quant=quant,
                      verify=False) / "model.gguf"


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
        link.unlink(missing_ok=True)
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
    if importlib.util.find_spec("mlx_lm") is not None:  # the dev extra installs it (CPU build on Linux)
        assert len(_greedy("hf:tiny/qwen2-mlx")) == 6  # an HF safetensors repo from the cache, on MLX


def test_cached_names_never_reach_the_network(stores, monkeypatch):
    """With HF_HUB_OFFLINE unset and every socket refused, cached hf: names and local stores still resolve."""
    import huggingface_hub.constants

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # read once at its import

    def refuse(*a, **k):
        raise AssertionError("network access")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    assert sources.resolve("hf:tiny/target-GGUF:Q8_0").name == "tiny-target-Q8_0.gguf"
    assert sources.resolve("tiny/qwen2-mlx").is_dir()
    assert len(discovery.local_models()) == 7
    with pytest.raises(OndeviceError, match="no repo of that name.*say hf:nobody/nothing to download"):
        sources.resolve("nobody/nothing")  # a bare name never downloads
    # control: an uncached hf: name does try the network (and is refused here)
    with pytest.raises(OndeviceError, match=r"hf:nobody/nothing: download failed \(AssertionError: network access\)"):
        sources.resolve("hf:nobody/nothing")


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
    out = subprocess.run([sys.executable, "-P", "-m", "ondevice", "models", "--local", "--json"], env=env,
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
    out = subprocess.run([sys.executable, "-P", "-m", "ondevice", *args], env={**os.environ, **env}, capture_output=True, text=True)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), out.stderr
    return lines[0]


def test_one_line_errors(stores, models, monkeypatch):
    root = stores["ollama"]
    ollama_put(root, "nomodel", "latest", None, digest="ab" * 32)  # manifest without its blob
    (root / "manifests/registry.ollama.ai/library/broken").mkdir(parents=True)
    (root / "manifests/registry.ollama.ai/library/broken/latest").write_text("{not json")
    second = stores["tmp"] / "lmstudio2"
    (second / "tiny/target-GGUF").mkdir(parents=True)
    shutil.copyfile(models["draft"], second / "tiny/target-GGUF/x-Q8_0.gguf")
    env = {**stores["env"], "ONDEVICE_LMSTUDIO_MODELS": os.pathsep.join([str(stores["lmstudio"]), str(second)])}
    monkeypatch.setenv("ONDEVICE_LMSTUDIO_MODELS", env["ONDEVICE_LMSTUDIO_MODELS"])
    assert "corrupt Ollama manifest" in _cli_error(env, "info", "ollama:broken")  # as the user sees them
    msg = _cli_error(env, "generate", "tiny/target-GGUF:Q8_0", "-p", "hi")
    assert "ambiguous" in msg and "hf:tiny/target-GGUF" in msg and "lmstudio:tiny/target-GGUF" in msg
    for name, message in [
        ("ollama:nomodel", "has no such file; run `ollama pull nomodel` again"),
        ("ollama:nothere:7b", f"no manifest at {root}/manifests/registry.ollama.ai/library/nothere/7b"),
        ("ollama:a/b/c/d", "expected ollama:NAME[:TAG]"),
        ("hf:tiny/uncached", "not in the Hugging Face cache at"),
        ("hf:tiny/uncached", "HF_HUB_OFFLINE is set"),
        ("hf:tiny/target-GGUF", "holds 2 GGUF files (tiny-target-F16.gguf, tiny-target-Q8_0.gguf); add :QUANT"),
        ("hf:tiny/target-GGUF:Q2_K", "no GGUF matching 'Q2_K'"),
        ("hf:justaname", "expected hf:ORG/REPO"),
        ("lmstudio:nope", "nothing of that name in LM Studio's folders"),
        ("lmstudio:q8_0", "is ambiguous"),
    ]:
        with pytest.raises(OndeviceError) as e:
            lookup.resolve(name)
        assert message in str(e.value) and "\n" not in str(e.value), (name, str(e.value))
    # a broken store entry is listed with its error, the rest still work
    rows = {r["name"]: r for r in discovery.local_models()}
    assert "corrupt" in rows["ollama:broken:latest"]["error"] and "fingerprint" in rows["ollama:tinydraft:latest"]
    # truncated blob: the manifest's size disagrees
    blob = sources.resolve("ollama:tinydraft")
    blob.write_bytes(blob.read_bytes()[:1000])
    with pytest.raises(OndeviceError, match="truncated download"):
        sources.resolve("ollama:tinydraft")


# A verify curve shaped like Qwen2.5-Coder-1.5B Q4_0 on this CPU (docs: cost(4) 2.02, cost(8) 3.36, cost(16) 4.53)
CURVE = {1: 1.0, 2: 1.4, 4: 2.02, 8: 3.36, 16: 4.53}


def fake_costs(monkeypatch, ratio_of):
    """Replace the timing (only) by fixed costs: draft cost ratio = ratio_of(draft path)."""
    seen = []

    def measured(target, draft):
        seen.append(Path(draft.path).name)
        return Costs(dict(CURVE), ratio_of(Path(draft.path)))

    monkeypatch.setattr("ondevice.costs.cached_measure", measured)
    return seen


def test_auto_draft_picks_the_compatible_small_model_and_explains(stores, models, monkeypatch):
    fake_costs(monkeypatch, lambda p: 0.1)
    with ondevice.load("hf:tiny/target-GGUF:Q8_0", draft="auto", n_ctx=256, threads=1) as rt:
        choice = rt.draft_choice
        assert choice["drafter"] == "model" and choice["draft"] == "ollama:tinydraft:latest", choice["reason"]
        assert rt.drafter.name == "model"
        assert choice["reason"].startswith("ollama:tinydraft:latest: same vocabulary, 0.18 of the target's size, draft "
                                           "cost 0.10 of a target pass; expected 1.")
        verdicts = {re.split("[/:]", c["name"])[-1]: c for c in choice["candidates"]}
        assert verdicts["tiny-swapped-Q8_0.gguf"]["reason"].startswith("vocabulary differs (512 tokens, same count")
        assert verdicts["tiny-qwen2-Q8_0.gguf"]["reason"].startswith("vocabulary differs")
        assert verdicts["qwen2-mlx"]["reason"].startswith("vocabulary differs")
        assert verdicts["tiny-big-Q8_0.gguf"]["reason"].startswith("not much smaller (0.6")
        assert verdicts["tiny-target-F16.gguf"]["reason"].startswith("not much smaller")
        assert [c["name"] for c in choice["candidates"] if c["ok"]] == ["ollama:tinydraft:latest"]
        spec = rt.generate("the model draft", max_tokens=16, temperature=0, gamma=3)
        assert spec.stats.drafted > 0
    with ondevice.load(models["target"], drafter="none", n_ctx=256, threads=1) as rt:
        assert spec.tokens == rt.generate("the model draft", max_tokens=16, temperature=0, gamma=0).tokens  # exact


def test_auto_draft_picks_by_cost_not_by_size(stores, models, monkeypatch):
    """Two compatible small drafts: the one the cost model expects to be faster wins, either way round."""
    other = stores["lmstudio"] / "extra/tiny-draft-copy-Q8_0.gguf"
    other.parent.mkdir(parents=True)
    shutil.copyfile(models["draft"], other)
    for cheap, name in (("tiny-draft-copy-Q8_0.gguf", "lmstudio:extra/tiny-draft-copy-Q8_0.gguf"),
                        ("sha256-", "ollama:tinydraft:latest")):
        seen = fake_costs(monkeypatch, lambda p, cheap=cheap: 0.05 if p.name.startswith(cheap) else 0.3)
        with ondevice.load("hf:tiny/target-GGUF:Q8_0", draft="auto", n_ctx=128, threads=1) as rt:
            assert rt.draft_choice["draft"] == name and "best of 2 measured" in rt.draft_choice["reason"]
            assert len(seen) == 2
            speedups = sorted(c["expected_speedup"] for c in rt.draft_choice["candidates"] if "expected_speedup" in c)
            assert speedups[0] < speedups[1] == rt.draft_choice["expected_speedup"]


def test_auto_draft_measures_once_and_caches(stores, monkeypatch):
    """The real probe: costs measured at the first auto load, cached on disk, reused by the next load."""
    from helpers import steady_probe

    steady_probe(monkeypatch)  # a probe stalled by a loaded machine is (rightly) never cached
    with ondevice.load("hf:tiny/target-GGUF:Q8_0", draft="auto", n_ctx=128, threads=1) as rt:
        first = rt.draft_choice
    measured = [c for c in first["candidates"] if "expected_speedup" in c]
    assert [c["name"] for c in measured] == ["ollama:tinydraft:latest"] and measured[0]["draft_cost_ratio"] > 0
    assert first["drafter"] == ("model" if measured[0]["expected_speedup"] > 1 else "ngram"), first["reason"]
    cache = json.loads((Path(stores["env"]["ONDEVICE_HOME"]) / "costs.json").read_text())
    assert len(cache) == 1

    def no_probe(*a, **k):
        raise AssertionError("measured again")

    monkeypatch.setattr("ondevice.costs.measure", no_probe)
    with ondevice.load("hf:tiny/target-GGUF:Q8_0", draft="auto", n_ctx=128, threads=1) as rt:
        assert rt.draft_choice["reason"] == first["reason"]


def test_auto_draft_without_a_compatible_model_uses_ngram(stores):
    shutil.rmtree(stores["ollama"])  # the only compatible small model
    with ondevice.load("hf:tiny/target-GGUF:Q8_0", draft="auto", n_ctx=128, threads=1) as rt:
        assert rt.drafter.name == "ngram" and rt.draft_choice["drafter"] == "ngram"
        assert rt.draft_choice["reason"].startswith("no compatible, much smaller model among the 5 other local models")
        assert rt.generate("the model the model", max_tokens=4, temperature=0, gamma=2).stats.tokens == 4


def test_auto_draft_falls_back_when_no_draft_would_pay(stores, monkeypatch):
    """A compatible draft that costs as much as the target: the cost model says n-gram (negative control:
    the same draft at a cost ratio of 0.05 is chosen)."""
    fake_costs(monkeypatch, lambda p: 1.0)
    with ondevice.load("hf:tiny/target-GGUF:Q8_0", draft="auto", n_ctx=128, threads=1) as rt:
        assert rt.drafter.name == "ngram"
        assert rt.draft_choice["reason"].startswith("no local draft would pay: the best, ollama:tinydraft:latest")
    fake_costs(monkeypatch, lambda p: 0.05)
    with ondevice.load("hf:tiny/target-GGUF:Q8_0", draft="auto", n_ctx=128, threads=1) as rt:
        assert rt.draft_choice["draft"] == "ollama:tinydraft:latest" and rt.drafter.name == "model"


def test_cli_draft_auto_and_candidates(stores):
    env = {**os.environ, **stores["env"]}
    out = subprocess.run([sys.executable, "-P", "-m", "ondevice", "generate", "hf:tiny/target-GGUF:Q8_0", "-p", "the", "--draft",
                          "auto", "--max-tokens", "4", "--json", "--n-ctx", "128", "--threads", "1", "--gamma", "2"],
                         env=env, capture_output=True, text=True, check=True)
    choice = json.loads(out.stdout)["draft_choice"]
    assert choice["drafter"] in ("model", "ngram") and choice["reason"]
    assert [c["name"] for c in choice["candidates"] if c["ok"] or "expected_speedup" in c] == ["ollama:tinydraft:latest"]
    out = subprocess.run([sys.executable, "-P", "-m", "ondevice", "check-pair", "hf:tiny/target-GGUF:Q8_0"],
                         env=env, capture_output=True, text=True, check=True)
    assert "ollama:tinydraft:latest" in out.stdout and "not much smaller" in out.stdout
    out = subprocess.run([sys.executable, "-P", "-m", "ondevice", "models", "--local", "--target", "hf:tiny/target-GGUF:Q8_0",
                          "--json"], env=env, capture_output=True, text=True, check=True)
    doc = json.loads(out.stdout)
    assert [d["name"] for d in doc["drafts"] if d["ok"]] == ["ollama:tinydraft:latest"]
    assert doc["target"]["fingerprint"] == next(m for m in doc["models"] if m["name"].startswith("ollama:"))["fingerprint"]


def test_expected_speedup():
    costs = Costs({1: 1.0, 2: 1.05, 4: 1.2, 8: 1.8, 16: 3.0}, 0.1)
    speedup, gamma = autodraft.expected_speedup(costs, alpha=0.7)
    assert speedup > 1.5 and 2 <= gamma <= 8
    assert autodraft.expected_speedup(Costs({1: 1.0, 2: 2.0, 4: 4.0}, 1.0), alpha=0.7)[0] < 1.0


# -- downloads, at the huggingface_hub call boundary (never against the live hub here) -------------
@pytest.fixture()
def fake_hub(stores, models, monkeypatch):
    """huggingface_hub's network functions replaced by fakes that write into the real cache layout;
    reading the cache (local_files_only) stays the real huggingface_hub."""
    import huggingface_hub

    monkeypatch.delenv("HF_HUB_OFFLINE")
    real_snapshot = huggingface_hub.snapshot_download
    repos = {
        "tiny/remote-GGUF": {"tiny-remote-Q8_0.gguf": models["target"], "tiny-remote-F16.gguf": models["target_f16"],
                             "README.md": models["target"]},
        "tiny/split-GGUF": {"big-Q4_K_M-00001-of-00002.gguf": models["draft"], "big-Q4_K_M-00002-of-00002.gguf": models["draft"],
                            "big-Q8_0.gguf": models["draft"], "mmproj-big-f16.gguf": models["draft"]},
        "tiny/remote-mlx": {**{f.name: f for f in models["qwen2_hf"].iterdir() if f.is_file()},
                            "onnx/model.onnx": models["draft"]},
    }
    calls: list[tuple[str, tuple, dict]] = []
    fail: dict[str, Exception] = {}

    def list_repo_files(self, repo_id, **kw):
        calls.append(("list_repo_files", (repo_id,), kw))
        if "list" in fail:
            raise fail["list"]
        return sorted(repos[repo_id])

    def hf_hub_download(repo_id, filename, **kw):
        calls.append(("hf_hub_download", (repo_id, filename), kw))
        if "download" in fail:
            raise fail["download"]
        return str(hf_put(Path(kw["cache_dir"]), repo_id, {filename: repos[repo_id][filename]}) / filename)

    def snapshot_download(repo_id, **kw):
        if kw.get("local_files_only"):
            return real_snapshot(repo_id, **kw)
        calls.append(("snapshot_download", (repo_id,), kw))
        import fnmatch

        keep = {n: f for n, f in repos[repo_id].items() if any(fnmatch.fnmatch(n, p) for p in kw["allow_patterns"])}
        return str(hf_put(Path(kw["cache_dir"]), repo_id, keep))

    monkeypatch.setattr(huggingface_hub.HfApi, "list_repo_files", list_repo_files)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hf_hub_download)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.setattr("ondevice.store.network.check_reachable", lambda *a, **kw: None)  # the fake hub is reachable
    return {"calls": calls, "fail": fail, "hub": stores["hub"]}


def test_download_gguf_by_quant(fake_hub, capsys):
    path = sources.resolve("hf:tiny/remote-GGUF:Q8_0")
    hub = fake_hub["hub"]
    assert path == hub / "models--tiny--remote-GGUF" / "snapshots" / REV / "tiny-remote-Q8_0.gguf" and path.is_file()
    assert [(c[0], c[1]) for c in fake_hub["calls"]] == [("list_repo_files", ("tiny/remote-GGUF",)),
                                                         ("hf_hub_download", ("tiny/remote-GGUF", "tiny-remote-Q8_0.gguf"))]
    kw = fake_hub["calls"][1][2]
    assert kw == {"revision": None, "cache_dir": hub}  # token and progress bars: huggingface_hub's own defaults
    assert "downloading hf:tiny/remote-GGUF:Q8_0 (tiny-remote-Q8_0.gguf) into" in capsys.readouterr().err
    assert sources.resolve("hf:tiny/remote-GGUF:Q8_0") == path and len(fake_hub["calls"]) == 2  # cached: no network
    assert fetch.pull("hf:tiny/remote-GGUF:Q8_0") == path  # `ondevice pull hf:…` takes the same path
    # another quant of a partly cached repo is fetched; a revision is passed through
    assert sources.resolve("hf:tiny/remote-GGUF@v1:F16").name == "tiny-remote-F16.gguf"
    assert fake_hub["calls"][-1][1:] == (("tiny/remote-GGUF", "tiny-remote-F16.gguf"), {"revision": "v1", "cache_dir": hub})
    with pytest.raises(OndeviceError, match=r"holds 2 GGUF files \(tiny-remote-F16.gguf, tiny-remote-Q8_0.gguf\); add :QUANT"):
        sources.resolve("hf:tiny/remote-GGUF@v2")


def test_dangling_link_in_the_hf_cache_is_downloaded_again(fake_hub, monkeypatch):
    """An interrupted download leaves a snapshot link without its blob: online it is fetched again,
    offline the error names the broken link (it used to reach the backend as 'unrecognised model format')."""
    path = sources.resolve("hf:tiny/remote-GGUF:Q8_0")
    path.resolve().unlink()
    n = len(fake_hub["calls"])
    assert sources.resolve("hf:tiny/remote-GGUF:Q8_0") == path and path.is_file()
    assert [c[0] for c in fake_hub["calls"][n:]] == ["list_repo_files", "hf_hub_download"]
    path.resolve().unlink()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(OndeviceError, match=r"hf:tiny/remote-GGUF:Q8_0: .*tiny-remote-Q8_0.gguf is a broken link"):
        lookup.resolve("hf:tiny/remote-GGUF:Q8_0")


def test_download_split_gguf_and_safetensors_repo(fake_hub):
    first = sources.resolve("hf:tiny/split-GGUF:Q4_K_M")
    assert first.name == "big-Q4_K_M-00001-of-00002.gguf" and (first.parent / "big-Q4_K_M-00002-of-00002.gguf").is_file()
    assert [c[1][1] for c in fake_hub["calls"] if c[0] == "hf_hub_download"] == [
        "big-Q4_K_M-00001-of-00002.gguf", "big-Q4_K_M-00002-of-00002.gguf"]  # every part, in order; never the mmproj
    snap = sources.resolve("hf:tiny/remote-mlx")
    call = fake_hub["calls"][-1]
    assert call[0] == "snapshot_download" and call[2]["allow_patterns"] == sources.HF_MODEL_PATTERNS
    assert sources.is_weights_dir(snap) and not (snap / "onnx").exists()  # only the model's own files


def test_download_errors_are_mapped_to_one_line(fake_hub):
    import httpx2
    from huggingface_hub import errors

    response = httpx2.Response(404, request=httpx2.Request("GET", "https://huggingface.co/api/models/tiny/x"))
    cases = [
        ("list", errors.RepositoryNotFoundError("404 not found", response=response),
         "hf:tiny/remote-GGUF:Q8_0: repository not found on the Hugging Face Hub (or private: log in"),
        ("list", errors.GatedRepoError("403 gated", response=response), "the repo is gated; accept its terms"),
        ("list", errors.RevisionNotFoundError("404 rev", response=response), "no such revision"),
        ("download", errors.LocalEntryNotFoundError("cannot connect"), "the Hub could not be reached"),
        ("download", ConnectionResetError("peer reset"), "download failed (ConnectionResetError: peer reset); rerun to resume"),
    ]
    for where, exc, message in cases:
        fake_hub["fail"].clear()
        fake_hub["fail"][where] = exc
        with pytest.raises(OndeviceError) as e:
            sources.resolve("hf:tiny/remote-GGUF:Q8_0")
        assert message in str(e.value) and "\n" not in str(e.value)
    assert not (fake_hub["hub"] / "models--tiny--remote-GGUF").exists()


def test_name_parsing(tmp_path):
    names = ["m-Q4_0.gguf", "m-Q4_0_4_4.gguf", "m-Q4_K_M.gguf", "m-Q4_K_S.gguf", "sub/m-Q8_0-00001-of-00002.gguf",
             "sub/m-Q8_0-00002-of-00002.gguf", "mmproj-m-f16.gguf"]
    assert sources.choose_gguf(names, "q4_0", "x") == "m-Q4_0.gguf"  # the exact quant field wins over Q4_0_4_4
    assert sources.choose_gguf(names, "Q4_K_M", "x") == "m-Q4_K_M.gguf"
    assert sources.choose_gguf(names, "Q8_0", "x") == "sub/m-Q8_0-00001-of-00002.gguf"  # first part of a split
    assert sources.choose_gguf(names, "m-Q4_K_S.gguf", "x") == "m-Q4_K_S.gguf"
    with pytest.raises(OndeviceError, match=r"holds 2 GGUF files matching 'Q4_K' \(m-Q4_K_M.gguf, m-Q4_K_S.gguf\)"):
        sources.choose_gguf(names, "Q4_K", "x")
    with pytest.raises(OndeviceError, match="no GGUF matching 'F16'"):  # the projector is never a model
        sources.choose_gguf(names, "F16", "x")
    assert sources.parse_hf("a/b@dev:Q4_K_M") == ("a/b", "dev", "Q4_K_M") and sources.parse_hf("a/b") == ("a/b", None, None)
    root = tmp_path / "o"
    assert sources.ollama_manifest("qwen2.5-coder:0.5b", root) == root / "manifests/registry.ollama.ai/library/qwen2.5-coder/0.5b"
    assert sources.ollama_manifest("me/m", root) == root / "manifests/registry.ollama.ai/me/m/latest"
    assert sources.ollama_manifest("hf.co/org/repo-GGUF:Q4_K_M", root) == root / "manifests/hf.co/org/repo-GGUF/Q4_K_M"
    d = tmp_path / "bert"
    d.mkdir()
    (d / "model.safetensors").write_bytes(b"")
    (d / "config.json").write_text(json.dumps({"architectures": ["BertForMaskedLM"]}))
    assert not sources.is_weights_dir(d)  # not a text-generation model: never listed or picked
    (d / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"]}))
    assert sources.is_weights_dir(d)


def test_lmstudio_repo_name_with_quant(stores, models):
    repo = stores["lmstudio"] / "pub/tiny-GGUF"
    repo.mkdir(parents=True)
    shutil.copyfile(models["draft"], repo / "tiny-Q8_0.gguf")
    shutil.copyfile(models["draft"], repo / "tiny-Q4_0.gguf")
    assert sources.resolve("lmstudio:pub/tiny-GGUF:Q4_0") == repo / "tiny-Q4_0.gguf"  # a path in the folder
    assert sources.resolve("lmstudio:tiny-GGUF:q8_0") == repo / "tiny-Q8_0.gguf"  # a name, then the quant
    assert sources.resolve("pub/tiny-GGUF:Q8_0") == repo / "tiny-Q8_0.gguf"  # bare: only LM Studio has it
    with pytest.raises(OndeviceError, match="holds 2 GGUF files"):
        sources.resolve("lmstudio:pub/tiny-GGUF")
    with pytest.raises(OndeviceError, match="hf:bad..name/x--y: not a valid Hugging Face repo id"):
        sources.resolve("hf:bad..name/x--y")


def test_broken_files_in_the_stores_are_listed_with_a_reason(stores, models):
    """Half-downloaded or odd entries never crash ``models --local``: each is a row with a one-line error."""
    d = stores["lmstudio"] / "odd/repo GGUF"
    d.mkdir(parents=True)
    data = models["draft"].read_bytes()
    (d / "cut-Q4_0.gguf").write_bytes(data[:3000])
    (d / "empty-Q5_0.gguf").write_bytes(b"")
    (d / "dangling-Q6_K.gguf").symlink_to(stores["tmp"] / "nowhere.gguf")  # an interrupted HF download looks like this
    (d / "folder.gguf").mkdir()  # a directory is not a model file
    (d / "with space-Q8_0.gguf").write_bytes(data)
    rows = {r["name"].removeprefix("lmstudio:odd/repo GGUF/"): r for r in discovery.local_models()}
    assert "folder.gguf" not in rows and "fingerprint" in rows["with space-Q8_0.gguf"]
    for name, reason in [("cut-Q4_0.gguf", "truncated"), ("empty-Q5_0.gguf", "too short for a GGUF header"),
                         ("dangling-Q6_K.gguf", "a broken link to")]:
        assert reason in rows[name]["error"] and "\n" not in rows[name]["error"], rows[name]
    assert sources.resolve("lmstudio:odd/repo GGUF/with space-Q8_0.gguf") == d / "with space-Q8_0.gguf"
    import huggingface_hub

    def unreadable(path):
        raise PermissionError(13, "Permission denied")  # a chmod 000 cache (tests run as root, where chmod is moot)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(huggingface_hub, "scan_cache_dir", unreadable)
        rows = {r["name"]: r for r in discovery.local_models()}
    assert "cannot scan the Hugging Face cache (Permission denied)" in rows["hf:"]["error"]
    assert "fingerprint" in rows["ollama:tinydraft:latest"]  # the other stores are still listed
    for bad in ("lmstudio:", "lmstudio:../../etc", "lmstudio:odd/../../x", "lmstudio:/etc"):
        with pytest.raises(OndeviceError, match="with PATH inside LM Studio's models folder"):
            sources.resolve(bad)


def test_fast_gguf_header_reads_what_gguf_reads(models, tmp_path):
    """read_header (a struct walk of the header) gives gguf-py's token texts and scalars, and one-line errors."""
    import gguf

    from ondevice.formats.gguf import read_header

    for name in ("target", "target_f16", "qwen2", "swapped"):
        meta, texts = read_header(models[name])
        reader = gguf.GGUFReader(str(models[name]))
        assert texts == discovery.pair_rules().gguf_tokens(models[name])
        assert meta["general.architecture"] == bytes(reader.fields["general.architecture"].parts[-1]).decode()
        assert meta["general.file_type"] == int(reader.fields["general.file_type"].parts[-1][0])
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(models["target"].read_bytes()[:3000])
    with pytest.raises(OndeviceError, match="cut.gguf: (corrupt GGUF header|GGUF header runs past)"):
        read_header(cut)
    (tmp_path / "not.gguf").write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(OndeviceError, match="not a GGUF file"):
        read_header(tmp_path / "not.gguf")


@pytest.mark.slow
def test_auto_draft_on_the_real_qwen_pair(tmp_path, monkeypatch):
    """Qwen2.5-Coder 1.5B in LM Studio's layout, its 0.5B in Ollama's, SmolLM2 as a decoy (another vocabulary):
    the 0.5B is the only candidate, and the choice agrees with the speedup its measured costs predict."""
    target = fetch.pull("qwen2.5-coder-1.5b-instruct", quiet=True)
    draft = fetch.pull("qwen2.5-coder-0.5b-instruct", quiet=True)
    decoy = fetch.pull("smollm2-135m-instruct", quiet=True)
    lms = tmp_path / "lms"
    for rel, src in {"Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf": target,
                     "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF/SmolLM2-135M-Instruct-Q4_1.gguf": decoy}.items():
        (lms / rel).parent.mkdir(parents=True)
        (lms / rel).symlink_to(src)
    digest = catalog.get("qwen2.5-coder-0.5b-instruct").sha256
    ollama = tmp_path / "ollama"
    (ollama / "blobs").mkdir(parents=True)
    (ollama / "blobs" / f"sha256-{digest}").symlink_to(draft)
    m = ollama / "manifests/registry.ollama.ai/library/qwen2.5-coder/0.5b"
    m.parent.mkdir(parents=True)
    m.write_text(json.dumps({"layers": [{"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}",
                                         "size": draft.stat().st_size}]}))
    for k, v in {"ONDEVICE_LMSTUDIO_MODELS": lms, "OLLAMA_MODELS": ollama, "HF_HOME": tmp_path / "hf",
                 "HF_HUB_OFFLINE": "1", "ONDEVICE_HOME": tmp_path / "home"}.items():
        monkeypatch.setenv(k, str(v))
    with ondevice.load("lmstudio:qwen2.5-coder-1.5b-instruct-q4_k_m", draft="auto", n_ctx=512) as rt:
        choice = rt.draft_choice
    rows = {r["name"]: r for r in choice["candidates"]}
    assert rows["ollama:qwen2.5-coder:0.5b"]["ok"] or "expected_speedup" in rows["ollama:qwen2.5-coder:0.5b"]
    assert rows["lmstudio:HuggingFaceTB/SmolLM2-135M-Instruct-GGUF/SmolLM2-135M-Instruct-Q4_1.gguf"]["reason"] == \
        "vocabulary differs (49152 vs 151936 tokens)"
    speedup = rows["ollama:qwen2.5-coder:0.5b"]["expected_speedup"]
    assert choice["draft"] == ("ollama:qwen2.5-coder:0.5b" if speedup > 1 else None), choice["reason"]


def test_auto_draft_candidate_that_cannot_open(stores, models):
    """A candidate whose blob is not a loadable model is a verdict, not a crash; n-gram is used and says why."""
    blob = sources.resolve("ollama:tinydraft")
    blob.write_bytes(blob.read_bytes()[: blob.stat().st_size // 2])  # header intact, tensor data cut: llama.cpp refuses it
    manifest = stores["ollama"] / "manifests/registry.ollama.ai/library/tinydraft/latest"
    doc = json.loads(manifest.read_text())
    doc["layers"][0]["size"] = blob.stat().st_size
    manifest.write_text(json.dumps(doc))
    with ondevice.load("hf:tiny/target-GGUF:Q8_0", draft="auto", n_ctx=128, threads=1) as rt:
        assert rt.drafter.name == "ngram"
        assert rt.draft_choice["reason"].startswith("1 candidate draft could not be used (ollama:tinydraft:latest: "
                                                    "could not open"), rt.draft_choice["reason"]
