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
from ondevice.params import DEFAULT_N_CTX, DEFAULT_PROMPT_CACHE_SIZE
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
    cache_type_k: str = "f16",
    cache_type_v: str = "f16",
    prompt_cache: str | Path | None = None,
    prompt_cache_size: int | str = DEFAULT_PROMPT_CACHE_SIZE,
    mmproj: str | Path | None = None,
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
        cache_type_k, cache_type_v: the target's KV-cache element types, "f16" | "q8_0" | "q4_0" (llama.cpp
            only; a quantized V cache runs with flash attention).
        prompt_cache: a folder for KV states of long prompt prefixes (``ondevice.prompt_cache``): a request
            starting with a stored prefix, also after a restart, restores it instead of evaluating it (llama.cpp
            only). ``Stats.cached_tokens`` says how many prompt tokens were reused.
        prompt_cache_size: bound of that folder: bytes, or a string such as "4GiB" / "512MB" (least recently
            used files go first).
        mmproj: the vision projector (mmproj GGUF) for images in ``chat`` messages; default: one found beside
            the model (``ondevice.backends.mmproj.find_mmproj``), loaded at the first image.
    Returns:
        A ``Runtime``; use it as a context manager or call ``close()``. In an ``mlx.launch`` job with
        several ranks the target is sharded over them (see ``ondevice.distributed.sharded``).
    """
    from ondevice.distributed import world

    extras = {"cache_type_k": cache_type_k, "cache_type_v": cache_type_v, "prompt_cache": prompt_cache,
              "prompt_cache_size": prompt_cache_size, "mmproj": mmproj}
    if parallel != 1:
        from ondevice.batching import build_parallel

        if world.active():
            raise OndeviceError("parallel: not with a sharded target (mlx.launch); serve one request at a time")
        from ondevice.backends.llama import check_cache_type

        if (check_cache_type("cache_type_k", cache_type_k), check_cache_type("cache_type_v", cache_type_v)) != \
                ("f16", "f16"):
            raise OndeviceError("cache_type_k / cache_type_v with parallel: not yet (the parallel slots' context is "
                                "made with an f16 cache); drop one of them")
        return build_parallel(build, model, draft, parallel, drafter=drafter, n_ctx=n_ctx, threads=threads,
                              device=device, mmap=mmap, draft_device=draft_device, prompt_cache=prompt_cache,
                              prompt_cache_size=prompt_cache_size, mmproj=mmproj)
    if world.active():
        from ondevice.distributed import sharded

        if (cache_type_k, cache_type_v) != ("f16", "f16") or prompt_cache is not None or mmproj is not None:
            raise OndeviceError("cache types, a prompt cache and images are llama.cpp's; a sharded (MLX) target "
                                "takes none of them")

        return sharded.load(model, draft, build=build, drafter=drafter, n_ctx=n_ctx, threads=threads, device=device,
                            mmap=mmap, draft_device=draft_device)
    return build(model, draft, drafter=drafter, n_ctx=n_ctx, threads=threads, device=device, mmap=mmap,
                 draft_device=draft_device, **extras)


def build(model, draft, *, drafter, n_ctx, threads, device, mmap, draft_device=None, open_target=open_backend,
          runtime_class=None, cache_type_k="f16", cache_type_v="f16", prompt_cache=None,
          prompt_cache_size=DEFAULT_PROMPT_CACHE_SIZE, mmproj=None) -> Runtime:
    """``load`` with the target's opener and the runtime class as parameters (a sharded target swaps both)."""
    t0 = time.perf_counter()
    max_bytes = size_bytes(prompt_cache_size, "prompt_cache_size")  # bad options fail before anything loads
    kv_types = {"cache_type_k": cache_type_k, "cache_type_v": cache_type_v} \
        if (cache_type_k, cache_type_v) != ("f16", "f16") else {}  # a sharded opener takes none
    kind, draft, source = registry.choose(drafter, draft)  # a heads file names its kind
    if draft is None and (kind is None or kind.traits.model):
        pair = lookup.resolve_pair(str(model))
        if pair:
            model, draft = pair
    kind = registry.settle(kind, draft)
    target = open_target(lookup.resolve(model), n_ctx=n_ctx, threads=threads, device=device, mmap=mmap, **kv_types)
    draft_backend, draft_choice, extras = None, None, (None, None, None)
    try:
        extras = target_extras(target, prompt_cache, max_bytes, mmproj)
        if kind.traits.model and str(draft) == "auto":  # a local draft the cost model picks, or n-gram (#17)
            from ondevice.autodraft import choose_draft

            draft_backend, draft_choice = choose_draft(target, n_ctx=n_ctx, threads=threads, device=device, mmap=mmap)
            kind = registry.get(draft_choice["drafter"])
            source = draft_choice.get("source")  # a drafter file (stored heads) the choice names
        drafter_obj = kind.build(registry.Build(target=target, draft=draft, source=source, draft_backend=draft_backend,
                                                n_ctx=n_ctx, threads=threads, device=device, mmap=mmap,
                                                draft_device=draft_device))
    except BaseException:
        if extras[1] is not None:
            extras[1].close()  # libmtmd holds the model: freed first
        target.close()
        raise
    vocab_limit = drafter_obj.vocab_limit if drafter_obj is not None and drafter_obj.vocab_limit else target.vocab_size
    rt = (runtime_class or Runtime)(target, drafter_obj, vocab_limit=vocab_limit, load_seconds=time.perf_counter() - t0)
    rt.draft_choice = draft_choice  # draft="auto": what was chosen and why (None otherwise)
    rt.slot.prompt_cache, rt.projector, rt.mmproj = extras
    from ondevice.threads import release_omp_team

    release_omp_team()  # draft="auto" / parallel="auto" timed the models on this thread, which need not serve
    return rt


def size_bytes(value: int | str, name: str) -> int:
    """A size in bytes from an int or a string such as "4GiB", "512MB", "1e9" (one-line error otherwise)."""
    import re

    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?(?:e[0-9]+)?)\s*([kmgt]i?b?|b)?\s*", str(value), re.I)
    if isinstance(value, bool) or not m:
        raise OndeviceError(f"{name}={value!r}: give bytes or a size such as 4GiB or 512MB")
    unit = (m.group(2) or "b").lower().rstrip("b")
    scale = (1024 if unit.endswith("i") else 1000) ** ("kmgt".index(unit[0]) + 1) if unit else 1
    n = int(float(m.group(1)) * scale)
    if n < 1:
        raise OndeviceError(f"{name}={value!r}: must be at least 1 byte")
    return n


def target_extras(target, prompt_cache, max_bytes: int, mmproj):
    """(PromptCache or None, Projector or None, the projector path to attach at the first image or None) for a
    llama.cpp target; an MLX / Core ML target given a prompt cache or a projector is refused in one line."""
    from ondevice.backends.llama import LlamaBackend

    llama = isinstance(target, LlamaBackend)
    if not llama and (prompt_cache is not None or mmproj is not None):
        what = "prompt_cache" if prompt_cache is not None else "mmproj"
        raise OndeviceError(f"{target.path.name}: {what} needs a llama.cpp (GGUF) target; this one is "
                            f"{type(target).__name__}")
    cache = projector = found = None
    if prompt_cache is not None:
        from ondevice.prompt_cache import PromptCache

        cache = PromptCache(Path(prompt_cache).expanduser(), target, max_bytes=max_bytes)
    if mmproj is not None:  # named: a bad file fails at load
        from ondevice.backends.llama_mtmd import attach

        projector = attach(target, mmproj)
    elif llama:
        from ondevice.backends.mmproj import find_mmproj

        found = find_mmproj(target.path)
    return cache, projector, found
