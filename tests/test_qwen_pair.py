"""The real Qwen2.5-Coder pair (1.6 GB, marked slow): K-quant batch variance and greedy divergences."""

from __future__ import annotations

import numpy as np
import pytest

import ondevice
from ondevice.backends.llama import LlamaBackend
from ondevice.bench.ties import explain
from ondevice.store import fetch

pytestmark = pytest.mark.slow

PROMPT = "<|im_start|>user\nWrite a Python function `is_prime(n)` with a docstring.<|im_end|>\n<|im_start|>assistant\n"


def _batch_delta(path, k: int = 5) -> float:
    """max |logit(batch of k) − logit(k single decodes)| after the prompt."""
    b = LlamaBackend(path, n_ctx=1024)
    ids = b.tokenize(PROMPT + "def is_prime(n):\n    if n < 2:")
    head, tail = ids[:-k], ids[-k:]
    b.eval(head)
    batched = b.eval(tail)
    b.rollback(len(head))
    singles = np.concatenate([b.eval([t]) for t in tail])
    b.close()
    return float(np.abs(batched - singles).max())


def test_greedy_speculative_vs_plain_on_k_quants():
    target = fetch.pull("qwen2.5-coder-1.5b-instruct", quiet=True)
    draft = fetch.pull("qwen2.5-coder-0.5b-instruct", quiet=True)
    delta = _batch_delta(target)
    print(f"Qwen2.5-Coder-1.5B Q4_K_M: max |Δ| batch vs single = {delta:.3f}")
    with ondevice.load(target, drafter="none") as rt:
        ref = rt.generate(PROMPT, max_tokens=96, temperature=0)
    with ondevice.load(target, draft) as rt:
        spec = rt.generate(PROMPT, max_tokens=96, temperature=0, gamma=4)
    if delta == 0.0:
        assert spec.tokens == ref.tokens
        return
    b = LlamaBackend(target, n_ctx=1024)
    try:  # a difference must be a near tie the target's own batch rounding can flip (``ondevice.bench.ties``)
        r = explain(b, b.tokenize(PROMPT), ref.tokens, spec.tokens)
    finally:
        b.close()
    print(r)
    assert r["equal"] or (r["reproduced"] and r["explained"])
