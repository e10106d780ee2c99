"""Verify a conversion in the runtime that will run it: load, tokenize a probe, teacher-force it.

Every ``ondevice convert`` ends here, before its output directory is renamed into place:

1. the output is loaded by its own backend (llama.cpp for GGUF, mlx-lm for MLX);
2. a multilingual probe (accents, CJK, emoji, digits, code, leading spaces, newlines) is tokenized by
   the output and by the source tokenizer (the HF ``tokenizer.json``, or llama.cpp for a GGUF source):
   the ids, and whether a BOS is added, must be identical;
3. the probe ids are teacher-forced through the output and through the source model's own forward pass
   (mlx-lm in float32 on the HF weights, or llama.cpp on a GGUF source): top-1 agreement and
   max |Δlogit| / max |logit| must meet the thresholds of the output's precision.

A failure raises ``OndeviceError`` (one line), so nothing is left behind. ``compare`` and
``check`` are the hooks other converters (Core ML) can call with their own logits.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from ondevice.errors import OndeviceError

PROBE = (
    "Hello, world! Héllo wörld: café, naïve façade, Ærøskøbing, straße. 東京は晴れ。中文测试，谢谢！ "
    "😀🚀👍🏽 0123456789 3.14159 1,000,000 2024-05-17\n"
    "def add(a, b):\n    return a + b  # sum\n\n"
    "   three leading spaces\n\tTab\r\nCRLF  two  spaces {x: [1, 2]} != <tag/> it's we'll"
)
MAX_TOKENS = 96

# precision of the output → (min top-1 agreement, max relative logit error) against the source's forward.
THRESHOLDS: dict[str, tuple[float, float]] = {
    "float": (0.98, 0.02),  # f16 weights (GGUF f16, MLX float16)
    "8bit": (0.95, 0.08),
    "4bit": (0.80, 0.35),
    "lossless": (0.90, 0.15),  # GGUF blocks re-laid as MLX arrays: same weights, other kernels
}


def precision(fmt: str, quant: str, bits: int | None = None) -> str:
    """The THRESHOLDS key for an output format and quantization."""
    if fmt == "gguf":
        return {"f16": "float", "q8_0": "8bit"}.get(quant, "4bit")
    if quant == "from-gguf":
        return "lossless"
    return {16: "float", 8: "8bit"}.get(bits or 4, "4bit")


def compare(out: np.ndarray, ref: np.ndarray) -> dict:
    """Top-1 agreement and max |out − ref| / max |ref| of two [n, vocab] logit arrays (shared vocab prefix)."""
    v = min(out.shape[1], ref.shape[1])
    out, ref = np.asarray(out[:, :v], np.float64), np.asarray(ref[:, :v], np.float64)
    top1 = float((out.argmax(1) == ref.argmax(1)).mean())
    rel = float(np.abs(out - ref).max() / max(np.abs(ref).max(), 1e-9))
    return {"positions": int(out.shape[0]), "top1_agreement": round(top1, 4), "max_rel_error": round(rel, 5)}


def check(result: dict, level: str, where: Path | str) -> dict:
    """Add thresholds and ``passed`` to a ``compare`` result; raise a one-line error when it fails."""
    min_top1, max_rel = THRESHOLDS[level]
    result.update(precision=level, min_top1=min_top1, max_rel_error_allowed=max_rel)
    result["passed"] = result["top1_agreement"] >= min_top1 and result["max_rel_error"] <= max_rel
    if not result["passed"]:
        raise OndeviceError(
            f"{where}: verification failed: the converted model disagrees with its source on a probe "
            f"(top-1 agreement {result['top1_agreement']:.3f}, need ≥ {min_top1}; max relative logit error "
            f"{result['max_rel_error']:.4f}, need ≤ {max_rel}); the converter wrote a wrong model, nothing was kept"
        )
    return result


# -- the source side --------------------------------------------------------------------------------
def hf_probe_ids(src: Path, add_bos: bool, bos_id: int | None) -> list[int]:
    """The HF tokenizer's ids for the probe (its ``tokenizer.json``), with BOS when the tokenizer adds one."""
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(src / "tokenizer.json")).encode(PROBE, add_special_tokens=False).ids
    return ([bos_id] if add_bos and bos_id is not None else []) + ids


def hf_reference_logits(src: Path, ids: list[int]) -> np.ndarray:
    """The source model's own forward pass: mlx-lm in float32 on the HF checkpoint's weights."""
    import mlx.core as mx
    from mlx.utils import tree_map
    from mlx_lm.utils import load

    model, _ = load(str(src))
    model.update(tree_map(lambda x: x.astype(mx.float32), model.parameters()))
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
        raise OndeviceError(f"{where}: verification failed: the written {what} does not load ({e})") from e


def verify_output(fmt: str, path: Path, *, where: Path, source_ids: list[int], source_bos: bool, reference,
                  reference_name: str, level: str, what: str) -> dict:
    """Load ``path`` in its runtime, compare its tokenization and its logits with the source's.

    Args:
        fmt: "gguf" (``path`` is the .gguf file) or "mlx" (``path`` is the directory).
        where: the output directory the user asked for (for error messages).
        source_ids: the source tokenizer's probe ids, BOS included when it adds one.
        source_bos: whether the source tokenizer adds BOS.
        reference: ``ids → [n, vocab]`` logits of the source model's own forward pass.
        reference_name: what ``reference`` runs, for the record.
        level: THRESHOLDS key.
        what: words for error messages (e.g. "GGUF (tokenizer gpt2/smollm, arch llama)").
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
                f"{where}: verification failed: the written {what} tokenizes the probe differently from the source "
                f"(first difference at token {first}: {got_body[first:first + 3]} vs {body[first:first + 3]}; "
                f"adds BOS {got_bos} vs {source_bos}); nothing was kept"
            )
        ids = source_ids[:MAX_TOKENS]
        out = backend.eval(ids)
    finally:
        backend.close()
    result = check(compare(out, reference(ids)), level, where)
    result.update(tokenizer_match=True, probe_tokens=len(body), add_bos=source_bos, reference=reference_name,
                  runtime="llama.cpp" if fmt == "gguf" else "mlx-lm", seconds=round(time.perf_counter() - t0, 3))
    return result


def record(directory: Path, result: dict) -> None:
    """Add the verification record to ``directory/manifest.json``."""
    from converters.output import write_manifest

    path = directory / "manifest.json"
    manifest = json.loads(path.read_text()) if path.is_file() else {}
    manifest["verify"] = result
    write_manifest(directory, manifest)
