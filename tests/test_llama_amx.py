"""llama.cpp's AMX kernels are kept off where they would run (``llama_ext.amx_off`` / ``guard_amx``): their tile
configuration can be compiled away and the first decode then dies in ``ldtilecfg`` (llama.cpp PR #26954)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import llama_cpp
import llama_cpp.llama_cpp as raw
import pytest

from ondevice.backends import llama_ext

AMX_BUILD = b"CPU : AVX2 = 1 | AVX512 = 1 | AMX_INT8 = 1 | REPACK = 1 | "
PLAIN_BUILD = b"CPU : AVX2 = 1 | AVX512 = 1 | REPACK = 1 | "


@pytest.fixture
def machine(monkeypatch, tmp_path):
    """Set what the build and the CPU report: machine(build_info, cpu_flags or None for an unreadable cpuinfo)."""
    monkeypatch.delenv("ONDEVICE_LLAMA_AMX", raising=False)

    def set_(info: bytes, flags: str | None) -> None:
        monkeypatch.setattr(llama_cpp, "llama_print_system_info", lambda: info)
        cpuinfo = tmp_path / "cpuinfo"
        if flags is not None:
            cpuinfo.write_text(f"processor\t: 0\nflags\t\t: fpu sse2 avx2 {flags}\n")
        monkeypatch.setattr(llama_ext, "CPUINFO", cpuinfo)
    return set_


@pytest.fixture
def own(monkeypatch):
    """llama_cpp's own defaults, unguarded (whatever this session's guard did), restored after the test."""
    own = llama_ext._DEFAULTS or raw.llama_model_default_params
    monkeypatch.setattr(llama_ext, "_DEFAULTS", None)
    monkeypatch.setattr(raw, "llama_model_default_params", own)
    monkeypatch.setattr(llama_cpp, "llama_model_default_params", own)
    return own


def test_off_only_where_the_build_and_the_cpu_have_amx(machine, monkeypatch):
    machine(AMX_BUILD, "avx512f amx_tile amx_int8 amx_bf16")
    assert llama_ext.amx_off()
    machine(AMX_BUILD, "avx512f")  # a build made elsewhere, on a CPU without AMX: nothing to guard
    assert not llama_ext.amx_off()
    machine(PLAIN_BUILD, "avx512f amx_tile amx_int8")  # no AMX kernels compiled in
    assert not llama_ext.amx_off()
    machine(AMX_BUILD, None)  # cannot tell: keep them off
    assert llama_ext.amx_off()
    machine(AMX_BUILD, "amx_int8")
    monkeypatch.setenv("ONDEVICE_LLAMA_AMX", "1")  # the user's build works: keep AMX
    assert not llama_ext.amx_off()


def test_guard_makes_every_default_skip_the_extra_buffers(machine, own):
    assert own().use_extra_bufts  # llama.cpp's default: repacked (AMX) buffers on
    machine(PLAIN_BUILD, "amx_int8")
    llama_ext.guard_amx()
    assert raw.llama_model_default_params().use_extra_bufts  # nothing to guard: untouched
    machine(AMX_BUILD, "amx_int8")
    llama_ext.guard_amx()
    llama_ext.guard_amx()  # once: the second call must not wrap the wrapper
    assert llama_ext._DEFAULTS is own
    # llama_cpp.Llama reads them as llama_cpp.llama_cpp.llama_model_default_params; our backends as llama_cpp.…
    assert not raw.llama_model_default_params().use_extra_bufts
    assert not llama_cpp.llama_model_default_params().use_extra_bufts
    assert raw.llama_model_default_params().n_gpu_layers == own().n_gpu_layers  # the rest as llama.cpp's


def test_guard_from_two_threads_at_once_wraps_once(own, monkeypatch):
    """Two models loading at once (the server's embeddings beside its model): without the lock both threads
    passed the check, the second wrapped the first's wrapper and every default then recursed forever."""
    def slow_yes() -> bool:
        time.sleep(0.05)
        return True

    monkeypatch.setattr(llama_ext, "amx_off", slow_yes)
    start = threading.Barrier(2)
    threads = [threading.Thread(target=lambda: (start.wait(), llama_ext.guard_amx())) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert llama_ext._DEFAULTS is own
    assert not raw.llama_model_default_params().use_extra_bufts


def test_every_loader_guards_on_its_own(machine, own, tiny_gguf, monkeypatch):
    """init_llama (our backends) and the Embedder (llama_cpp.Llama) each guard, not only this conftest."""
    machine(AMX_BUILD, "amx_int8")
    llama_ext.init_llama()
    assert not raw.llama_model_default_params().use_extra_bufts
    from ondevice.embed import Embedder

    for mod, name in ((llama_ext, "_DEFAULTS"), (raw, "llama_model_default_params"), (llama_cpp, "llama_model_default_params")):
        monkeypatch.setattr(mod, name, None if name == "_DEFAULTS" else own)
    e = Embedder(tiny_gguf("llama", "q4_0"), n_ctx=64, threads=1)
    try:
        assert not e.llm.model_params.use_extra_bufts
    finally:
        e.close()


DECODE = """import sys
from ondevice.backends.llama import LlamaBackend
be = LlamaBackend(sys.argv[1], n_ctx=64, threads=1)
assert be.eval([1, 2, 3, 4]).shape[-1] == be.vocab_size
be.close()
"""


def test_a_model_decodes_on_this_machine(tiny_gguf):
    """On an AMX machine with an AMX build this is the decode that crashed (segfault) without the guard. In a
    child: no session-wide guard in the way, and a crash fails this test instead of ending the run."""
    env = {k: v for k, v in os.environ.items() if k != "ONDEVICE_LLAMA_AMX"}
    r = subprocess.run([sys.executable, "-c", DECODE, str(tiny_gguf("llama", "q4_0"))], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"a 4-token decode exited {r.returncode}: {r.stderr[-2000:]}"
