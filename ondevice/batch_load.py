"""Loading a runtime for ``--parallel N`` slots (``build_parallel``) and choosing N by measurement
(``parallel="auto"``: ``ondevice.batch_curve``)."""

from __future__ import annotations

from pathlib import Path

from ondevice.errors import OndeviceError


def build_parallel(build, model, draft, parallel: int, *, n_ctx: int, **options):
    """``loader.build`` with a llama.cpp target of ``parallel`` sequences, each with ``n_ctx`` cells in a KV buffer
    of its own (a batch of them decodes as each would alone). Raises OndeviceError for another kind of model."""
    from ondevice.backends import detect_format, open_backend

    if not isinstance(parallel, int) or isinstance(parallel, bool) or not 1 <= parallel <= 64:
        raise OndeviceError(f"parallel={parallel!r}: give a whole number of slots from 1 to 64")

    def open_target(path, *, n_ctx, threads, device, mmap):
        path = Path(path)
        if device == "mil" or detect_format(path) != "gguf":
            raise OndeviceError(f"{path.name}: parallel slots need a GGUF (llama.cpp) model; MLX and Core ML "
                                "models serve one request at a time (drop parallel / --parallel)")
        from ondevice.backends.llama import LlamaBackend

        if path.is_dir():
            path = path / "model.gguf"

        return LlamaBackend(path, n_ctx=n_ctx * parallel, threads=threads, device=device, mmap=mmap,
                            n_seq_max=parallel, kv_unified=False)

    rt = build(model, draft, n_ctx=n_ctx, open_target=open_target if parallel > 1 else open_backend, **options)
    if parallel > 1:
        rt.n_ctx = rt.slot.n_ctx = min(rt.n_ctx, rt.target.n_ctx_seq)  # one-at-a-time requests run on sequence 0
    rt.parallel = parallel
    return rt
