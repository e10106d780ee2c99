"""A MIL interpreter: run a saved Core ML ``.mlpackage``'s own program with numpy, on any OS.

The package is read back with coremltools' milproto frontend into a MIL ``Program``; a function is then
evaluated op by op in program order. Each op's value comes from coremltools' own op definition
(``Operation.value_inference``), fed the values computed so far; what coremltools does not define is
written here and kept small:

- ``read_state`` / ``coreml_update_state``: the states live in a dict the caller owns, shared by every
  function of the program (prefill and decode write one KV cache);
- ``silu`` (x · sigmoid x);
- the constexpr decompressions (``constexpr_blockwise_shift_scale``, ``constexpr_lut_to_dense``),
  vectorised and cached per distinct weight; ``check_decompression`` compares them with coremltools' own
  ``materialized_val_inference``.

Every result is stored in the dtype and checked against the shape the program declares for it (fp16
where it says fp16), so a program whose declared types disagree with what its ops compute is an error,
not a silent broadcast. ``linear`` and ``matmul`` are coremltools' definitions fed float32 copies of their
fp16 inputs (BLAS instead of numpy's slow half-precision loops: fp32 accumulation, as Core ML's GPU and
Neural Engine do), the result rounded to the declared dtype.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import os
import threading
from pathlib import Path

import numpy as np

from ondevice.errors import OndeviceError, shown

FP32_ACCUMULATE = ("linear", "matmul")


class MILError(OndeviceError):
    """The program cannot be run as declared (unknown op, a value whose shape disagrees with its type…)."""


@contextlib.contextmanager
def quiet():
    """coremltools logs 'Failed to load _MLModelProxy' off macOS and prints progress bars: keep them quiet."""
    log = logging.getLogger("coremltools")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        log.setLevel(level)


class _Held:
    """What ``Var._sym_val`` holds: coremltools reads a var's value as ``var._sym_val.val``."""

    __slots__ = ("val",)

    def __init__(self, val) -> None:
        self.val = val


def load_program(package: str | Path):
    """A saved .mlpackage → (MIL Program, default function name), via coremltools' milproto frontend."""
    package = Path(package)
    if not (package / "Manifest.json").is_file():
        raise OndeviceError(f"{shown(package)}: not a Core ML package (no Manifest.json); reconvert with `ondevice convert --to coreml`")
    try:
        with quiet():
            import coremltools as ct
            from coremltools.converters.mil.frontend.milproto.load import load as milproto_load

            model = ct.models.MLModel(str(package), skip_model_load=True)
            spec = model.get_spec()
            check_declared_sizes(spec, package)
            prog = milproto_load(model_spec=spec, specification_version=spec.specificationVersion,
                                 file_weights_dir=model.weights_dir)
    except ImportError as e:
        raise OndeviceError("running a Core ML package in the interpreter needs coremltools: pip install 'ondevice[coreml]'") from e
    except MILError:
        raise
    except Exception as e:  # protobuf / coremltools raise assorted errors for damaged packages
        raise OndeviceError(f"{shown(package)}: unreadable Core ML package ({type(e).__name__}: {e}); reconvert it") from e
    return prog, spec.description.defaultFunctionName or "main"


def check_declared_sizes(spec, package: Path, limit: int | None = None) -> None:
    """Refuse, naming the value, a program declaring a function input, op output (nested blocks too) or state
    set over ``limit`` bytes (default: this machine's memory). Read from the protobuf, before coremltools
    builds the program: its builder computes constant ops (a ``fill`` of any declared shape) while loading."""
    from coremltools.proto import MIL_pb2

    limit = limit or os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")

    def nbytes(t) -> int:  # symbolic dimensions count as 1: run() checks inputs against theirs
        t = t.stateType.wrappedType if t.WhichOneof("type") == "stateType" else t
        dims = [d.constant.size for d in t.tensorType.dimensions if d.WhichOneof("dimension") == "constant"]
        name = MIL_pb2.DataType.Name(t.tensorType.dataType)
        size = next((b for bits, b in (("64", 8), ("32", 4), ("16", 2)) if bits in name), 1)
        return int(np.prod(dims, dtype=object)) * size if t.WhichOneof("type") == "tensorType" else 0

    for fname, fn in spec.mlProgram.functions.items():
        values, blocks = list(fn.inputs), list(fn.block_specializations.values())
        while blocks:
            for op in blocks.pop().operations:
                values.extend(op.outputs)
                blocks.extend(op.blocks)
        states = sum(nbytes(v.type) for v in fn.inputs if v.type.WhichOneof("type") == "stateType")
        for what, size in [("its states declare", states), *((f"{v.name} is declared", nbytes(v.type)) for v in values)]:
            if size > limit:
                raise MILError(f"{package.name}: {fname}: {what} {size:,} bytes, more than this machine's "
                               f"{limit:,} bytes of memory; refused (a damaged or hostile package?)")


def _np_dtype(builtin) -> np.dtype:
    from coremltools.converters.mil.mil import types

    return np.dtype(types.nptype_from_builtin(builtin))


def _blocked(shape_full, shape_small):
    """Per-axis block sizes of a grouped parameter (scale, LUT) over the full tensor; a clear error if
    an axis does not divide."""
    if len(shape_full) != len(shape_small):
        raise MILError(f"grouped parameter of shape {tuple(shape_small)} does not match the rank of {tuple(shape_full)}")
    blocks = []
    for n, m in zip(shape_full, shape_small, strict=True):
        if m == 0 or n % m:
            raise MILError(f"grouped parameter of shape {tuple(shape_small)} does not tile a tensor of shape {tuple(shape_full)}")
        blocks.append(n // m)
    return blocks


def blockwise_shift_scale(data: np.ndarray, scale: np.ndarray, offset: np.ndarray | None) -> np.ndarray:
    """``(data - offset) * scale`` with ``scale`` / ``offset`` repeated over blocks along each axis."""
    blocks = _blocked(data.shape, scale.shape)
    split = [d for m, b in zip(scale.shape, blocks, strict=True) for d in (m, b)]  # [m0, b0, m1, b1, …]
    small = [d for m in scale.shape for d in (m, 1)]
    x = data.astype(scale.dtype).reshape(split)
    if offset is not None:
        x = x - offset.astype(scale.dtype).reshape(small)
    return (x * scale.reshape(small)).reshape(data.shape)


def lut_to_dense(indices: np.ndarray, lut: np.ndarray, vector_axis) -> np.ndarray:
    """iOS18 ``constexpr_lut_to_dense``: ``lut`` is [*groups, 2^nbits, vector]; each group of
    ``indices`` (blocks along every axis) looks its entries up in its own table."""
    if lut.shape[-1] != 1:
        raise MILError(f"vector palettization (LUT vector size {lut.shape[-1]}) is not supported by the interpreter")
    groups = lut.shape[:-2]
    blocks = _blocked(indices.shape, groups)
    flat = np.zeros(indices.shape, dtype=np.int64)
    stride = 1
    for axis in reversed(range(indices.ndim)):
        shape = [1] * indices.ndim
        shape[axis] = indices.shape[axis]
        flat = flat + (np.arange(indices.shape[axis]) // blocks[axis]).reshape(shape) * stride
        stride *= groups[axis]
    table = lut.reshape(-1, lut.shape[-2])
    return table[flat, indices.astype(np.int64)]


class MILProgram:
    """A saved Core ML package, runnable with numpy.

    Args:
        package: the .mlpackage directory.

    Attributes:
        functions: function name → MIL Function.
        default_function: the package's default function.
        states: state name → (shape, numpy dtype), the same for every function that declares it.
    """

    def __init__(self, package: str | Path) -> None:
        self.package = Path(package)
        self.prog, self.default_function = load_program(self.package)
        self.functions = dict(self.prog.functions)
        from coremltools.converters.mil.mil import types

        self.states: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
        self.inputs: dict[str, dict[str, tuple[tuple[int, ...], np.dtype]]] = {}
        for fname, fn in self.functions.items():
            self.inputs[fname] = {}
            for name, var in fn.inputs.items():
                spec = (tuple(int(d) for d in var.shape), _np_dtype(var.dtype))
                if types.is_state(var.sym_type):
                    if self.states.setdefault(name, spec) != spec:
                        raise MILError(f"{self.package}: state {name} is {spec} in {fname} but {self.states[name]} elsewhere")
                else:
                    self.inputs[fname][name] = spec
        for fn in self.functions.values():
            for op in fn.operations:  # numpy ≥ 2.4 refuses numpy.bool as keepdims=: hold scalar bools as bool
                if op.op_type == "const" and isinstance(op.outputs[0].val, np.bool_):
                    op.outputs[0]._sym_val.val = bool(op.outputs[0].val)
        self._weights: dict[int, np.ndarray] = {}  # id(output var) → decompressed value (fp16)
        self._wide: dict[int, np.ndarray] = {}  # id(fp16 constant) → its float32 copy (linear / matmul inputs)
        self._by_content: dict[bytes, np.ndarray] = {}  # one array per distinct weight across functions
        self._plans: dict[str, list] = {}
        self._lock = threading.Lock()

    def new_state(self) -> dict[str, np.ndarray]:
        """Fresh zero-filled states (as Core ML's ``make_state``), one dict shared by all functions."""
        return {name: np.zeros(shape, dtype) for name, (shape, dtype) in self.states.items()}

    # -- constants ---------------------------------------------------------------------------------

    def _constexpr(self, op) -> np.ndarray:
        """A constexpr op's value, decompressed once per distinct weight."""
        key = id(op.outputs[0])
        if key in self._weights:
            return self._weights[key]
        t = op.op_type
        if t == "constexpr_blockwise_shift_scale":
            args = (self._value_of(op.data), self._value_of(op.scale), None if op.offset is None else self._value_of(op.offset))
            fn = blockwise_shift_scale
        elif t == "constexpr_lut_to_dense":
            args = (self._value_of(op.indices), self._value_of(op.lut), None if op.vector_axis is None else op.vector_axis.val)
            fn = lut_to_dense
        else:
            raise MILError(f"{self.package}: op {op.name}: {t} is not supported by the interpreter")
        h = hashlib.blake2b(t.encode(), digest_size=16)
        for a in args:
            if a is not None:
                a = np.ascontiguousarray(a)
                h.update(str((a.dtype, a.shape)).encode())
                h.update(a.data)
        digest = h.digest()
        if digest not in self._by_content:
            self._by_content[digest] = fn(*args).astype(_np_dtype(op.outputs[0].dtype))
        self._weights[key] = self._by_content[digest]
        return self._weights[key]

    def _value_of(self, var):
        """A constant input's value: a const's own, or a constexpr chain's, decompressed."""
        if var.op is not None and var.op.op_type.startswith("constexpr_"):
            return self._constexpr(var.op)
        if var.val is None:
            raise MILError(f"{self.package}: {var.name} feeds a constexpr op but has no constant value")
        return var.val

    def constants(self, function: str, wide: bool = False) -> dict[str, np.ndarray]:
        """Var name → value of every constant (const, or a constexpr chain's end, decompressed) that
        ``function``'s computing ops read (a compressed weight's intermediate parts are left out).
        ``wide``: float32 values, sharing the copies the interpreter feeds its contractions."""
        out = {}
        for op in self.functions[function].operations:
            var = op.outputs[0]
            if (op.op_type == "const" or op.op_type.startswith("constexpr_")) and \
                    any(not c.op_type.startswith("constexpr_") for c in var.child_ops):
                value = np.asarray(self._value_of(var))
                out[var.name] = self._wide_copy(value) if wide and value.dtype == np.float16 else value
        return out

    def _wide_copy(self, value: np.ndarray) -> np.ndarray:
        """The float32 copy of a constant, made once per array (a weight decompressed once serves both
        functions; the program keeps ``value`` alive, so its id stays valid)."""
        if id(value) not in self._wide:
            self._wide[id(value)] = value.astype(np.float32)
        return self._wide[id(value)]

    def check_decompression(self, function: str | None = None) -> int:
        """Compare every constexpr op of ``function`` (default: all) with coremltools' own
        ``materialized_val_inference`` (fed our value of an upstream constexpr, itself compared first);
        raises MILError on a difference. Returns the ops compared."""
        with self._lock:
            return sum(self._check_op(op) for fname, fn in self.functions.items() if function in (None, fname)
                       for op in fn.operations if op.op_type.startswith("constexpr_"))

    def _check_op(self, op) -> int:
        """One constexpr op: ours == coremltools' ``materialized_val_inference``; returns 1."""
        touched = []
        try:
            for var in op.inputs.values():
                if var.op is not None and var.op.op_type.startswith("constexpr_"):
                    self._hold(var, self._constexpr(var.op), touched)
            theirs = np.asarray(op.materialized_val_inference())
        finally:
            for var, held in reversed(touched):
                var._sym_val = held
        ours = self._constexpr(op)
        if ours.shape != theirs.shape or not np.array_equal(ours, theirs.astype(ours.dtype)):
            raise MILError(f"{self.package}: {op.name} ({op.op_type}) decompresses differently from coremltools")
        return 1

    # -- running -----------------------------------------------------------------------------------

    def run(self, function: str, inputs: dict[str, np.ndarray], state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Evaluate ``function`` on ``inputs``, reading and updating ``state`` in place.

        Args:
            function: a function name of the program.
            inputs: the function's non-state inputs by name (cast to the declared dtype; shapes must match).
            state: from ``new_state()``; shared across calls and functions.
        Returns:
            output name → value (declared dtype).
        """
        if function not in self.functions:
            raise OndeviceError(f"{shown(self.package)}: no function {function!r}; it has {', '.join(self.functions)}")
        fn = self.functions[function]
        want = self.inputs[function]
        if set(inputs) != set(want):
            raise OndeviceError(f"{shown(self.package)}:{function}: inputs {sorted(inputs)} given, {sorted(want)} declared")
        if set(state) != set(self.states):
            raise OndeviceError(f"{shown(self.package)}:{function}: the state holds {len(state)} buffers, the program declares "
                                f"{len(self.states)}; make it with new_state()")
        with self._lock:
            touched = []
            try:
                for name, (shape, dtype) in want.items():
                    a = np.asarray(inputs[name])
                    if a.shape != shape:
                        raise OndeviceError(f"{shown(self.package)}:{function}: input {name} has shape {a.shape}, declared {shape}")
                    cast = a.astype(dtype)
                    if not np.array_equal(cast, a):
                        raise OndeviceError(f"{shown(self.package)}:{function}: input {name} does not fit its declared {dtype}")
                    self._hold(fn.inputs[name], cast, touched)
                for op, declared in self._plan(function):
                    self._step(op, declared, state, touched)
                return {v.name: np.array(v.val) for v in fn.outputs}
            finally:
                for var, held in reversed(touched):
                    var._sym_val = held

    def _hold(self, var, value, touched: list) -> None:
        touched.append((var, var._sym_val))  # restored after the call: the program is left as loaded
        var._sym_val = _Held(value)

    def _plan(self, function: str) -> list:
        """The function's non-const ops, each with its outputs' declared (var, shape, numpy dtype): worked
        out once, so a call pays for the ops only."""
        if function not in self._plans:
            self._plans[function] = [
                (op, [(v, tuple(d if isinstance(d, int) else None for d in v.shape), _np_dtype(v.dtype)) for v in op.outputs])
                for op in self.functions[function].operations if op.op_type != "const"
            ]
        return self._plans[function]

    def _step(self, op, declared: list, state: dict, touched: list) -> None:
        t = op.op_type
        if t.startswith("constexpr_"):
            outs = (self._constexpr(op),)
        elif t == "read_state":
            outs = (state[op.input.name],)
        elif t == "coreml_update_state":
            shape, dtype = self.states[op.state.name]
            new = np.asarray(op.value.val)
            if new.shape != shape:
                raise MILError(f"{self.package}: {op.name} writes shape {new.shape} into state {op.state.name} {shape}")
            state[op.state.name] = new.astype(dtype)
            outs = (state[op.state.name],)
        elif t == "silu":
            x = op.x.val.astype(np.float32)
            with np.errstate(over="ignore"):
                outs = (x / (1.0 + np.exp(-x)),)
        elif t in FP32_ACCUMULATE:
            outs = self._widened(op)
        else:
            try:
                outs = op.value_inference()
            except NotImplementedError as e:
                raise MILError(f"{self.package}: op {op.name}: coremltools defines no value for {t}, nor does the interpreter") from e
            except Exception as e:  # coremltools' definition rejects the values its own declared types allow
                raise MILError(f"{self.package}: op {op.name} ({t}) cannot be evaluated as declared: {type(e).__name__}: {e}") from e
        if not isinstance(outs, (tuple, list)):
            outs = (outs,)
        if len(outs) != len(declared):
            raise MILError(f"{self.package}: op {op.name} ({t}) gives {len(outs)} values for {len(declared)} outputs")
        for (var, shape, dtype), val in zip(declared, outs, strict=True):
            self._hold(var, self._declared(op, var, shape, dtype, val), touched)

    def _widened(self, op):
        """coremltools' definition of a contraction, on float32 copies of its fp16 inputs."""
        saved = {}
        for var in op.inputs.values():
            if isinstance(var, (list, tuple)) or var.val is None or np.asarray(var.val).dtype != np.float16:
                continue
            constant = var.op is not None and (var.op.op_type == "const" or var.op.op_type.startswith("constexpr_"))
            wide = self._wide_copy(var.val) if constant else var.val.astype(np.float32)
            saved[var] = var._sym_val
            var._sym_val = _Held(wide)
        try:
            return op.value_inference()
        finally:
            for var, held in saved.items():
                var._sym_val = held

    def _declared(self, op, var, shape: tuple, dtype: np.dtype, val) -> np.ndarray:
        """``val`` in the declared ``dtype``, after checking it has the declared ``shape`` (None: symbolic)."""
        a = np.asarray(val)
        if a.shape != shape and (len(a.shape) != len(shape) or
                                 any(d is not None and d != n for d, n in zip(shape, a.shape, strict=True))):
            raise MILError(f"{self.package}: op {op.name} ({op.op_type}) computes shape {a.shape} but the program declares "
                           f"{tuple(var.shape)} for {var.name}")
        if a.dtype == dtype:
            return a
        with np.errstate(over="ignore", invalid="ignore"):
            return a.astype(dtype)
