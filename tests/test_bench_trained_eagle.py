"""``scripts/bench_trained_eagle.py`` reports the drafter file its run loaded: with no ``--drafter``, ``draft="heads"``
loads the Medusa heads where no EAGLE-style drafter is stored, and the report must name those (and read their
metadata) instead of failing after the whole bench on the EAGLE file that is not there."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from ondevice.drafters.heads import HeadsDrafter
from ondevice.heads import eagle_store
from ondevice.heads import store as heads_store


def _script():
    path = Path(__file__).resolve().parents[1] / "scripts" / "bench_trained_eagle.py"
    spec = importlib.util.spec_from_file_location("bench_trained_eagle", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("given", [None, "x.heads.safetensors"])
def test_the_report_names_the_medusa_heads_the_run_loaded(tmp_path, monkeypatch, given):
    bench = _script()
    stored = tmp_path / "m.heads.safetensors"
    monkeypatch.setattr(eagle_store, "find", lambda model: None)  # only Medusa heads stored for the target
    monkeypatch.setattr(heads_store, "find", lambda model: stored)
    monkeypatch.setattr(heads_store, "read_meta", lambda p, model=None: {"K": 3, "file": Path(p).name})
    monkeypatch.setattr(eagle_store, "read_meta", lambda p: pytest.fail("read as an EAGLE drafter"))
    drafter = object.__new__(HeadsDrafter)
    path, meta = bench._drafter_file(drafter, given, tmp_path / "m.gguf")
    assert Path(path).name == (given or stored.name) and meta == {"K": 3, "file": Path(path).name}


def test_the_report_names_the_eagle_drafter_the_run_loaded(tmp_path, monkeypatch):
    bench = _script()
    stored = tmp_path / "m.eagle.gguf"
    monkeypatch.setattr(eagle_store, "find", lambda model: stored)
    monkeypatch.setattr(eagle_store, "read_meta", lambda p: {"depths": 5})
    monkeypatch.setattr(heads_store, "read_meta", lambda p, model=None: pytest.fail("read as Medusa heads"))
    eagle = type("Eagle3Like", (), {"graph": object()})()
    assert bench._drafter_file(eagle, None, tmp_path / "m.gguf") == (str(stored), {"depths": 5})
