"""The heads file: one safetensors file whose header carries our JSON, kept beside the model in the store.

Layout: tensors ``vocab`` [Vd] int64 (draft vocabulary → target ids), ``out`` [Vd, d] float16 (the target's
own LM-head rows), ``extra`` [Ve] int64 (ids embedded but never drafted; absent: none), ``emb`` [Vd + Ve, d]
float16 (the target's token-embedding rows of ``vocab`` then ``extra``), and per head k ``w1.k`` [r, 2d], ``b1.k`` [r],
``w2.k`` [d, r] float32, optionally ``short_a`` [Vd, r'] / ``short_b`` [r', d] float32 (the low-rank factors
of ``out`` that pick the drafting shortlist, ``Heads.draft_logits``); metadata key ``ondevice.heads`` holds JSON: format, version, target sha256,
file name, architecture, hidden size, K, rank, vocabulary sizes, input scales, training tokens, seed,
wall time and the τ measured on held-out answers.

Where: a model inside the store (``catalog.home()``) gets ``<model file>.heads.safetensors`` beside it;
any other model gets ``<home>/heads/<file stem>-<sha256[:16]>.heads.safetensors``. Writes go through
a temp file and a rename; a corrupt file, or one made for another model, is refused in one line.
The target is a GGUF file (its sha256) or an MLX model directory (``<directory>.heads.safetensors`` in
the store, ``<home>/heads/<directory name>-<sha256[:16]>…`` elsewhere; the sha256 of its weight files).
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
from pathlib import Path

import numpy as np

from ondevice import atomic
from ondevice.errors import OndeviceError
from ondevice.heads.model import Heads

FORMAT = "ondevice-heads"
VERSION = 1
SUFFIX = ".heads.safetensors"
_SHA: dict[tuple, str] = {}


def _file_sha256(path: Path) -> str:
    """sha256 of one file: the catalog's verified stamp when it still matches, else hashed (once per process)."""
    from ondevice.store import fetch

    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _SHA:
        try:
            stamp = json.loads(path.with_name(path.name + ".verified").read_text())
            ok = stamp.get("size") == st.st_size and stamp.get("mtime_ns") == st.st_mtime_ns
            _SHA[key] = stamp["sha256"] if ok else fetch.sha256_file(path)
        except (OSError, ValueError, KeyError, TypeError):
            _SHA[key] = fetch.sha256_file(path)
    return _SHA[key]


def target_sha256(path: str | os.PathLike) -> str:
    """sha256 of a model: a GGUF file's own; for a model directory (MLX), the sha256 of the list of its weight
    files (``*.safetensors``, by name) with each file's sha256 — the same weights give the same value
    wherever the directory lies, and each file is hashed once per process (or read from its stamp)."""
    path = Path(path)
    if not path.is_dir():
        return _file_sha256(path)
    files = sorted(f for f in path.glob("*.safetensors") if not f.name.endswith(SUFFIX))
    if not files:
        raise OndeviceError(f"{path}: no *.safetensors weight files; heads need a GGUF file or an MLX model directory")
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.name}\0{_file_sha256(f)}\n".encode())
    return h.hexdigest()


def default_path(model: str | os.PathLike) -> Path:
    """Where the heads of ``model`` (a GGUF file or an MLX model directory) live by default."""
    from ondevice.store import catalog

    model = Path(model).resolve()
    home = catalog.home().resolve()
    if home in model.parents:
        return model.with_name(model.name + SUFFIX)
    stem = model.name if model.is_dir() else model.stem
    return home / "heads" / f"{stem}-{target_sha256(model)[:16]}{SUFFIX}"


def save(path: str | os.PathLike, heads: Heads, meta: dict) -> Path:
    """Write ``heads`` and ``meta`` to ``path`` (temp file, then rename). Returns the path."""
    from safetensors.numpy import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    t = {"vocab": heads.vocab.astype(np.int64), "out": heads.out.astype(np.float16), "emb": heads.emb.astype(np.float16)}
    if len(heads.extra):
        t["extra"] = heads.extra.astype(np.int64)
    for k in range(heads.K):
        t[f"w1.{k}"], t[f"b1.{k}"], t[f"w2.{k}"] = heads.w1[k], heads.b1[k], heads.w2[k]
    if heads.short_a is not None:
        t["short_a"], t["short_b"] = heads.short_a, heads.short_b
    full = {"format": FORMAT, "version": VERSION, **meta, "K": heads.K, "rank": heads.rank, "hidden_size": heads.d,
            "draft_vocab_size": len(heads.vocab), "input_vocab_size": len(heads.vocab) + len(heads.extra), "s_h": heads.s_h, "s_e": heads.s_e,
            "shortlist": heads.shortlist if heads.short_a is not None else None}
    with atomic.replacing(path) as tmp:
        save_file({k: np.ascontiguousarray(v) for k, v in t.items()}, tmp, metadata={"ondevice.heads": json.dumps(full)})
    return path


def _retrain(model: str | os.PathLike | None) -> str:
    """The command that writes heads for ``model`` again (MODEL when unknown), quoted to run from anywhere."""
    return f"ondevice train-heads {shlex.quote(str(Path(model).resolve())) if model is not None else 'MODEL'}"


def read_meta(path: str | os.PathLike, model: str | os.PathLike | None = None) -> dict:
    """The JSON of a heads file (header only). Raises a one-line ``OndeviceError`` on a corrupt file (naming
    ``model``, the target the file was looked up for, in the fix when given)."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise OndeviceError(f"{path}: no such heads file; pass a .heads.safetensors file written by `ondevice train-heads`, "
                            "or --draft heads for the heads stored beside the model")
    try:
        with safe_open(str(path), "np") as f:
            meta = json.loads((f.metadata() or {})["ondevice.heads"])
    except Exception as e:
        raise OndeviceError(f"{path}: not a readable heads file ({type(e).__name__}: {str(e)[:80]}); delete it and "
                            f"run `{_retrain(model)}` again") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise OndeviceError(f"{path}: not an ondevice heads file of version {VERSION}; delete it and run `{_retrain(model)}` again")
    return meta


def load(path: str | os.PathLike, model: str | os.PathLike, vocab_size: int | None = None) -> tuple[Heads, dict]:
    """Read heads for ``model``, refusing a file made for another model or a corrupt one (one line).

    Args:
        path: the heads file.
        model: the target (GGUF file or MLX directory) the heads will draft for (its sha256 must match the file's).
        vocab_size: the target's vocabulary size (draft and input ids must lie below it; None: the header's
            ``target_vocab_size`` where it has one).
    Returns:
        (heads, metadata).
    """
    from safetensors.numpy import load_file

    path = Path(path)
    meta = read_meta(path, model)
    sha = target_sha256(model)
    if meta.get("target_sha256") != sha:
        raise OndeviceError(f"{path}: heads made for another model ({meta.get('target_file')}, sha256 "
                            f"{str(meta.get('target_sha256'))[:12]}…), not {Path(model).name} (sha256 {sha[:12]}…); "
                            f"run `{_retrain(model)}` for this one")
    fix = f"delete it and run `{_retrain(model)}` again"
    if vocab_size is None and type(meta.get("target_vocab_size")) is int:
        vocab_size = meta["target_vocab_size"]  # a huge id must not make ``Heads.index`` allocate terabytes
    try:
        t = load_file(str(path))
        K, d = int(meta["K"]), int(meta["hidden_size"])
        if "extra" in t and t["extra"].dtype.kind not in "iu":
            raise ValueError(f"extra ids of dtype {t['extra'].dtype}")
        with np.errstate(over="ignore", invalid="ignore"):  # an emb beyond float16 is refused below, not warned about
            heads = Heads(t["vocab"].astype(np.int64), t["out"].astype(np.float32), t["emb"],
                          [t[f"w1.{k}"] for k in range(K)], [t[f"b1.{k}"] for k in range(K)], [t[f"w2.{k}"] for k in range(K)],
                          float(meta["s_h"]), float(meta["s_e"]), extra=t.get("extra"))
        if "short_a" in t:
            heads.short_a, heads.short_b = t["short_a"], t["short_b"]
            heads.shortlist = int(meta["shortlist"])
        ids = heads.vocab_in  # fails on an ``extra`` that is not a list of ids
    except OndeviceError:
        raise
    except Exception as e:
        raise OndeviceError(f"{path}: corrupt heads file ({type(e).__name__}: {str(e)[:80]}); {fix}") from None
    Vd, r = len(heads.vocab), heads.rank
    shapes_ok = heads.out.shape == (Vd, d) and heads.emb.shape == (len(ids), d) and heads.extra.ndim == 1 and all(
        w1.shape == (r, 2 * d) and b1.shape == (r,) and w2.shape == (d, r) for w1, b1, w2 in zip(heads.w1, heads.b1, heads.w2, strict=False))
    if heads.short_a is not None:
        ra = heads.short_a.shape[1] if heads.short_a.ndim == 2 else -1
        shapes_ok = shapes_ok and heads.short_a.shape == (Vd, ra) and heads.short_b.shape == (ra, d) and 0 < heads.shortlist <= Vd
    shorts = () if heads.short_a is None else (heads.short_a, heads.short_b)
    finite = all(np.isfinite(w).all() for w in (heads.out, heads.emb, *heads.w1, *heads.b1, *heads.w2, *shorts))
    in_vocab = Vd > 0 and ids.min() >= 0 and (vocab_size is None or ids.max() < vocab_size)
    if not (shapes_ok and finite and in_vocab and len(np.unique(ids)) == len(ids)):
        raise OndeviceError(f"{path}: corrupt heads file (shapes, ids or values do not match its header); {fix}")
    return heads, meta


def find(model: str | os.PathLike) -> Path | None:
    """The heads file stored for ``model``, or None."""
    p = default_path(model)
    return p if p.is_file() else None


def summary(model: str | os.PathLike) -> dict | None:
    """What ``ondevice models`` / ``info`` show about the heads stored for ``model`` (GGUF or MLX): path, K, draft
    vocabulary, training tokens, held-out τ and wall times (None when none are stored; ``error`` when
    the file is unreadable)."""
    p = find(model)
    if p is None:
        return None
    try:
        m = read_meta(p, model)
    except OndeviceError as e:
        return {"path": str(p), "error": str(e)}
    if m.get("target_sha256") != target_sha256(model):  # what `--draft heads` would refuse
        return {"path": str(p), "error": f"{p}: heads made for another model ({m.get('target_file')}); delete it and run "
                                         f"`{_retrain(model)}` for this one"}
    tau = (m.get("tau_heldout_greedy_chain") or {}).get("tau")
    return {"path": str(p), "K": m.get("K"), "draft_vocab_size": m.get("draft_vocab_size"),
            "input_vocab_size": m.get("input_vocab_size", m.get("draft_vocab_size")), "rank": m.get("rank"),
            "training_tokens": m.get("training_tokens"), "tau_heldout_greedy_chain": tau,
            "record_seconds": m.get("record_seconds"), "fit_seconds": m.get("fit_seconds")}
