"""The pieces every conversion check is built from: the probe text, comparing logits and gating them
(THRESHOLDS), the source's reference forward (mlx-lm / numpy for HF, llama.cpp for GGUF), and teacher-forcing
the probe through the written output in its own runtime (``verify_output``). ``converters.verify`` puts them
together for each conversion; ``converters.check`` streams the numpy passes layer by layer.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from ondevice.errors import OndeviceError, shown

PROBE = (
    "Hello, world! Héllo wörld: café, naïve façade, Ærøskøbing, straße. 東京は晴れ。中文测试，谢谢！ "
    "😀🚀👍🏽 0123456789 3.14159 1,000,000 2024-05-17\n"
    "def add(a, b):\n    return a + b  # sum\n\n"
    "   three leading spaces\n\tTab\r\nCRLF  two  spaces {x: [1, 2]} != <tag/> it's we'll"
)
MAX_TOKENS = 128  # teacher-forced positions (the tokenizer check covers the whole probe)
TIE_MARGIN = 0.01  # reference top-1 leads by less than this × max |logit|: a tie, not counted for top-1
MAX_TOKENS_MLX_QUANTIZED = 64  # MLX's CPU quantized matmul costs ~0.1 s per position even on a tiny model

# precision of the output → (min top-1 agreement, max relative logit error) against the source's forward.
THRESHOLDS: dict[str, tuple[float, float]] = {
    "float": (0.98, 0.02),  # f16 weights (GGUF f16, MLX float16)
    # GGUF blocks re-laid as MLX arrays: the same weights, but llama.cpp rounds activations to 8 bits for
    # quantized matmuls and MLX does not; random tiny models amplify that (real SmolLM2 Q4_1: top-1 ≈ 0.95)
    "lossless": (0.80, 0.20),
    # a quantized output against mlx-lm float32 on its own (dequantized) weights; llama.cpp also rounds
    # activations to 8 bits for quantized matmuls, MLX does not
    "written-gguf": (0.85, 0.15),
    "written-mlx": (0.90, 0.08),
}


def precision(fmt: str, quant: str, bits: int | None = None) -> str:
    """"float", "lossless" or "quantized" for an output format and quantization."""
    if fmt == "gguf":
        return "float" if quant == "f16" else "quantized"
    if quant == "from-gguf":
        return "lossless"
    return "float" if bits == 16 else "quantized"


def compare(out: np.ndarray, ref: np.ndarray) -> dict:
    """Top-1 agreement and max |out − ref| / max |ref| of two [n, vocab] logit arrays (shared vocab prefix).

    ``top1_agreement`` counts the positions where the reference's top-1 leads its runner-up by more
    than ``TIE_MARGIN`` of max |ref| (a near-tie can flip under any rounding, and random tiny models
    have many); ``top1_agreement_all`` counts every position.
    """
    v = min(out.shape[1], ref.shape[1])
    out, ref = np.asarray(out[:, :v], np.float64), np.asarray(ref[:, :v], np.float64)
    scale = max(np.abs(ref).max(), 1e-9)
    same = out.argmax(1) == ref.argmax(1)
    top2 = np.sort(ref, axis=1)[:, -2:]
    decisive = (top2[:, 1] - top2[:, 0]) > TIE_MARGIN * scale
    return {"positions": int(out.shape[0]), "decisive_positions": int(decisive.sum()),
            "top1_agreement": round(float(same[decisive].mean()) if decisive.any() else 1.0, 4),
            "top1_agreement_all": round(float(same.mean()), 4),
            "max_rel_error": round(float(np.abs(out - ref).max() / scale), 5)}


def check(result: dict, level: str, where: Path | str, against: str = "its source") -> dict:
    """Add the thresholds of ``level`` to a ``compare`` result; raise a one-line error when it fails them."""
    min_top1, max_rel = THRESHOLDS[level]
    result.update(min_top1=min_top1, max_rel_error_allowed=max_rel)
    if result["top1_agreement"] < min_top1 or result["max_rel_error"] > max_rel:
        raise OndeviceError(
            f"{shown(where)}: verification failed: the converted model disagrees with {against} on a probe "
            f"(top-1 agreement {result['top1_agreement']:.3f}, need ≥ {min_top1}; max relative logit error "
            f"{result['max_rel_error']:.4f}, need ≤ {max_rel}); the converter wrote a wrong model, nothing was kept"
        )
    return result


# -- the source side --------------------------------------------------------------------------------
def hf_probe_ids(src: Path, add_bos: bool, bos_id: int | None) -> list[int]:
    """The HF tokenizer's ids for the probe (``tokenizer.json``, else ``tokenizer.model``), with BOS when it adds one."""
    from tokenizers import Tokenizer

    if (src / "tokenizer.json").is_file():
        ids = Tokenizer.from_file(str(src / "tokenizer.json")).encode(PROBE, add_special_tokens=False).ids
    else:  # a SentencePiece tokenizer.model alone: sentencepiece itself is the source tokenizer
        from converters.spm import encode

        ids = encode(src / "tokenizer.model", PROBE)
    return ([bos_id] if add_bos and bos_id is not None else []) + ids


def hf_reference_logits(src: Path, ids: list[int], weights: dict[str, np.ndarray] | None = None) -> np.ndarray:
    """The source model's own forward pass: mlx-lm in float32 on the HF checkpoint's weights, or on
    ``weights`` (HF or mlx-lm names: what a conversion wrote, dequantized) in that model."""
    import mlx.core as mx
    from mlx.utils import tree_map
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(src))
    model.update(tree_map(lambda x: x.astype(mx.float32), model.parameters()))
    if weights is not None:
        # HF and mlx-lm name these architectures' parameters alike; strict: every parameter is given
        model.load_weights([(k, mx.array(v)) for k, v in weights.items()], strict=True)
    out = np.array(model(mx.array([ids]))[0].astype(mx.float32))
    del model
    mx.clear_cache()
    return out


def llama_backend(path: Path, n: int):
    """A llama.cpp backend with room for ``n`` probe tokens (one batch)."""
    from ondevice.backends.llama import LlamaBackend

    return LlamaBackend(path, n_ctx=max(64, n + 8), n_batch=max(64, n + 8))


def gguf_reference_logits(src: Path, ids: list[int]) -> np.ndarray:
    """A GGUF source's own forward pass, in llama.cpp."""
    b = llama_backend(src, len(ids))
    try:
        return b.eval(ids)
    finally:
        b.close()


# -- the output side --------------------------------------------------------------------------------
def _open_output(fmt: str, path: Path, n: int, where: Path, what: str):
    """The output in the backend the runtime would use for it; a load failure is a verification failure."""
    try:
        if fmt == "gguf":
            return llama_backend(path, n)
        from ondevice.backends.mlx import MLXBackend

        return MLXBackend(path, n_ctx=max(64, n + 8))
    except OndeviceError as e:
        reason = str(e).split(": ", 1)[-1]  # drop the temporary path it names
        runtime = "llama.cpp" if fmt == "gguf" else "mlx-lm"
        raise OndeviceError(f"{shown(where)}: verification failed: the written {what} does not load in {runtime} ({reason}); "
                            "nothing was kept") from e


def verify_output(fmt: str, path: Path, *, where: Path, source_ids: list[int], source_bos: bool, level: str,
                  reference, reference_name: str, written=None, what: str) -> dict:
    """Load ``path`` in its runtime, compare its tokenization and its logits with the source's.

    Args:
        fmt: "gguf" (``path`` is the .gguf file) or "mlx" (``path`` is the directory).
        where: the output directory the user asked for (for error messages).
        source_ids: the source tokenizer's probe ids, BOS included when it adds one.
        source_bos: whether the source tokenizer adds BOS.
        level: ``precision()``: "float" and "lossless" outputs must match ``reference`` to THRESHOLDS[level];
            "quantized" ones must match ``written`` (the source model run on the output's own weights).
        reference: ``ids → [n, vocab]`` logits of the source model's own forward pass.
        reference_name: what ``reference`` runs, for the record.
        written: for quantized outputs, ``ids → [n, vocab]`` logits of mlx-lm float32 on the written weights.
        what: words for error messages (e.g. "GGUF model (arch llama, tokenizer gpt2/smollm)").
    Returns:
        The verification record for manifest.json and --json.
    Raises:
        OndeviceError: one line, when the output does not load, tokenizes differently or computes differently.
    """
    t0 = time.perf_counter()
    body = source_ids[1:] if source_bos else source_ids
    backend = _open_output(fmt, path, len(source_ids), where, what)
    try:
        got = backend.tokenize(PROBE, add_bos=True)
        got_bos = bool(backend.add_bos)
        got_body = got[1:] if got_bos and got[:1] == [backend.bos_id] else got
        if got_body != body or got_bos != source_bos:
            first = next((i for i, (a, b) in enumerate(zip(got_body, body, strict=False)) if a != b),
                         min(len(got_body), len(body)))
            raise OndeviceError(
                f"{shown(where)}: verification failed: the written {what} tokenizes the probe differently from the source "
                f"(first difference at token {first}: {got_body[first:first + 3]} vs {body[first:first + 3]}; "
                f"adds BOS {got_bos} vs {source_bos}); nothing was kept"
            )
        ids = source_ids[:MAX_TOKENS_MLX_QUANTIZED if fmt == "mlx" and level != "float" else MAX_TOKENS]
        out = backend.eval(ids)
    finally:
        backend.close()
    record = {"runtime": "llama.cpp" if fmt == "gguf" else "mlx-lm", "precision": level,
              "tokenizer": {"match": True, "probe_tokens": len(body), "add_bos": source_bos}}
    record["source"] = {**compare(out, reference(ids)), "reference": reference_name}
    if level == "quantized":
        record["written"] = check({**compare(out, written(ids)), "reference": "mlx-lm float32 (written weights)"},
                                  f"written-{fmt}", where, "its own weights run by mlx-lm")
    else:
        check(record["source"], level, where)
    record.update(passed=True, seconds=round(time.perf_counter() - t0, 3))
    return record


def record(directory: Path, result: dict) -> None:
    """Add the verification record to ``directory/manifest.json``."""
    from converters.output import write_manifest

    path = directory / "manifest.json"
    manifest = json.loads(path.read_text()) if path.is_file() else {}
    manifest["verify"] = result
    write_manifest(directory, manifest)


# -- one conversion -------------------------------------------------------------------------------
