"""Loading a runtime for ``--parallel N`` slots (``build_parallel``), N given or chosen by measurement
(``parallel="auto"``: ``ondevice.batch_curve``)."""

from __future__ import annotations

from pathlib import Path

from ondevice.errors import OndeviceError


def parallel_option(value, name: str = "parallel") -> int | str:
    """``--parallel`` / ``load(parallel=)``: a whole number of slots from 1 to 64, or "auto" (``name``: the option
    as the message names it).

    Raises:
        OndeviceError: anything else (one line naming the option and what it takes).
    """
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    try:
        n = int(value) if not isinstance(value, bool) and str(value).strip().isdigit() else None
    except (TypeError, ValueError):
        n = None
    if n is None or not 1 <= n <= 64 or (not isinstance(value, (int, str))):
        shown = f"{name} {value}" if name.startswith("-") else f"{name}={value!r}"
        raise OndeviceError(f"{shown}: give a whole number of slots from 1 to 64, or auto")
    return n


def build_parallel(build, model, draft, parallel: int | str, *, n_ctx: int, **options):
    """``loader.build`` with a llama.cpp target of ``parallel`` sequences, each with ``n_ctx`` cells in a KV buffer
    of its own (a batch of them decodes as each would alone). ``parallel="auto"``: the slot count
    ``ondevice.batch_curve.choose_slots`` picks from this machine's measured batch curve (1 for a model that is not
    GGUF, or where batching does not pay: the usual one-at-a-time runtime). ``rt.parallel`` says what was chosen,
    ``rt.batch_curve`` the curve (auto only).

    Raises:
        OndeviceError: a bad ``parallel``, or N >= 2 for a model that is not GGUF.
    """
    from ondevice.backends import detect_format, open_backend

    parallel = parallel_option(parallel)
    chosen = {"n": parallel, "curve": None}

    def open_target(path, *, n_ctx, threads, device, mmap):
        path = Path(path)
        gguf = device != "mil" and detect_format(path) == "gguf"
        file = path / "model.gguf" if path.is_dir() else path
        if chosen["n"] == "auto":
            if not gguf:
                chosen["n"] = 1
            else:
                from ondevice.batch_curve import cached_curve, choose_slots

                chosen["curve"] = cached_curve(file, threads=threads, device=device, mmap=mmap)
                chosen["n"] = choose_slots(chosen["curve"])
        n = chosen["n"]
        if n == 1:
            return open_backend(path, n_ctx=n_ctx, threads=threads, device=device, mmap=mmap)
        if not gguf:
            raise OndeviceError(f"{path.name}: parallel slots need a GGUF (llama.cpp) model; MLX and Core ML "
                                "models serve one request at a time (drop parallel / --parallel)")
        from ondevice.backends.llama import LlamaBackend

        return LlamaBackend(file, n_ctx=n_ctx * n, threads=threads, device=device, mmap=mmap, n_seq_max=n,
                            kv_unified=False)

    rt = build(model, draft, n_ctx=n_ctx, open_target=open_target if parallel != 1 else open_backend, **options)
    n = rt.parallel = chosen["n"]
    rt.batch_curve = chosen["curve"]
    if n > 1:
        rt.n_ctx = rt.slot.n_ctx = min(rt.n_ctx, rt.target.n_ctx_seq)  # one-at-a-time requests run on sequence 0
    return rt
