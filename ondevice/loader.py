"""``load()``: open a target (and a drafter) by name or path and return a ``Runtime``.

It sits above ``runtime`` and ``distributed.sharded``: under ``mlx.launch`` it hands ``build`` to the
sharded loader, which builds the same runtime around a sharded target, so neither imports this module.
"""

from __future__ import annotations

import time
from pathlib import Path

from ondevice.backends import open_backend
from ondevice.drafters import Drafter, ModelDrafter, NgramDrafter
from ondevice.errors import OndeviceError
from ondevice.params import DEFAULT_N_CTX
from ondevice.runtime import Runtime
from ondevice.store import lookup

DRAFTERS = ("model", "ngram", "heads", "none")


def load(
    model: str | Path,
    draft: str | Path | None = None,
    *,
    drafter: str | None = None,
    n_ctx: int = DEFAULT_N_CTX,
    threads: int | None = None,
    device: str | None = None,
    mmap: bool = True,
    draft_device: str | None = None,
) -> Runtime:
    """Load a target model (and optionally a draft) for speculative generation.

    Args:
        model: target: a GGUF path, a converted model directory, a catalog model name, or a catalog
            pair name (which also sets the draft).
        draft: draft model (same forms), "auto" (the local model the cost model expects to be fastest,
            else n-gram drafting; see ``Runtime.draft_choice``), "heads" (the heads trained for this
            target by ``ondevice train-heads``; or a path to a ``.heads.safetensors`` file), or None.
        drafter: "model" (needs a draft), "ngram" (prompt lookup), "heads" or "none" (plain decoding).
            Default: "model" when a draft is given, else "ngram".
        n_ctx: context length of the caches.
        threads: CPU threads (default: the physical cores other processes leave free at load; see ``ondevice.threads``).
        device: 'gpu' | 'cpu' | None: where MLX runs (default Metal when available) and whether
            llama.cpp offloads layers; 'mil': a Core ML package runs in the MIL interpreter.
        mmap: memory-map GGUF weights (the default; False reads them into memory).
        draft_device: where the draft runs: 'gpu' | 'cpu' | 'mil' (a Core ML draft in the MIL interpreter) |
            None (the target's ``device``; a Core ML draft then stays on CPU_AND_NE).
    Returns:
        A ``Runtime``; use it as a context manager or call ``close()``. In an ``mlx.launch`` job with
        several ranks the target is sharded over them (see ``ondevice.distributed.sharded``).
    """
    from ondevice.distributed import world

    if world.active():
        from ondevice.distributed import sharded

        return sharded.load(model, draft, build=build, drafter=drafter, n_ctx=n_ctx, threads=threads, device=device,
                            mmap=mmap, draft_device=draft_device)
    return build(model, draft, drafter=drafter, n_ctx=n_ctx, threads=threads, device=device, mmap=mmap,
                 draft_device=draft_device)


def build(model, draft, *, drafter, n_ctx, threads, device, mmap, draft_device=None, open_target=open_backend,
          runtime_class=None) -> Runtime:
    """``load`` with the target's opener and the runtime class as parameters (a sharded target swaps both)."""
    t0 = time.perf_counter()
    heads_file = None
    if draft is not None and drafter in (None, "model", "heads") and (str(draft) == "heads" or str(draft).endswith(".heads.safetensors")):
        heads_file = None if str(draft) == "heads" else draft
        draft, drafter = None, "heads"
    if draft is None and drafter in (None, "model"):
        pair = lookup.resolve_pair(str(model))
        if pair:
            model, draft = pair
    kind = drafter or ("model" if draft is not None else "ngram")
    if kind not in DRAFTERS:
        raise OndeviceError(f"drafter={kind!r}: choose one of {', '.join(DRAFTERS)}")
    if kind == "model" and draft is None:
        raise OndeviceError("drafter='model' needs a draft model: pass draft=PATH (or --draft)")
    if kind != "model" and draft is not None:
        raise OndeviceError(f"a draft model was given but drafter={kind!r} would not use it; drop one of them")
    target = open_target(lookup.resolve(model), n_ctx=n_ctx, threads=threads, device=device, mmap=mmap)
    drafter_obj: Drafter | None = None
    vocab_limit = target.vocab_size
    draft_backend, draft_choice = None, None
    try:
        if kind == "model" and str(draft) == "auto":  # a local draft the cost model picks, or n-gram (#17)
            from ondevice.autodraft import choose_draft

            draft_backend, draft_choice = choose_draft(target, n_ctx=n_ctx, threads=threads, device=device, mmap=mmap)
            kind = draft_choice["drafter"]
            if kind == "heads":  # heads stored for this target are expected to beat every local draft model
                heads_file = draft_choice["path"]
        if kind == "model":
            from ondevice.formats.pairs import check_vocabs

            if draft_backend is None:
                draft_backend = open_backend(lookup.resolve(draft), n_ctx=n_ctx, threads=threads, mmap=mmap,
                                             device=draft_device or device, keep_ne=draft_device is None and device != "mil")
            try:
                vocab_limit = check_vocabs(target.vocab_tokens(), draft_backend.vocab_tokens(), target.path, draft_backend.path)
            except BaseException:
                draft_backend.close()
                raise
            drafter_obj = ModelDrafter(draft_backend, vocab_limit, target.vocab_size)
        elif kind == "ngram":
            drafter_obj = NgramDrafter()
        elif kind == "heads":  # reads the target's hidden states: no second model, no extra pass
            from ondevice.heads.drafter import HeadsDrafter

            drafter_obj = HeadsDrafter.for_target(target, heads_file)
    except BaseException:
        target.close()
        raise
    rt = (runtime_class or Runtime)(target, drafter_obj, vocab_limit=vocab_limit, load_seconds=time.perf_counter() - t0)
    rt.draft_choice = draft_choice  # draft="auto": what was chosen and why (None otherwise)
    return rt
