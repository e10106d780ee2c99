"""Models found on this machine: `models --local` keeps errors out of the arch column, a truncated Ollama blob
is an error, and an uncached Hugging Face name fails fast offline."""

from __future__ import annotations

import hashlib
import json
import time

import pytest

from ondevice.errors import OndeviceError


def test_models_local_keeps_errors_out_of_the_arch_column():
    from ondevice.cli.local import row

    cells = row({"name": "ollama:x", "error": "truncated"})
    assert cells[2] == "" and "truncated" in cells[0]


def test_truncated_ollama_blob_without_a_size_is_an_error(tiny_gguf, tmp_path, monkeypatch):
    from ondevice.store import discovery

    data = tiny_gguf("llama").read_bytes()
    cut = data[: len(data) - 1000]
    digest = hashlib.sha256(cut).hexdigest()
    root = tmp_path / "ollama"
    (root / "blobs").mkdir(parents=True)
    (root / "blobs" / f"sha256-{digest}").write_bytes(cut)
    manifest = root / "manifests" / "registry.ollama.ai" / "library" / "tiny" / "latest"
    manifest.parent.mkdir(parents=True)
    manifest.write_text(json.dumps({"schemaVersion": 2, "layers": [  # no "size": nothing to compare with
        {"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}"}]}))
    monkeypatch.setenv("OLLAMA_MODELS", str(root))
    monkeypatch.setenv("ONDEVICE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("LMSTUDIO_HOME", str(tmp_path / "lms"))
    rows = [m for m in discovery.local_models() if m["name"] == "ollama:tiny:latest"]
    assert rows and "truncated" in rows[0].get("error", ""), rows


def test_uncached_hf_name_fails_fast_when_offline(monkeypatch, tmp_path, time_scale):
    import socket

    from ondevice.store import sources

    def offline(*a, **kw):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", offline)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    for k in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(k, raising=False)
    t0 = time.monotonic()
    with pytest.raises(OndeviceError, match="cannot be reached"):
        sources.resolve_hf("someorg/somerepo")
    assert time.monotonic() - t0 < time_scale(5)
