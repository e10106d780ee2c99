"""Where the trained EAGLE-style drafter lives and how it is written: a SpecForge EAGLE-3 checkpoint (the
training's output, ``save_checkpoint``) converted by ``converters.eagle3`` into one GGUF of arch ``eagle3``
(checked there against a numpy forward of the checkpoint in llama.cpp's own graph) and kept beside the model as
``<model file>.eagle.gguf`` (or ``<home>/heads/<stem>-<sha256[:16]>.eagle.gguf``), carrying our JSON under the
key ``ondevice.heads`` (format, target sha256, sizes, τ measured, wall times). ``draft="heads"`` loads it in
preference to Medusa heads (``drafters.registry``); a file made for another model is refused in one line.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from ondevice import atomic
from ondevice.errors import OndeviceError
from ondevice.heads import store

SUFFIX = ".eagle.gguf"
FORMAT = "ondevice-eagle"
META_KEY = "ondevice.heads"


def default_path(model: str | os.PathLike) -> Path:
    """Where the drafter trained for ``model`` lives by default (beside the Medusa heads' place)."""
    p = store.default_path(model)
    return p.with_name(p.name[: -len(store.SUFFIX)] + SUFFIX)


def find(model: str | os.PathLike) -> Path | None:
    p = default_path(model)
    return p if p.is_file() else None


def save_checkpoint(folder: Path, params: dict[str, np.ndarray], config: dict, vocab_ids: np.ndarray) -> Path:
    """Write ``config.json`` + ``model.safetensors`` (float32; SpecForge names, ``d2t`` as offsets) to ``folder``."""
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    t = {("midlayer." + k[len("layer."):] if k.startswith("layer.") else k): np.ascontiguousarray(v, np.float32)
         for k, v in params.items()}
    ids = np.asarray(vocab_ids, np.int64)
    t["d2t"] = ids - np.arange(len(ids), dtype=np.int64)
    save_file(t, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config, indent=1), encoding="utf-8")
    return folder


def write_gguf(checkpoint: Path, target: Path, dest: Path, meta: dict, convert, dtype: str = "f16", **kw) -> dict:
    """Convert ``checkpoint`` for ``target`` with ``convert`` (``converters.eagle3.convert_eagle3``: it writes the
    GGUF and checks llama.cpp's graph — or, given ``mlx_target=`` in ``kw``, MLX's — against a numpy forward of the
    checkpoint) and move the GGUF to ``dest`` atomically; returns the converter's summary."""
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".eagle-") as tmp:
        out = Path(tmp) / "out"
        summary = convert(checkpoint, target=target, out=out, dtype=dtype,
                          meta={META_KEY: json.dumps({"format": FORMAT, **meta})}, **kw)
        with atomic.replacing(dest) as part:
            shutil.move(str(out / "model.gguf"), part)
    return summary


def read_meta(path: str | os.PathLike) -> dict:
    """Our JSON inside a trained drafter's GGUF ({} for an EAGLE-3 GGUF not written by ``train-heads``)."""
    from ondevice.formats.gguf import read_header

    try:
        raw = read_header(Path(path))[0].get(META_KEY)
        meta = json.loads(raw) if isinstance(raw, str) else {}
    except (OSError, ValueError, OndeviceError) as e:
        raise OndeviceError(f"{Path(path).name}: not a readable drafter file ({e}); delete it and run "
                            "`ondevice train-heads MODEL` again") from None
    return meta if isinstance(meta, dict) and meta.get("format") == FORMAT else {}


def check_for(path: Path, model: Path) -> dict:
    """The file's metadata, refused in one line when it was trained for another model (by sha256)."""
    meta = read_meta(path)
    sha = store.target_sha256(model)
    if meta and meta.get("target_sha256") != sha:
        raise OndeviceError(f"{path.name}: a drafter trained for another model ({meta.get('target_file')}), not "
                            f"{model.name}; run `ondevice train-heads {model.name}` for this one, or delete it")
    return meta


def summary(model: str | os.PathLike) -> dict | None:
    """What ``models`` / ``info`` show about the trained drafter stored for ``model`` (None: none)."""
    p = find(model)
    if p is None:
        return None
    try:
        m = check_for(p, Path(model))
    except OndeviceError as e:
        return {"path": str(p), "kind": "eagle", "error": str(e)}
    tau = m.get("tau_heldout")  # the file is untrusted: what `info` / `models` read must have the shape they read
    return {"path": str(p), "kind": "eagle", "draft_vocab_size": m.get("draft_vocab_size"),
            "training_tokens": m.get("training_tokens"), "tau_heldout": tau if isinstance(tau, dict) else None,
            "record_seconds": m.get("record_seconds"), "fit_seconds": m.get("fit_seconds")}


def stored(model: str | os.PathLike) -> dict | None:
    """What ``models`` / ``info`` show: the EAGLE-style drafter's ``summary`` where one is stored (what
    ``draft="heads"`` loads first), else the Medusa heads' (``store.summary``), else None."""
    return summary(model) or store.summary(model)


def describe(h: dict) -> str:
    """One line for a ``stored`` summary."""
    if "error" in h:
        return h["error"]
    if h.get("kind") == "eagle":
        t = h.get("tau_heldout") or {}
        return (f"EAGLE, {h['draft_vocab_size']}-token draft vocabulary, {h['training_tokens']} training tokens, held-out "
                f"τ {t.get('tau_chain3')} / {t.get('tau_chain5')} at γ 3 / 5 ({h['path']})")
    tau = h.get("tau_heldout_greedy_chain")
    return (f"K={h['K']}, {h['draft_vocab_size']}-token draft vocabulary ({h['input_vocab_size']} read), "
            f"{h['training_tokens']} training tokens{f', held-out τ {tau:.2f}' if tau else ''} ({h['path']})")
