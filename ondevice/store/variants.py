"""Local requantizations of catalog models (``ondevice pull NAME --quant FMT``): their names (``NAME:FMT``,
``NAME:FMT+out-TYPE``), where they live beside the published file, and their JSON records."""

from __future__ import annotations

import json
import re
from pathlib import Path

from ondevice.errors import OndeviceError
from ondevice.store.catalog import Entry, cached_path
from ondevice.store.fetch import sha256_file


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
    format or tensor type is ``converters.quant_types.check_tensor_types``'s to say."""
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
