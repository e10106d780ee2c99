"""Check a converted Core ML decoder by running its own program in the MIL interpreter.

The package's ``prefill`` and ``decode`` functions are run over one shared state (a full prefill chunk,
then single-token decodes) and their logits compared with the numpy reference decoder run on the
weights *the package holds*, decompressed (so int4 / palettized packages are held to the same bar as
fp16 ones: only the graph and its fp16 arithmetic may differ). A mistake in how the graph was emitted
— an axis, a transpose, the state write window, a dtype — fails here, on any OS.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ondevice.errors import OndeviceError, shown
from ondevice.formats.decoder import DecoderConfig, ReferenceDecoder, load_weights
from ondevice.formats.mil import MILError, MILProgram

MIN_TOP1 = 0.9  # random ids on a real model give near-ties; a broken graph scores near chance
MAX_REL_ERR = 0.05  # max |logit error| / max |logit|: fp16 rounding is ~1e-2 on the tiny and real models


def weight_const_name(name: str) -> str:
    """The MIL const name the builder gives an HF weight (compression keeps it as its ops' prefix)."""
    return "w_" + name.replace(".", "_")


def weight_names(cfg: DecoderConfig) -> list[str]:
    """The HF weight names ``forward`` reads (lm_head only when untied)."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        names += [f"{p}self_attn.{n}_proj.weight" for n in "qkvo"]
        names += [f"{p}mlp.{n}_proj.weight" for n in ("gate", "up", "down")]
        if cfg.qkv_bias:
            names += [f"{p}self_attn.{n}_proj.bias" for n in "qkv"]
    if not cfg.tie_embeddings:
        names.append("lm_head.weight")
    return names


def package_weights(program: MILProgram, function: str, cfg: DecoderConfig) -> dict[str, np.ndarray]:
    """The weights ``function`` computes with, decompressed, as float32 by HF name (read-only: shared
    with the interpreter)."""
    consts = program.constants(function, wide=True)  # the interpreter's own float32 copies: no third copy
    out = {}
    for name in weight_names(cfg):
        c = weight_const_name(name)
        hits = [v for k, v in consts.items() if k == c or k.startswith(c + "_")]
        if len(hits) != 1:
            raise MILError(f"{program.package}:{function}: weight {name} found {len(hits)} times (as {c}*)")
        out[name] = hits[0].astype(np.float32, copy=False)
    return load_weights(out.items())


def read_config(directory: Path) -> DecoderConfig:
    f = Path(directory) / "config.json"
    try:
        return DecoderConfig.from_hf(json.loads(f.read_text(encoding="utf-8")), f)
    except (OSError, ValueError) as e:
        raise OndeviceError(f"{shown(f)}: missing or unreadable; reconvert with `ondevice convert MODEL --to coreml`") from e


def check_package(package: str | Path, cfg: DecoderConfig, *, context: int, chunk: int, n_decode: int = 10,
                  program: MILProgram | None = None) -> dict:
    """Run ``prefill`` (one full chunk at 0) then ``n_decode`` decodes; compare with the reference.

    Args:
        package: the model.mlpackage.
        cfg: the decoder it was built from.
        context, chunk: the cache slots and prefill width it was built with.
        n_decode: single-token calls after the prefill (fewer if the context is full; with no room at
            all, 10 decodes from position 0 on a fresh state instead).
        program: an already loaded program (else loaded here).
    Returns:
        A report: {"check", "tokens", "top1", "max_rel_err", "decompressed_ops_checked"}.
    Raises:
        MILError: when the interpreted program disagrees with the reference (or cannot be run).
    """
    program = program or MILProgram(package)
    checked = program.check_decompression()
    weights = package_weights(program, "decode", cfg)
    n_decode = max(0, min(n_decode, context - chunk))
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, chunk + n_decode).astype(np.int32)
    state = program.new_state()
    rows = []
    if chunk > 1:
        rows.append(program.run("prefill", {"input_ids": ids[None, :chunk], "position": np.array([0], np.int32)},
                                state)["logits"][0])
    for pos in range(chunk if chunk > 1 else 0, len(ids)):
        rows.append(program.run("decode", {"input_ids": ids[None, pos : pos + 1], "position": np.array([pos], np.int32)},
                                state)["logits"][0])
    ref = ReferenceDecoder(cfg, weights, context).run(ids, 0)
    if n_decode == 0:  # a prefill as wide as the context leaves no room for decodes after it: decode from 0 too
        n = min(10, context)
        state = program.new_state()
        rows += [program.run("decode", {"input_ids": ids[None, pos : pos + 1], "position": np.array([pos], np.int32)},
                             state)["logits"][0] for pos in range(n)]
        ref = np.concatenate([ref, ref[:n]])
    got = np.concatenate(rows).astype(np.float32)
    top1 = float((got.argmax(-1) == ref.argmax(-1)).mean())
    err = float(np.abs(got - ref).max() / max(float(np.abs(ref).max()), 1e-6)) if np.isfinite(got).all() else float("inf")
    report = {"check": "mil-interpreter vs numpy reference on the package's decompressed weights",
              "tokens": len(got), "prefill_tokens": chunk if chunk > 1 else 0, "top1": round(top1, 4),
              "max_rel_err": round(err, 5), "decompressed_ops_checked": checked}
    if top1 < MIN_TOP1 or err > MAX_REL_ERR:
        raise MILError(f"{program.package}: the saved program disagrees with the reference decoder (top-1 {top1:.3f} < "
                       f"{MIN_TOP1} or relative error {err:.3g} > {MAX_REL_ERR}); the graph builder is wrong, do not ship it")
    return report
