"""ctypes bindings of the C++-linkage functions of llama.cpp's ``src/llama-ext.h`` (EAGLE-3 / MTP features).

llama-cpp-python 0.3.36's libllama exports them with mangled names (``nm -D --defined-only libllama.so``);
each is looked up under its C name, then its Itanium-ABI name (Linux, macOS), from the library
``llama_cpp`` already loaded. A library without them is refused in one line when first asked for.

Layer inputs: ``set_embeddings_layer_inp(ctx, il, True)`` makes the target's graph keep the input of layer
``il`` (the residual stream after layer il − 1) of *every* token of each later ``llama_decode``;
``layer_inputs`` reads them back. Only architectures whose graph records them may be asked
(``LAYER_INP_ARCHS``): llama.cpp aborts the whole process (GGML_ASSERT) when another one is.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable
from functools import cache
from pathlib import Path

import numpy as np

from ondevice.errors import OndeviceError

# GGUF architectures whose graph in llama-cpp-python 0.3.36 records every layer's input (res->t_layer_inp);
# read from vendor/llama.cpp/src/models/*.cpp. qwen2 (Qwen2.5), gemma3, phi3 … do not.
LAYER_INP_ARCHS = frozenset({
    "llama", "qwen3", "qwen3moe", "qwen35", "qwen35moe", "qwen3next", "qwen4exp", "gemma4", "gpt-oss", "lfm2",
    "mimo2", "minimax-01", "minimax-m2", "bailingmoe3", "nemotron_h", "nanbeige", "hunyuan_vl", "muse-glimmer",
    "deepseek4",
})

_CTX, _MODEL = "P13llama_context", "PK11llama_model"
_LOG_CB = None
CPUINFO = Path("/proc/cpuinfo")
_DEFAULTS = None  # llama_cpp's own llama_model_default_params, once guard_amx has replaced it
_GUARD_LOCK = threading.Lock()


def amx_off() -> bool:
    """Whether llama.cpp's AMX kernels are kept from running (``guard_amx``): this build has them (``AMX_INT8``
    in its system info) and the CPU reports ``amx_int8``, unless ``ONDEVICE_LLAMA_AMX=1``.

    Why: their tile configuration can be compiled away (llama.cpp PR #26954, issue #20824); the first matrix
    product on AMX-repacked weights then dies in ``ldtilecfg`` (seen here: llama-cpp-python 0.3.36 built by GCC 12
    with ``-march=native`` on a Sapphire Rapids VM: every model, a segfault on the first decode).
    """
    import llama_cpp

    if os.environ.get("ONDEVICE_LLAMA_AMX") == "1":
        return False
    if b"AMX_INT8 = 1" not in llama_cpp.llama_print_system_info():
        return False
    try:
        flags = CPUINFO.read_text(errors="replace")
    except OSError:
        return True  # cannot tell: the build has AMX kernels, keep them off
    return "amx_int8" in flags


def without_extra_bufts(defaults: Callable):
    """``llama_model_default_params`` as ``defaults`` gives it, less the extra (repacked) weight buffers: llama.cpp's
    plain CPU kernels (``guard_amx``; ``scripts/batch_invariance.py`` compares the two sets)."""

    def plain():
        mp = defaults()
        mp.use_extra_bufts = False
        return mp

    return plain


def guard_amx() -> None:
    """Make llama.cpp's default model parameters skip the extra (repacked) weight buffers where ``amx_off``:
    the AMX buffer is one of them. Patched into ``llama_cpp.llama_model_default_params`` once, so models that
    ``llama_cpp.Llama`` loads (embeddings, the bench's anchors) get it as well as ours; the weights and the
    maths are the same, only the CPU kernels differ (the REPACK ones go with AMX)."""
    global _DEFAULTS
    import llama_cpp
    import llama_cpp.llama_cpp as raw

    with _GUARD_LOCK:  # two threads loading models at once (embeddings beside the server's model) patch once
        if _DEFAULTS is not None or not amx_off():
            return
        _DEFAULTS = raw.llama_model_default_params
        raw.llama_model_default_params = llama_cpp.llama_model_default_params = without_extra_bufts(_DEFAULTS)


def init_llama(debug: bool = False) -> None:
    """Initialise llama.cpp once (``guard_amx`` included); its log goes to stderr only when debugging."""
    global _LOG_CB
    import llama_cpp

    guard_amx()
    if _LOG_CB is None:
        llama_cpp.llama_backend_init()

        @llama_cpp.llama_log_callback
        def _log(level, text, user_data):  # pragma: no cover - C callback
            if debug:
                print(text.decode("utf-8", "replace"), end="", flush=True)

        _LOG_CB = _log
        llama_cpp.llama_log_set(_LOG_CB, ctypes.c_void_p(0))


# C name → (Itanium parameter encoding, argtypes (ctx / model pointers as void*), restype)
_SIGNATURES = {
    "llama_set_embeddings_layer_inp": (_CTX + "jb", [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_bool], None),
    "llama_get_embeddings_layer_inp": (_CTX + "j", [ctypes.c_void_p, ctypes.c_uint32], ctypes.POINTER(ctypes.c_float)),
    "llama_set_embeddings_nextn": (_CTX + "bb", [ctypes.c_void_p, ctypes.c_bool, ctypes.c_bool], None),
    "llama_get_embeddings_nextn": (_CTX, [ctypes.c_void_p], ctypes.POINTER(ctypes.c_float)),
    "llama_get_embeddings_nextn_ith": (_CTX + "i", [ctypes.c_void_p, ctypes.c_int32], ctypes.POINTER(ctypes.c_float)),
    "llama_set_nextn_layer_offset": (_CTX + "i", [ctypes.c_void_p, ctypes.c_int32], None),
    "llama_get_ctx_other": (_CTX, [ctypes.c_void_p], ctypes.c_void_p),
    "llama_model_target_layer_ids": (_MODEL, [ctypes.c_void_p], ctypes.POINTER(ctypes.c_int32)),
    "llama_model_target_layer_ids_n": (_MODEL, [ctypes.c_void_p], ctypes.c_uint32),
    "llama_model_get_tok_embd": (_MODEL + "Pf", [ctypes.c_void_p, ctypes.POINTER(ctypes.c_float)], ctypes.c_uint32),
}


# llama_context address → layer ids recording is on for (llama.cpp aborts when asked for one that is not)
_RECORDING: dict[int, set[int]] = {}


def mangled(name: str) -> str:
    """The Itanium-ABI symbol of one of ``_SIGNATURES`` (e.g. ``_Z26llama_get_embeddings_nextnP13llama_context``)."""
    return f"_Z{len(name)}{name}{_SIGNATURES[name][0]}"


@cache
def fn(name: str):
    """The bound function ``name`` of ``_SIGNATURES`` from llama-cpp-python's loaded libllama.

    Raises:
        OndeviceError: this libllama exports it under neither name (another llama-cpp-python version).
    """
    import llama_cpp

    lib = llama_cpp.llama_cpp._lib
    _, argtypes, restype = _SIGNATURES[name]
    for symbol in (name, mangled(name)):
        try:
            f = getattr(lib, symbol)
        except AttributeError:
            continue
        f.argtypes, f.restype = argtypes, restype
        return f
    raise OndeviceError(f"libllama of llama-cpp-python {getattr(llama_cpp, '__version__', '?')} does not export {name}; "
                        "EAGLE-3 drafting needs llama-cpp-python 0.3.36's llama.cpp (pip install 'llama-cpp-python==0.3.36')")


def _ptr(handle) -> int:
    """A llama_context / llama_model handle (ctypes pointer or int) as an int address."""
    if isinstance(handle, int):
        return handle
    return ctypes.cast(handle, ctypes.c_void_p).value or 0


def model_arch(model) -> str:
    """``general.architecture`` of a loaded llama_model."""
    import llama_cpp

    buf = ctypes.create_string_buffer(64)
    n = llama_cpp.llama_model_meta_val_str(model, b"general.architecture", buf, len(buf))
    return buf.value.decode() if n > 0 else "?"


def target_layer_ids(draft_model) -> list[int]:
    """The target layer ids a loaded EAGLE-3 / DFlash draft model reads (its ``*.target_layers``)."""
    n = int(fn("llama_model_target_layer_ids_n")(_ptr(draft_model)))
    p = fn("llama_model_target_layer_ids")(_ptr(draft_model))
    return [int(p[i]) for i in range(n)] if n and p else []


def check_layer_inputs(model, ids: list[int], name: str = "target") -> None:
    """Refuse, in one line, recording layer inputs ``ids`` on a model whose graph would abort the process."""
    import llama_cpp

    arch = model_arch(model)
    if arch not in LAYER_INP_ARCHS:
        raise OndeviceError(f"{name}: architecture {arch!r} does not expose its layer inputs in this llama.cpp "
                            f"(EAGLE-3 needs them; supported: {', '.join(sorted(LAYER_INP_ARCHS))})")
    n_layer = int(llama_cpp.llama_model_n_layer(model))
    bad = [i for i in ids if not 0 <= i < n_layer]
    if bad:
        raise OndeviceError(f"{name}: has {n_layer} layers; layer {bad[0]} asked for (a draft made for another target)")


def record_layer_inputs(ctx, model, ids: list[int], on: bool = True, name: str = "target") -> None:
    """Make the context's later decodes keep (``on``) or drop the inputs of layers ``ids`` for every token.

    Raises:
        OndeviceError: the architecture does not record them (``check_layer_inputs``), or a bad layer id.
    """
    check_layer_inputs(model, ids, name)
    f = fn("llama_set_embeddings_layer_inp")
    on_now = _RECORDING.setdefault(_ptr(ctx), set())
    for i in sorted(set(ids)):
        f(_ptr(ctx), int(i), bool(on))
        (on_now.add if on else on_now.discard)(int(i))


def forget(ctx) -> None:
    """Drop what ``record_layer_inputs`` remembers of a context about to be freed (its address may be reused)."""
    _RECORDING.pop(_ptr(ctx), None)


def layer_inputs(ctx, ids: list[int], n_tokens: int, n_embd: int) -> np.ndarray:
    """[n_tokens, len(ids) × n_embd] float32: the recorded inputs of layers ``ids`` (concatenated in that order,
    as EAGLE-3's ``fc`` reads them) of the tokens of the last ``llama_decode`` (at most n_batch of them: a decode
    split into several calls keeps only the last call's rows).

    Only after a decode with recording on: llama.cpp aborts the process when asked before its buffer exists.
    Layers not switched on by ``record_layer_inputs`` are refused here for the same reason.
    """
    missing = sorted(set(ids) - _RECORDING.get(_ptr(ctx), set()))
    if missing:
        raise OndeviceError(f"layer {missing[0]}'s input is not recorded on this context (record_layer_inputs first)")
    f = fn("llama_get_embeddings_layer_inp")
    out = np.empty((n_tokens, len(ids) * n_embd), dtype=np.float32)
    for k, i in enumerate(ids):
        p = f(_ptr(ctx), int(i))
        if not p:
            raise OndeviceError(f"layer {i}'s input was not recorded by the last decode (record_layer_inputs first)")
        out[:, k * n_embd:(k + 1) * n_embd] = np.ctypeslib.as_array(p, shape=(n_tokens, n_embd))
    return out


class EvalTap:
    """Layer inputs read through llama.cpp's public scheduler callback (``cb_eval``), for targets whose graph
    does not record them (qwen2 / Qwen2.5 in this llama.cpp): the input of layer il is the tensor the graph
    names ``l_out-{il - 1}`` (the previous layer's output), copied out as it is computed.

    llama.cpp asks the callback about every node of every graph (hundreds per decode, from the thread that calls
    ``llama_decode``) and splits the computation at each tensor taken; a context created without it pays
    nothing, so ``LlamaBackend`` installs one only when layer inputs are asked for. Rows accumulate across the
    ubatches of a decode (and across decodes) in order until ``read`` or ``clear``.

    Usage: ``cp.cb_eval = tap.callback`` (and ``cp.cb_eval_user_data = None``) on the llama_context_params the
    target's context is created with; after each ``llama_decode``, ``tap.read()``. The callback cannot be
    changed after the context is created, but the layers it takes can (``set_ids``; none: an idle tap).

    Args:
        ids: target layer ids, 1 ≤ id < n_layer (layer 0's input, the embedding, has no named tensor to take).
        n_embd, n_layer: the target's hidden size and layer count.
    """

    def __init__(self, ids: list[int], n_embd: int, n_layer: int) -> None:
        import llama_cpp

        self.n_embd, self.n_layer = int(n_embd), int(n_layer)
        lib = llama_cpp.llama_cpp._lib  # libllama's handle also finds the ggml symbols it links
        get_name = ctypes.CFUNCTYPE(ctypes.c_char_p, ctypes.c_void_p)(("ggml_get_name", lib))
        nbytes = ctypes.CFUNCTYPE(ctypes.c_size_t, ctypes.c_void_p)(("ggml_nbytes", lib))
        get = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t)(
            ("ggml_backend_tensor_get", lib))
        self._want: dict[bytes, int] = {}  # tensor name → layer id; changed in place (the callback reads it)
        self._error: BaseException | None = None  # what went wrong inside the callback, raised by ``read``
        self._rows: dict[int, list[np.ndarray]] = {}
        self.ids: list[int] = []
        self.set_ids(ids)
        want, rows = self._want, self._rows

        def cb(t, ask, _user):  # pragma: no cover - called from C
            il = want.get(get_name(t))
            if ask or il is None:
                return il is not None if ask else True
            # False (or an exception, which ctypes turns into False) would make llama.cpp skip the rest of the
            # graph: whatever goes wrong is kept for ``read`` and the pass goes on
            try:
                nb = nbytes(t)
                if ctypes.c_int.from_address(t).value != 0 or nb % (4 * self.n_embd):  # type GGML_TYPE_F32 (0)
                    raise OndeviceError(f"cb_eval: tensor l_out-{il - 1} is not float32 rows of width {self.n_embd}")
                buf = np.empty(nb // 4, np.float32)
                get(t, buf.ctypes.data, 0, nb)
                rows[il].append(buf.reshape(-1, self.n_embd))
            except BaseException as e:  # KeyboardInterrupt too: raised again by ``read``
                self._error = self._error or e
            return True

        self.callback = llama_cpp.ggml_backend_sched_eval_callback(cb)

    def set_ids(self, ids: list[int]) -> None:
        """Take the inputs of layers ``ids`` from the next decode on (rows kept so far are dropped)."""
        ids = [int(i) for i in ids]
        if any(i < 1 for i in ids):
            raise OndeviceError(f"layer ids {ids}: layer 0's input cannot be read through cb_eval (ids ≥ 1 only)")
        if any(i >= self.n_layer for i in ids):
            raise OndeviceError(f"layer ids {ids}: the target has {self.n_layer} layers (a draft made for another "
                                "target)")
        self.ids = ids
        self._want.clear()
        self._want.update({f"l_out-{i - 1}".encode(): i for i in set(ids)})
        self._rows.clear()
        self._rows.update({i: [] for i in set(ids)})

    def clear(self) -> None:
        for rows in self._rows.values():
            rows.clear()

    def read(self, n_tokens: int | None = None) -> np.ndarray:
        """[n, len(ids) × n_embd]: the inputs of ``ids`` for the tokens decoded since the last read (or ``clear``),
        in decode order, then forgets them. ``n_tokens``: only the last n_tokens rows (the last decode's, when
        decodes nobody read came before it); an ``OndeviceError`` when fewer were seen."""
        err, self._error = self._error, None
        if err is not None:
            self.clear()
            raise err
        if not self.ids:
            raise OndeviceError("this cb_eval tap takes no layers (set_ids first)")
        parts = []
        for i in self.ids:
            if not self._rows[i]:
                raise OndeviceError(f"layer {i}'s input was not seen by cb_eval (no decode since the last read, or "
                                    "this architecture does not name its layer outputs l_out)")
            parts.append(np.concatenate(self._rows[i]) if len(self._rows[i]) > 1 else self._rows[i][0])
        self.clear()
        out = np.concatenate(parts, axis=1)
        if n_tokens is None:
            return out
        if out.shape[0] < n_tokens:
            raise OndeviceError(f"cb_eval saw {out.shape[0]} rows of layer inputs for a decode of {n_tokens} tokens")
        return out[out.shape[0] - n_tokens:]


class LlamaHandles:
    """Owner of a llama.cpp batch, context and model (``_batch``, ``_ctx``, ``_model`` on ``_lib``).

    ``close`` frees each it holds once, batch first, model last; ``_BATCH_FREE`` names the batch's free
    function (``llama_batch_ext_free`` for ``llama_batch_ext_init``, ``llama_batch_free`` for ``llama_batch_init``).
    A subclass that owns more frees that first, then calls ``LlamaHandles.close(self)``.
    """

    _BATCH_FREE = "llama_batch_ext_free"
    _lib = None
    _model = _ctx = _batch = None

    def close(self) -> None:
        lib = self._lib
        if self._batch is not None:
            getattr(lib, self._BATCH_FREE)(self._batch)
            self._batch = None
        if self._ctx:
            lib.llama_free(self._ctx)
            self._ctx = None
        if self._model:
            lib.llama_model_free(self._model)
            self._model = None

    def _or_close(self, fn: Callable, *args):
        """``fn(*args)``; on any exception (KeyboardInterrupt too) close what this holds, then raise it again."""
        try:
            return fn(*args)
        except BaseException:
            self.close()
            raise

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:
            pass
