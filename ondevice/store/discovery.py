"""Models already on this machine (HF cache, LM Studio, Ollama) and their cheap facts.

Facts come from GGUF headers (``ondevice.formats.gguf.read_header``) and tokenizer files only (no weights are read): format, architecture,
quantization, size, vocabulary size and a vocabulary fingerprint (sha256 of the token texts in id
order). They are cached in ``$ONDEVICE_HOME/fingerprints.json`` keyed by path, size and mtime, so a
second listing reads no model file.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from ondevice.atomic import write_text
from ondevice.backends import is_gguf_file
from ondevice.errors import OndeviceError, shown
from ondevice.formats.gguf import read_header
from ondevice.store import sources

FACTS_VERSION = 1


def pair_rules():
    """The pair rules module (``check_vocabs``, ``model_tokens``, ``gguf_tokens``).

    Imported lazily: the listing itself needs only the GGUF header reader.
    """
    from ondevice.formats import pairs

    return pairs


def tokens(path: Path) -> list[str]:
    """Token texts in id order of a GGUF file (any name: Ollama blobs have no suffix) or a weights dir."""
    path = Path(path)
    if path.is_dir() and (path / "model.gguf").is_file():  # a directory our converter wrote
        path = path / "model.gguf"
    if path.is_file() and is_gguf_file(path):
        texts = read_header(path)[1]
        if texts is None:
            raise OndeviceError(f"{shown(path)}: GGUF has no tokenizer.ggml.tokens; it cannot be paired")
        return texts
    return pair_rules().model_tokens(path)


def fingerprint(texts: list[str]) -> str:
    """sha256 (first 16 hex digits) of the token texts, NUL-separated, in id order."""
    h = hashlib.sha256()
    for t in texts:
        h.update(t.encode("utf-8", "surrogatepass"))
        h.update(b"\0")
    return h.hexdigest()[:16]


def _stat_key(path: Path) -> tuple[str, int]:
    """(cache key from path + size + mtime of what the facts are read from, size of the model in bytes)."""
    path = Path(path)
    if path.is_file():
        st = path.stat()
        return f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}", st.st_size
    files = sorted(f for f in path.iterdir() if f.is_file())
    size = sum(f.stat().st_size for f in files)
    newest = max((f.stat().st_mtime_ns for f in files), default=0)
    return f"{path.resolve()}|{size}|{newest}", size


def _gguf_facts(path: Path) -> dict:
    import gguf

    meta, texts = read_header(path)
    if texts is None:
        raise OndeviceError(f"{shown(path)}: GGUF has no tokenizer.ggml.tokens; it cannot be paired")
    ft = meta.get("general.file_type")
    try:
        quant = gguf.LlamaFileType(int(ft)).name.removeprefix("MOSTLY_") if ft is not None else "unknown"
    except ValueError:
        quant = str(ft)
    return {"format": "gguf", "arch": meta.get("general.architecture"), "quant": quant, "vocab_size": len(texts),
            "fingerprint": fingerprint(texts)}


def _dir_facts(path: Path) -> dict:
    cfg = json.loads((path / "config.json").read_text())
    q = cfg.get("quantization") or cfg.get("quantization_config") or {}
    quant = f"affine{q['bits']}g{q['group_size']}" if "bits" in q and "group_size" in q else \
        q.get("quant_method", "float") if q else "float"
    texts = pair_rules().model_tokens(path)
    return {"format": "mlx", "arch": cfg.get("model_type"), "quant": quant, "vocab_size": len(texts),
            "fingerprint": fingerprint(texts)}


def _cache_file() -> Path:
    from ondevice.store import catalog

    return catalog.home() / "fingerprints.json"


def facts(path: Path, cache: dict | None = None) -> dict:
    """format, arch, quant, size, vocab_size, fingerprint of one model (cached by path, size, mtime).

    Args:
        path: a GGUF file or an MLX / safetensors directory.
        cache: a loaded fingerprint cache to read and update (``facts`` saves it itself when None).
    Raises:
        OndeviceError: the files cannot be read as a model.
    """
    path = Path(path)
    if path.is_dir() and (path / "model.gguf").is_file():  # a directory our converter wrote
        path = path / "model.gguf"
    own = cache is None
    cache = _load_cache() if own else cache
    try:
        key, size = _stat_key(path)
    except OSError as e:  # a dangling link (an interrupted HF download), a file removed meanwhile, no permission
        why = f"a broken link to {os.readlink(path)}" if path.is_symlink() and not path.exists() else \
            f"cannot be read ({e.strerror or type(e).__name__})"
        raise OndeviceError(f"{shown(path)}: {why}") from e
    hit = cache.get(key)
    if hit is not None:
        return {**hit, "size": size}
    try:
        if path.is_file() and is_gguf_file(path):
            f = _gguf_facts(path)
        elif sources.is_weights_dir(path):
            f = _dir_facts(path)
        else:
            raise OndeviceError(f"{shown(path)}: not a GGUF file or an MLX / safetensors model directory")
    except OndeviceError:
        raise
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
        raise OndeviceError(f"{shown(path)}: cannot read its metadata ({type(e).__name__}: {e})") from e
    resolved = str(path.resolve())
    for k in [k for k in cache if k.rsplit("|", 2)[0] == resolved]:
        del cache[k]  # an older version of this file
    cache[key] = f
    if own:
        _save_cache(cache)
    return {**f, "size": size}


def _load_cache() -> dict:
    try:
        data = json.loads(_cache_file().read_text())
    except (OSError, ValueError):
        return {}
    return data.get("models", {}) if isinstance(data, dict) and data.get("version") == FACTS_VERSION else {}


def _save_cache(cache: dict) -> None:
    try:
        write_text(_cache_file(), json.dumps({"version": FACTS_VERSION, "models": cache}))
    except OSError:
        pass  # a read-only cache dir only costs a re-read next time


def _hf_models() -> list[tuple[str, Path]]:
    """(name, path) of every model in the HF cache (main revision, else the newest one)."""
    cache = sources.hf_cache_dir()
    if not cache.is_dir():
        return []
    from huggingface_hub import scan_cache_dir

    out = []
    for repo in sorted(scan_cache_dir(cache).repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model" or not repo.revisions:
            continue
        revs = sorted(repo.revisions, key=lambda r: ("main" in r.refs, r.last_modified), reverse=True)
        snap = Path(revs[0].snapshot_path)
        if sources.is_weights_dir(snap):
            out.append((f"hf:{repo.repo_id}", snap))
        for g in sources.gguf_files(snap):
            out.append((f"hf:{repo.repo_id}:{g.relative_to(snap).as_posix()}", g))
    return out


def local_models() -> list[dict]:
    """Every model in the HF cache, LM Studio's folders and Ollama's store, with its facts.

    Returns:
        One dict per model: name (usable wherever a model is accepted), source, path, format, arch,
        quant, size, vocab_size, fingerprint; or name, source, path and ``error`` for a broken one (a model
        file or folder is untrusted input: one that cannot be read never breaks the listing).
    """
    found: list[tuple[str, str, Path | None, str | None]] = []
    try:
        found += [(n, "hf", p, None) for n, p in _hf_models()]
    except OSError as e:  # an unreadable cache folder: say so, and list the other stores
        found.append(("hf:", "hf", sources.hf_cache_dir(), f"{sources.hf_cache_dir()}: cannot scan the Hugging Face "
                      f"cache ({e.strerror or type(e).__name__}); check its permissions or HF_HOME"))
    found += [(f"lmstudio:{n}", "lmstudio", p, None) for n, p in sources.lmstudio_models()]
    root = sources.ollama_dir()
    for n, manifest in sources.ollama_names(root):
        try:
            found.append((f"ollama:{n}", "ollama", sources.ollama_blob(manifest, root, f"ollama:{n}"), None))
        except OndeviceError as e:
            found.append((f"ollama:{n}", "ollama", manifest, str(e)))
    cache = _load_cache()
    before = dict(cache)
    rows = []
    for name, source, path, error in found:
        row = {"name": name, "source": source, "path": str(path)}
        if error is None:
            try:
                row.update(facts(path, cache))
            except OndeviceError as e:
                error = str(e)
            except Exception as e:  # what a crafted file provokes in a library (json nesting, tokenizers): skip it
                error = f"{path}: cannot read it as a model ({type(e).__name__}: {str(e)[:200]})"
        if error is not None:
            row["error"] = error
        rows.append(row)
    if cache != before:
        _save_cache(cache)
    return rows
