"""→ Core ML: a stateful, multifunction ``model.mlpackage`` for a draft-sized llama / qwen2 decoder.

The graph is emitted by running ``ondevice.formats.decoder.forward`` with ``MILOps`` (the coremltools MIL
builder; no torch), once per function: ``decode`` (1 token) and ``prefill`` (a fixed chunk of N
tokens). Both take ``input_ids`` [1, S] int32 and ``position`` [1] int32 (the cache slot of the first
token), return ``logits`` [1, S, vocab] float32, and share one fp16 KV state per layer
(``k_cache_i`` / ``v_cache_i``: [kv_heads, context, head_dim]). Weights are compressed with
coremltools' own optimizers (int4 per-block or 4-bit palettization) and deduplicated across the two
functions by ``save_multifunction``. Before it reports success, the saved package's own program is run
by the MIL interpreter (``ondevice.formats.mil_check``) against the numpy reference on the package's
decompressed weights; a disagreement fails the conversion and leaves no output.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import numpy as np

from converters.output import write_manifest
from ondevice.backends import is_gguf_file
from ondevice.errors import OndeviceError, shown
from ondevice.formats.coreml_package import describe_package  # noqa: F401  (re-exported)
from ondevice.formats.decoder import MASK_VALUE, DecoderConfig, forward, load_weights
from ondevice.formats.mil import quiet
from ondevice.formats.mil_check import check_package, weight_const_name

COMPRESSIONS = ("int4", "palettize4", "none")
COMPUTE_UNITS = ("CPU_AND_NE", "CPU_ONLY", "CPU_AND_GPU", "ALL")
BLOCK_SIZE = 32
PREFILL_CHUNK = 64
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


class MILOps:
    """MIL-builder primitives for ``forward``: fp16 throughout, the KV cache in Core ML states."""

    def __init__(self, cfg: DecoderConfig, context: int, s: int, states: dict, names: dict[int, str] | None = None,
                 blocks: dict | None = None) -> None:
        from coremltools.converters.mil import Builder as mb

        self.mb, self.cfg, self.context, self.s, self.states = mb, cfg, context, s, states
        cos, sin = cfg.rope_tables(context)
        self.cos, self.sin = cos.astype(np.float16), sin.astype(np.float16)
        self.names, self.consts, self.blocks = names or {}, {}, blocks or {}

    def _c(self, a):
        """Python / numpy constants and weights → fp16 (the graph's type). A weight becomes one const named
        after it (``weight_const_name``), so the saved program's weights can be told apart by name; a weight
        with GGUF blocks (``converters.coreml_blocks``) becomes one ``constexpr_blockwise_shift_scale``."""
        if isinstance(a, np.ndarray) and id(a) in self.names:
            if id(a) not in self.consts:
                name = self.names[id(a)]
                if name in self.blocks:
                    data, scale, offset = self.blocks[name].mil_value()
                    kw = {} if offset is None else {"offset": offset}
                    self.consts[id(a)] = self.mb.constexpr_blockwise_shift_scale(
                        data=data, scale=scale, name=weight_const_name(name), **kw)
                else:
                    self.consts[id(a)] = self.mb.const(val=np.asarray(a, dtype=np.float16), name=weight_const_name(name))
            return self.consts[id(a)]
        return np.asarray(a, dtype=np.float16) if isinstance(a, (float, int, np.ndarray)) else a

    def embed(self, table, ids):
        mb = self.mb
        return mb.gather(x=self._c(table), indices=mb.reshape(x=ids, shape=[self.s]), axis=0)  # [S, hidden]

    def positions(self, position):
        mb = self.mb
        pos = mb.add(x=np.arange(self.s, dtype=np.int32), y=position)  # [S]
        cos = mb.gather(x=mb.const(val=self.cos, name="rope_cos"), indices=pos, axis=0)
        sin = mb.gather(x=mb.const(val=self.sin, name="rope_sin"), indices=pos, axis=0)
        visible = mb.less_equal(x=np.arange(self.context, dtype=np.int32)[None, :], y=mb.reshape(x=pos, shape=[self.s, 1]))
        # not ``select(cond, 0, MASK)``: coremltools types a select of two scalars as a scalar whatever the
        # condition's shape, so the saved program would declare the [S, context] mask an fp16 scalar
        hidden = mb.cast(x=mb.logical_not(x=visible), dtype="fp16")
        mask = mb.mul(x=hidden, y=np.float16(MASK_VALUE))  # [S, context]: 0 where visible, MASK_VALUE elsewhere
        return cos, sin, mask

    def abs_max(self, x):
        return self.mb.reduce_max(x=self.mb.abs(x=x), axes=[-1], keep_dims=True)

    def maximum(self, x, c):
        return self.mb.maximum(x=x, y=self._c(c))

    def div(self, a, b):
        return self.mb.real_div(x=self._c(a), y=self._c(b))

    def mean(self, x):
        return self.mb.reduce_mean(x=x, axes=[-1], keep_dims=True)

    def rsqrt(self, x):
        return self.mb.rsqrt(x=x)

    def linear(self, x, weight, bias=None):
        kw = {} if bias is None else {"bias": self._c(bias)}
        return self.mb.linear(x=x, weight=self._c(weight), **kw)

    def split_heads(self, x, n, d):
        mb = self.mb
        return mb.transpose(x=mb.reshape(x=x, shape=[self.s, n, d]), perm=[1, 0, 2])

    def rope(self, x, cos, sin):
        mb = self.mb
        x1, x2 = mb.split(x=x, num_splits=2, axis=-1)
        rotated = mb.concat(values=[mb.mul(x=x2, y=np.float16(-1.0)), x1], axis=-1)
        return mb.add(x=mb.mul(x=x, y=cos), y=mb.mul(x=rotated, y=sin))

    def cache_write(self, layer, k, v, position):
        mb = self.mb
        hkv, d = self.cfg.n_kv_heads, self.cfg.head_dim
        zero = np.zeros(1, np.int32)
        begin = mb.concat(values=[zero, position, zero], axis=0)
        end = mb.concat(values=[np.array([hkv], np.int32), mb.add(x=position, y=np.int32(self.s)), np.array([d], np.int32)], axis=0)
        out = []
        for name, new in ((f"k_cache_{layer}", k), (f"v_cache_{layer}", v)):
            state = self.states[name]
            written = mb.slice_update(x=mb.read_state(input=state), update=new, begin=begin, end=end)
            # coremltools 9: the state update must directly follow the op producing its value
            out.append(mb.coreml_update_state(state=state, value=written))
        return out[0], out[1]

    def attention(self, q, k, v, mask, n_rep, scale):
        mb = self.mb
        h, s, d, c = self.cfg.n_heads, self.s, self.cfg.head_dim, self.context
        g = h // n_rep
        qg = mb.reshape(x=q, shape=[g, n_rep * s, d])
        scores = mb.mul(x=mb.matmul(x=qg, y=k, transpose_y=True), y=np.float16(scale))
        scores = mb.add(x=mb.reshape(x=scores, shape=[g, n_rep, s, c]), y=mask)
        probs = mb.reshape(x=mb.softmax(x=scores, axis=-1), shape=[g, n_rep * s, c])
        out = mb.reshape(x=mb.matmul(x=probs, y=v), shape=[h, s, d])
        return mb.reshape(x=mb.transpose(x=out, perm=[1, 0, 2]), shape=[s, h * d])

    def add(self, a, b):
        return self.mb.add(x=self._c(a), y=self._c(b))

    def mul(self, a, b):
        return self.mb.mul(x=self._c(a), y=self._c(b))

    def silu(self, x):
        return self.mb.silu(x=x)

    def logits(self, x, head):
        mb = self.mb
        y = mb.cast(x=mb.linear(x=x, weight=self._c(head)), dtype="fp32")
        return mb.reshape(x=y, shape=[1, self.s, self.cfg.vocab_size], name="logits")


def build_program(cfg: DecoderConfig, weights: dict[str, np.ndarray], context: int, s: int, blocks: dict | None = None):
    """A one-function MIL program ('main') for ``s`` tokens per call over a ``context``-slot cache
    (``blocks``: HF name → ``converters.coreml_blocks.Blockwise`` for weights kept as blocks)."""
    import coremltools as ct
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.mil import Function, Program, types

    specs = {"input_ids": mb.TensorSpec((1, s), dtype=types.int32), "position": mb.TensorSpec((1,), dtype=types.int32)}
    shape = (cfg.n_kv_heads, context, cfg.head_dim)
    for i in range(cfg.n_layers):
        specs[f"k_cache_{i}"] = mb.StateTensorSpec(shape, dtype=types.fp16)
        specs[f"v_cache_{i}"] = mb.StateTensorSpec(shape, dtype=types.fp16)
    with Function(specs, opset_version=ct.target.iOS18) as func:
        names = {id(a): name for name, a in weights.items() if not (name == "lm_head.weight" and cfg.tie_embeddings)}
        ops = MILOps(cfg, context, s, {k: v for k, v in func.inputs.items() if "_cache_" in k}, names, blocks)
        func.set_outputs([forward(ops, cfg, weights, func.inputs["input_ids"], func.inputs["position"])])
    prog = Program()
    prog.add_function("main", func)
    return prog


def _as_fp16(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """float16 copies, one per distinct array (a tied embedding and head stay one array)."""
    key = {name: id(a) for name, a in weights.items()}  # taken while every array is alive
    done: dict[int, np.ndarray] = {}
    out = {}
    for name in list(weights):
        a = weights.pop(name)  # the float32 array can go as soon as its copy exists
        if key[name] not in done:
            done[key[name]] = np.ascontiguousarray(a, dtype=np.float16)
        out[name] = done[key[name]]
    return out


def _compress(model, compress: str):
    """Compress the weight matrices; the RoPE tables (also big consts) stay fp16."""
    import coremltools.optimize.coreml as cto

    keep = {"rope_cos": None, "rope_sin": None}

    if compress == "int4":
        op = cto.OpLinearQuantizerConfig(mode="linear_symmetric", dtype="int4", granularity="per_block", block_size=BLOCK_SIZE)
        return cto.linear_quantize_weights(model, cto.OptimizationConfig(global_config=op, op_name_configs=keep))
    if compress == "palettize4":
        # one 16-entry LUT per tensor after per-row scaling; k-means by kmeans1d (the coreml extra)
        op = cto.OpPalettizerConfig(mode="kmeans", nbits=4, granularity="per_tensor", enable_per_channel_scale=True)
        return cto.palettize_weights(model, cto.OptimizationConfig(global_config=op, op_name_configs=keep))
    return model


def open_source(src: Path) -> tuple[DecoderConfig, dict[str, np.ndarray], str, callable]:
    """An HF checkpoint dir or a GGUF file → (config, float32 HF-named weights, sha256, tokenizer writer)."""
    if is_gguf_file(src):
        from converters.tokenizer import write_hf_tokenizer
        from ondevice.formats.gguf import GGUFFile, float_tensors
        from ondevice.store.fetch import sha256_file

        g = GGUFFile(src)
        g.require_supported()
        config = g.config()
        cfg = DecoderConfig.from_hf(config, src)

        def write_tok(out: Path) -> None:
            write_hf_tokenizer(g, out)
            (out / "config.json").write_text(json.dumps(config, indent=2))

        return cfg, load_weights(float_tensors(g)), sha256_file(src), write_tok
    from converters.hf import open_checkpoint

    ckpt = open_checkpoint(src)
    cfg = DecoderConfig.from_hf(ckpt.config, ckpt.path / "config.json")
    if not (ckpt.path / "tokenizer.json").is_file():
        raise OndeviceError(f"{shown(ckpt.path / 'tokenizer.json')}: missing; the Core ML model needs the tokenizer beside it")

    def copy_tok(out: Path) -> None:
        for name in ("config.json", *TOKENIZER_FILES):
            if (ckpt.path / name).is_file():
                shutil.copy2(ckpt.path / name, out / name)

    return cfg, load_weights(ckpt.tensors()), ckpt.source_sha256(), copy_tok


def to_coreml(src: Path, out: Path, *, context: int = 512, compress: str = "int4",
              compute_units: str = "CPU_AND_NE", progress: bool = True, keep_blocks: bool = True) -> dict:
    """Write ``out/model.mlpackage`` (functions decode + prefill), tokenizer files and manifest.json.

    From a GGUF source, ``compress="int4"`` keeps llama.cpp's Q4_0 / Q4_1 / Q8_0 blocks as Core ML blockwise
    weights and re-quantizes only the other types, naming them (``converters.coreml_blocks``);
    ``keep_blocks=False`` re-quantizes everything to symmetric int4 instead (the earlier behaviour, kept for
    measurements). A GGUF source's package is also checked against llama.cpp on held-out text
    (``converters.coreml_source``)."""
    if compress not in COMPRESSIONS:
        raise OndeviceError(f"--compress {compress}: choose one of {', '.join(COMPRESSIONS)}")
    if compute_units not in COMPUTE_UNITS:
        raise OndeviceError(f"--compute-units {compute_units}: choose one of {', '.join(COMPUTE_UNITS)}")
    if not 16 <= context <= 32768:
        raise OndeviceError(f"--context {context}: choose between 16 and 32768 tokens")
    try:
        with quiet():
            import coremltools as ct
    except ImportError as e:
        raise OndeviceError("Core ML conversion needs coremltools: pip install 'ondevice[coreml]'") from e
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    t0 = time.perf_counter()
    cfg, weights, source_sha, write_tokenizer = open_source(Path(src))
    weights = _as_fp16(weights)  # the graph's precision; halves the peak memory of the conversion
    blocks, block_report = None, None
    if compress == "int4" and keep_blocks and is_gguf_file(src):  # keep llama.cpp's blocks where Core ML can
        from converters.coreml_blocks import gguf_blockwise
        from ondevice.formats.gguf import GGUFFile

        blocks, block_report = gguf_blockwise(GGUFFile(src))
    chunk = min(PREFILL_CHUNK, context)
    if compress != "none" and cfg.hidden % BLOCK_SIZE:
        raise OndeviceError(f"{shown(src)}: hidden size {cfg.hidden} is not a multiple of {BLOCK_SIZE}; use --compress none")
    steps = [("decode", 1), ("prefill", chunk)]
    # a spinner and the elapsed time: one step (coremltools' convert) takes most of the minute
    bar = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn(), console=Console(stderr=True), disable=not progress, transient=True)
    task = bar.add_task("coreml", total=2 * len(steps) + 2)
    work = out / ".functions"
    work.mkdir()
    with bar:
        for name, s in steps:
            bar.update(task, description=f"coreml: build {name} (S={s})")
            with quiet():
                model = ct.convert(build_program(cfg, weights, context, s, blocks), convert_to="mlprogram",
                                   minimum_deployment_target=ct.target.iOS18, compute_precision=ct.precision.FLOAT16,
                                   compute_units=getattr(ct.ComputeUnit, compute_units), skip_model_load=True)
            bar.update(task, advance=1, description=f"coreml: compress {name} ({compress})")
            with quiet():
                model = _compress(model, "none" if blocks is not None else compress)
                model.save(str(work / f"{name}.mlpackage"))
            del model
            bar.update(task, advance=1)
        bar.update(task, description="coreml: merge functions")
        desc = ct.utils.MultiFunctionDescriptor()
        for name, _ in steps:
            desc.add_function(str(work / f"{name}.mlpackage"), "main", name)
        desc.default_function_name = "decode"
        with quiet():
            ct.utils.save_multifunction(desc, str(out / "model.mlpackage"))
        shutil.rmtree(work)
        n_params = sum(int(a.size) for k, a in weights.items() if not (k == "lm_head.weight" and cfg.tie_embeddings))
        del weights  # the check reads the package's own (decompressed) weights
        bar.update(task, advance=1, description="coreml: check the saved program (MIL interpreter)")
        from converters.check import timed

        with quiet():
            verified, cost = timed(lambda: check_package(out / "model.mlpackage", cfg, context=context, chunk=chunk))
        verified["cost"] = cost  # wall time, CPU time, peak private memory of the check (as GGUF / MLX)
        bar.update(task, advance=1)
    write_tokenizer(out)
    size = sum(f.stat().st_size for f in (out / "model.mlpackage").rglob("*") if f.is_file())
    meta = {"format": "coreml", "quant": compress, "arch": cfg.arch, "context": context, "prefill_chunk": chunk,
            "compute_units": compute_units, "functions": [n for n, _ in steps], "n_layers": cfg.n_layers,
            "vocab_size": cfg.vocab_size}
    if block_report is not None:  # --compress int4 from a GGUF: its own blocks, kept (converters.coreml_blocks)
        meta["weights"] = "gguf-blocks"
        meta["blocks"] = block_report
    manifest = {"source": str(Path(src).resolve()), "source_sha256": source_sha, "verified": verified, **meta}
    write_manifest(out, manifest)
    if is_gguf_file(src):  # "verified" means agreement with the source: llama.cpp on held-out text
        from converters.coreml_source import source_agreement

        with quiet():
            lossless = blocks is not None and not block_report["requantized"]
            verified["source"], cost = timed(lambda: source_agreement(out, Path(src), lossless=lossless))
        verified["source"]["cost"] = cost
        write_manifest(out, manifest)
    return {**meta, "verified": verified, "path": "model.mlpackage", "size_bytes": size, "n_params": n_params,
            "bits_per_weight": round(size * 8 / n_params, 3), "seconds": round(time.perf_counter() - t0, 3)}
