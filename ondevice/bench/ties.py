"""Is a greedy divergence between plain and speculative decoding a rounding flip of a near tie, or a bug?

A backend that is not batch-invariant computes a position's logits slightly differently when it sits in a
batch of k rows than as a single decode (llama.cpp on x86: REPACK kernels at k ≥ 4; another flash-attention
path at k ≥ 8; single decodes on ≥ 2 threads switch to a split-KV path once the cache holds ≥ 512 cells;
``scripts/batch_invariance.py``). The rejection rule
is exact for the logits it is given, so greedy speculative decoding then equals plain decoding only up to
that rounding: where the target's top two logits are closer than the rounding, a different batching may pick
the other token. ``explain`` tells the two apart at the first differing token n:

    row_1 = the target's logits at n computed plain's way (the prompt, then ref[:n] one token at a time)
    row_b = the same row computed as one batch (prompt + ref[:n])
    margin = row_1[ref[n]] − row_1[other[n]]        noise = max |row_1 − row_b|

A batching moves each logit by ≲ noise, so it can swap two tokens only if margin ≤ 2·noise: ``explained``.
On a batch-invariant backend noise is 0 and no divergence is explained; a bug that keeps a wrong token gives
a margin far above the rounding.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token of ``a`` and ``b`` (the shorter length if one is a prefix of the
    other); None when they are equal."""
    n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    if n is None and len(a) != len(b):
        n = min(len(a), len(b))
    return n


def explain(backend, prompt: Sequence[int], ref: Sequence[int], other: Sequence[int]) -> dict:
    """Compare ``other`` (e.g. a speculative run's tokens) with ``ref`` (plain greedy decoding's) at their first
    difference, on ``backend`` (a ``Backend``; its cache is overwritten: reset its runtime afterwards).

    Args:
        backend: the target both runs decoded with.
        prompt: the prompt's token ids, as both runs evaluated them.
        ref, other: the generated tokens (prompt excluded).
    Returns:
        {"equal": True} or {"equal": False, "at": n, "ref_token", "other_token", "margin", "noise",
        "reproduced" (row_1's argmax is ref[n]), "explained" (margin ≤ 2·noise)}; where one run is a prefix
        of the other (it stopped early), "explained" is False and "why" says so.
    Raises:
        ValueError: an empty ``prompt`` (no row to compute) where the runs differ.
    """
    n = first_divergence(ref, other)
    if n is None:
        return {"equal": True}
    if n >= min(len(ref), len(other)):
        return {"equal": False, "at": n, "explained": False, "why": f"one run stopped after {n} tokens"}
    if not len(prompt):
        raise ValueError("explain: an empty prompt has no logits; pass the token ids both runs evaluated (BOS included)")
    prompt, head = [int(t) for t in prompt], [int(t) for t in ref[:n]]
    backend.rollback(0)
    row = backend.eval(prompt, logits="last")[-1]
    for t in head:
        row = backend.eval([t], logits="last")[-1]
    row_1 = np.asarray(row, np.float64)
    backend.rollback(0)
    row_b = np.asarray(backend.eval(prompt + head, logits="last")[-1], np.float64)
    backend.rollback(0)
    a, b = int(ref[n]), int(other[n])
    margin = float(row_1[a] - row_1[b])
    noise = float(np.abs(row_1 - row_b).max())
    return {"equal": False, "at": n, "ref_token": a, "other_token": b, "margin": round(margin, 4),
            "noise": round(noise, 4), "reproduced": int(row_1.argmax()) == a, "explained": abs(margin) <= 2 * noise}
