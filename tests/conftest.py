"""Shared fixtures: tiny models built once per session, and the real default model."""

from __future__ import annotations

import hashlib
import os
import signal
import sys
from pathlib import Path

import pytest
from skipcheck import (  # noqa: F401
    pytest_collectreport,
    pytest_runtest_logreport,
    pytest_sessionfinish,
    pytest_terminal_summary,
)

ROOT = Path(__file__).resolve().parent.parent


def _fingerprint() -> str:
    """Tiny models are cached on disk, keyed by the code that makes them, so edits rebuild them."""
    h = hashlib.sha256()
    for f in sorted([*(ROOT / "ondevice" / "testing").glob("*.py"), Path(__file__),
                     *(ROOT / "converters").glob("*.py"), *(ROOT / "ondevice" / "formats").glob("*.py")]):
        h.update(f.read_bytes())
    return h.hexdigest()[:12]


TINY_CACHE = Path(os.environ.get("ONDEVICE_TEST_CACHE", ROOT / "build" / "test-models")) / _fingerprint()


def pytest_sessionstart(session):
    """Drop tiny models built by other versions of the code and unused for an hour (a run still going with
    another version, e.g. one half of a split run started before an edit, keeps its own). Tests that load
    models with llama_cpp directly get the runtime's AMX guard too (``llama_ext.guard_amx``)."""
    import shutil
    import time

    from ondevice.backends.llama_ext import guard_amx

    guard_amx()

    if TINY_CACHE.parent.is_dir():
        for old in TINY_CACHE.parent.iterdir():
            if old != TINY_CACHE and old.is_dir():
                try:
                    last = max(p.stat().st_mtime for p in (old, *old.iterdir()))
                except OSError:
                    continue
                if time.time() - last > 3600:
                    shutil.rmtree(old, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    if sys.platform != "darwin":
        skip = pytest.mark.skip(reason="needs macOS (Metal / Core ML prediction); this is " + sys.platform)
        for item in items:
            if "macos" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(autouse=True)
def sigint_default():
    """Ctrl-C (SIGINT) at Python's default for every test: KeyboardInterrupt here, and SIGINT at its default in
    every child started meanwhile. A job started in the background (``pytest ... &`` from a script, nohup)
    begins with SIGINT ignored; Python then leaves it ignored and so do the children, which a test that
    sends SIGINT and waits for its effect would wait on forever (or see no KeyboardInterrupt at all). Autouse,
    so a new Ctrl-C test cannot forget it (one did: tests/test_parallel_interrupts.py)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.SIG_DFL if previous is None else previous)


@pytest.fixture
def time_scale():
    """``helpers.TimeScale``: time limits that grow with the machine's load (measured in this test)."""
    from helpers import TimeScale

    return TimeScale()


@pytest.fixture(scope="session")
def tiny_hf():
    """name → HF checkpoint dir. Targets, drafts close to them (perturbed weights), same tokenizer per arch."""
    from ondevice.testing import make_tiny_hf

    specs = {
        "llama": dict(arch="llama", seed=0),
        "llama_draft": dict(arch="llama", seed=0, perturb_seed=11, perturb_scale=0.03),
        "qwen2": dict(arch="qwen2", seed=1),
        "qwen2_draft": dict(arch="qwen2", seed=1, perturb_seed=12, perturb_scale=0.05),
    }
    out = {}
    for name, kw in specs.items():
        d = TINY_CACHE / "hf" / name
        if not (d / "model.safetensors").is_file():
            make_tiny_hf(d, **kw)
        out[name] = d
    return out


def _converted(out: Path, marker: str, src: Path, **kw) -> Path:
    """``convert(src, out=out, **kw)`` unless ``out/marker`` shows an earlier run finished (a partial dir is redone)."""
    from converters import convert

    if not (out / marker).is_file():
        if out.exists():
            import shutil

            shutil.rmtree(out)
        convert(src, out=out, progress=False, **kw)
    return out


@pytest.fixture(scope="session")
def tiny_gguf(tiny_hf):
    """(name, quant) → model.gguf converted by our own converter (cached on disk between runs)."""

    def get(name: str, quant: str = "q8_0") -> Path:
        out = _converted(TINY_CACHE / "gguf" / f"{name}-{quant}", "model.gguf", tiny_hf[name], to="gguf", quant=quant)
        return out / "model.gguf"

    return get


@pytest.fixture(scope="session")
def tiny_coreml(tiny_hf):
    """(name, compress) → a Core ML directory converted by our converter (context 128, cached on disk)."""

    def get(name: str, compress: str = "int4") -> Path:
        return _converted(TINY_CACHE / "coreml" / f"{name}-{compress}", "manifest.json", tiny_hf[name], to="coreml",
                          context=128, compress=compress)

    return get


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """The real default model (98 MB), pulled through the catalog once and cached."""
    from ondevice.store import fetch

    return fetch.pull("smollm2-135m-instruct", quiet=True)


@pytest.fixture(scope="session")
def tiny_mlx(tiny_gguf, tmp_path_factory):
    """name → MLX directory converted losslessly from our q8_0 GGUF (so both backends hold the same weights)."""
    from converters import convert

    base = tmp_path_factory.mktemp("mlx")
    cache = {}

    def get(name: str):
        if name not in cache:
            cache[name] = base / name
            convert(tiny_gguf(name, "q8_0"), to="mlx", out=cache[name], progress=False)
        return cache[name]

    return get


@pytest.fixture(scope="session")
def heads_trained(tiny_gguf, tmp_path_factory):
    """(target, home, summary): the tiny llama target copied outside the test cache, and one uninterrupted small
    train-heads run on it (``helpers.SMALL_HEADS``) whose heads are stored under ``home`` (its ONDEVICE_HOME)."""
    import shutil

    from helpers import SMALL_HEADS

    from ondevice.heads import train

    target = tmp_path_factory.mktemp("models") / "tiny.gguf"
    shutil.copy(tiny_gguf("llama"), target)
    home = tmp_path_factory.mktemp("clean")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ONDEVICE_HOME", str(home))
        summary = train.train_heads(target, **SMALL_HEADS)
    return target, home, summary


@pytest.fixture
def heads_home(heads_trained):
    """(target, home) of ``heads_trained``."""
    return heads_trained[:2]


@pytest.fixture
def tiny_catalog(tmp_path, monkeypatch):
    """name → a catalog entry whose published file is ``src`` (copied into the cache, as if pulled)."""
    import shutil

    from ondevice.store import catalog
    from ondevice.store.fetch import sha256_file

    monkeypatch.setenv("ONDEVICE_HOME", str(tmp_path / "home"))

    def make(src, arch="qwen2", quant="Q4_K_M"):
        (tmp_path / "catalog.toml").write_text(f'''[models."tiny"]
description = "tiny"
role = "chat"
arch = "{arch}"
format = "gguf"
quant = "{quant}"
vocab_size = 512
license = "none"
filename = "tiny.gguf"
size = {src.stat().st_size}
sha256 = "{sha256_file(src)}"
parts = [{{ wheel = "not-downloaded==0", member = "x" }}]
''')
        monkeypatch.setenv("ONDEVICE_CATALOG", str(tmp_path / "catalog.toml"))
        catalog.catalog.cache_clear()
        entry = catalog.get("tiny")
        catalog.cached_path(entry).parent.mkdir(parents=True)
        shutil.copy(src, catalog.cached_path(entry))
        return entry

    yield make
    catalog.catalog.cache_clear()
