"""Any model name → a local path: a file, a catalog name (pulled when allowed), a local variant
(``NAME:FMT``), a store name (``hf:``, ``ollama:``, ``lmstudio:``, ``ORG/REPO``); pairs; the listing behind
``ondevice models``."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ondevice.errors import OndeviceError
from ondevice.store.catalog import cached_path, catalog, get, names
from ondevice.store.fetch import is_pulled, pull
from ondevice.store.variants import parse_variant_tag, pull_command, variant_path, variant_record, variant_tag


def resolve(spec: str | os.PathLike, *, auto_pull: bool = True) -> Path:
    """Turn a model path, catalog name or store name (``hf:``, ``ollama:``, ``lmstudio:``, ``ORG/REPO``; see
    ``ondevice.store.sources``) into a local path (pulling a catalog model when allowed).

    ``NAME:QUANT`` names a local requantization made by ``ondevice pull NAME --quant QUANT``, and
    ``NAME:QUANT+out-TYPE`` one made with ``--output-type TYPE`` (``variant_tag``).

    A catalog name (a str) means the catalog model even where a file or folder of that name exists here (said
    on stderr): running in a folder someone else filled must not swap the pinned model for an unverified one.
    Say ``./NAME`` (or pass a ``Path``) for the local one.
    """
    path = Path(spec).expanduser()
    if isinstance(spec, str) and not looks_like_path(spec) and _catalog_name(spec):
        if path.exists() or path.is_symlink():  # the pinned, verified model wins over an unverified local one
            kind = "folder" if path.is_dir() else "file"
            print(f"ondevice: using the catalog model {spec} (pinned, sha256-checked), not the {kind} ./{spec} "
                  f"here; pass ./{spec} to use that {kind}", file=sys.stderr)
    elif path.exists():
        return path
    from ondevice.store import sources  # hf:, ollama:, lmstudio: and bare ORG/REPO names

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
    if path.suffix or os.sep in name or path.is_symlink():
        from ondevice.inputs import why_missing

        raise OndeviceError(f"{spec}: {why_missing(path)}; pass an existing model path or one of: {', '.join(names())}")
    get(name)  # raises the unknown-name error listing the catalog
    raise AssertionError("unreachable")


PATH_SUFFIXES = (".gguf", ".safetensors", ".mlpackage", ".mlmodelc", ".heads.safetensors", ".json", ".bin")


def looks_like_path(spec: str) -> bool:
    """True when ``spec`` is clearly a path, not a name: ``./x``, ``../x``, ``~/x``, absolute, holding a path
    separator, or ending in a model file's extension."""
    return (spec.startswith(("./", "../", "~", ".\\", "..\\")) or os.path.isabs(spec) or "/" in spec
            or os.sep in spec or spec.lower().endswith(PATH_SUFFIXES) or spec in (".", ".."))


def _catalog_name(spec: str) -> bool:
    """A catalog model or pair name, or ``NAME:TAG`` of a catalog model (a local variant)."""
    models, pairs = catalog()
    return spec in models or spec in pairs or spec.partition(":")[0] in models


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
