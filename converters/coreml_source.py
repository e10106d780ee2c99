"""A Core ML package checked against its SOURCE: teacher-forced top-1 against llama.cpp on held-out text.

``ondevice.formats.mil_check`` proves the saved program computes what its own (decompressed) weights say;
this proves those weights still make the source's model: the package's program, run by the MIL
interpreter (``device="mil"``, any OS), and llama.cpp on the source GGUF read the same held-out text
(``converters.quantize.HELD_OUT_TEXT``, tokenized by llama.cpp) and their next-token choices are compared.
"""

from __future__ import annotations

from pathlib import Path

from converters.probe import check, compare, gguf_reference_logits, llama_backend
from converters.quality import HELD_OUT_TEXT

N_TOKENS = 96  # teacher-forced positions (the MIL interpreter runs ~1–3 tokens/s on a 135M model)


def source_agreement(directory: Path, src: Path, *, lossless: bool, n_tokens: int = N_TOKENS) -> dict:
    """Top-1 agreement and max relative logit error of the package in ``directory`` against llama.cpp on
    ``src``, on held-out text. Gated (``converters.probe.THRESHOLDS["lossless"]``) when every weight kept
    the GGUF's blocks; recorded only when some were re-quantized (that cost is the user's choice).

    Returns:
        ``converters.probe.compare``'s record ({"positions", "decisive_positions", "top1_agreement",
        "top1_agreement_all", "max_rel_error"}) with "reference", "interpreter", "gated" (and "cost", added
        by ``converters.coreml``).
    """
    from ondevice.backends.mil import MILBackend

    b = llama_backend(src, n_tokens)
    try:
        ids = b.tokenize(HELD_OUT_TEXT, add_bos=True)
    finally:
        b.close()
    mil = MILBackend(directory)
    try:
        ids = ids[: min(n_tokens, mil.n_ctx)]
        got = mil.eval(ids)
    finally:
        mil.close()
    result = {**compare(got, gguf_reference_logits(src, ids)), "reference": "llama.cpp (source GGUF), held-out text",
              "interpreter": "MIL (device=mil)", "gated": lossless}
    if lossless:
        check(result, "lossless", directory.parent / directory.name, "llama.cpp on the source GGUF")
    return result
