"""Output of ``ondevice models --local`` and ``ondevice check-pair TARGET`` (candidate drafts)."""

from __future__ import annotations

import json


def _mb(size) -> str:
    return f"{size / 1e6:.1f} MB" if size else ""


def row(m: dict) -> list[str]:
    """One model's cells (name, format, arch, quant, size, vocab, fingerprint); a model that cannot be read has
    its error under its name, the other columns empty."""
    from rich.markup import escape

    if "error" in m:
        return [f"{escape(m['name'])}\n[red]{escape(m['error'])}[/red]", "[red]error[/red]", "", "", "", "", ""]
    return [escape(m["name"]), m["format"], str(m["arch"]), str(m["quant"]), _mb(m["size"]), str(m["vocab_size"]),
            m["fingerprint"]]


def show_local(json_out: bool, target: str | None = None) -> None:
    """Print every local model (HF cache, LM Studio, Ollama); with ``target``, also its candidate drafts."""
    from ondevice.store import discovery, lookup, sources

    models = discovery.local_models()
    doc: dict = {"stores": {"hf": str(sources.hf_cache_dir()), "lmstudio": [str(p) for p in sources.lmstudio_dirs()],
                            "ollama": str(sources.ollama_dir())}, "models": models}
    if target is not None:
        from ondevice.autodraft import candidates

        path = lookup.resolve(target)
        tf, rows = candidates(path, models)
        doc["target"] = {"name": target, "path": str(path), **tf}
        doc["drafts"] = rows
    if json_out:
        print(json.dumps(doc, indent=2, default=str))
        return
    from rich.table import Column, Table

    from ondevice.cli.app import console

    t = Table(Column("name", overflow="fold"), "format", "arch", "quant", "size", "vocab", "fingerprint",
              title="local models")
    for m in models:
        t.add_row(*row(m))
    out = console()
    out.print(t)
    out.print(f"[dim]looked in: HF cache {doc['stores']['hf']}; LM Studio {', '.join(doc['stores']['lmstudio'])}; "
                  f"Ollama {doc['stores']['ollama']}[/dim]", soft_wrap=True)
    if target is not None:
        show_candidates(target, doc["drafts"], out)


def show_candidates(target: str, rows: list[dict] | None = None, out=None) -> None:
    """Print each local model's verdict as a draft for ``target``."""
    from rich.table import Column, Table

    from ondevice.cli.app import console

    if rows is None:
        from ondevice.autodraft import candidates
        from ondevice.store import lookup

        _, rows = candidates(lookup.resolve(target))
    t = Table(Column("draft", overflow="fold"), "size", "of target", "verdict", title=f"candidate drafts for {target}")
    for r in rows:
        ratio = f"{r['size_ratio']:.2f}" if r.get("size_ratio") is not None else ""
        t.add_row(r["name"], _mb(r.get("size")), ratio, ("[green]✓ [/green]" if r["ok"] else "✗ ") + r["reason"])
    (out or console()).print(t)
    if not any(r["ok"] for r in rows):
        (out or console()).print("no compatible, much smaller local model: --draft auto would use n-gram drafting")
