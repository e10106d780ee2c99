"""The measured verify curve is cached per kernels too: a rebuilt llama.cpp, or one loaded without its repacked
kernels (the AMX guard), measures its own curve instead of reading another build's."""

from __future__ import annotations

import llama_cpp

from ondevice.backends.llama import LlamaBackend
from ondevice.backends.llama_ext import without_extra_bufts
from ondevice.costs import _key


def test_the_costs_key_names_the_kernel_set(tiny_gguf, monkeypatch):
    path = tiny_gguf("llama")
    a = LlamaBackend(path, n_ctx=64, threads=1)
    monkeypatch.setattr(llama_cpp, "llama_model_default_params", without_extra_bufts(llama_cpp.llama_model_default_params))
    b = LlamaBackend(path, n_ctx=64, threads=1)
    try:
        assert a.kernels.startswith(f"llama.cpp {llama_cpp.__version__} ") and b.kernels.endswith(" plain")
        assert a.kernels != b.kernels or a.kernels.endswith(" plain")  # the default is plain where AMX is guarded
        assert _key(b).endswith(b.kernels) and _key(a).endswith(a.kernels)
    finally:
        a.close()
        b.close()
