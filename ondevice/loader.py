"""``load()``: open a target (and a drafter) by name or path and return a ``Runtime``.

It sits above ``runtime`` and ``distributed.sharded``: under ``mlx.launch`` it hands ``build`` to the
sharded loader, which builds the same runtime around a sharded target, so neither imports this module.
"""

from __future__ import annotations

import time
from pathlib import Path

from ondevice.backends import open_backend
from ondevice.drafters import registry
from ondevice.errors import OndeviceError
from ondevice.params import DEFAULT_N_CTX
from ondevice.runtime import Runtime
from ondevice.store import lookup

DRAFTERS = registry.names()  # the registered kinds ("model", "ngram", "heads", "none")


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
    parallel: int = 1,
) -> Runtime:
    """Load a target model (and optionally a draft) for speculative generation.

    Args:
        model: target: a GGUF path, a converted model directory, a catalog model name, or a catalog
            pair name (which also sets the draft).
        draft: draft model (same forms), "auto" (the local model the cost model expects to be fastest,
            else n-gram drafting; see ``Runtime.draft_choice``), "heads" (the heads trained for this
            target by ``ondevice train-heads``; or a path to a ``.heads.safetensors`` file), or None.
        drafter: a registered kind (``ondevice.drafters.registry``): "model" (needs a draft), "ngram" (prompt
            lookup), "heads" or "none" (plain decoding). Default: "model" when a draft is given, else "ngram".
        n_ctx: context length of the caches.
        threads: CPU threads (default: the physical cores other processes leave free at load; see ``ondevice.threads``).
        device: 'gpu' | 'cpu' | None: where MLX runs (default Metal when available) and whether
            llama.cpp offloads layers; 'mil': a Core ML package runs in the MIL interpreter.
        mmap: memory-map GGUF weights (the default; False reads them into memory).
        draft_device: where the draft runs: 'gpu' | 'cpu' | 'mil' (a Core ML draft in the MIL interpreter) |
            None (the target's ``device``; a Core ML draft then stays on CPU_AND_NE).
        parallel: sequences the target decodes together (``ondevice.batching.BatchEngine(rt)``); each gets
            ``n_ctx`` cells of its own (the cache is N times larger). 1: the usual one-sequence context. A GGUF
            target only; its one-at-a-time requests then speculate with chains (trees need one KV buffer).
    Returns:
        A ``Runtime``; use it as a context manager or call ``close()``. In an ``mlx.launch`` job with
        several ranks the target is sharded over them (see ``ondevice.distributed.sharded``).
    """
    from ondevice.distributed import world

    if parallel != 1:
        from ondevice.batching import build_parallel

        if world.active():
            raise OndeviceError("parallel: not with a sharded target (mlx.launch); serve one request at a time")
        return build_parallel(build, model, draft, parallel, drafter=drafter, n_ctx=n_ctx, threads=threads,
                              device=device, mmap=mmap, draft_device=draft_device)
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
    kind, draft, source = registry.choose(drafter, draft)  # a heads file names its kind
    if draft is None and (kind is None or kind.traits.model):
        pair = lookup.resolve_pair(str(model))
        if pair:
            model, draft = pair
    kind = registry.settle(kind, draft)
    target = open_target(lookup.resolve(model), n_ctx=n_ctx, threads=threads, device=device, mmap=mmap)
    draft_backend, draft_choice = None, None
    try:
        if kind.traits.model and str(draft) == "auto":  # a local draft the cost model picks, or n-gram (#17)
            from ondevice.autodraft import choose_draft

            draft_backend, draft_choice = choose_draft(target, n_ctx=n_ctx, threads=threads, device=device, mmap=mmap)
            kind = registry.get(draft_choice["drafter"])
            source = draft_choice.get("source")  # a drafter file (stored heads) the choice names
        drafter_obj = kind.build(registry.Build(target=target, draft=draft, source=source, draft_backend=draft_backend,
                                                n_ctx=n_ctx, threads=threads, device=device, mmap=mmap,
                                                draft_device=draft_device))
    except BaseException:
        target.close()
        raise
    vocab_limit = drafter_obj.vocab_limit if drafter_obj is not None and drafter_obj.vocab_limit else target.vocab_size
    rt = (runtime_class or Runtime)(target, drafter_obj, vocab_limit=vocab_limit, load_seconds=time.perf_counter() - t0)
    rt.draft_choice = draft_choice  # draft="auto": what was chosen and why (None otherwise)
    return rt
