"""``ondevice.bench.ties``: a greedy divergence is a rounding flip of a near tie, or it is not."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

import ondevice
from ondevice.backends.llama import LlamaBackend
from ondevice.bench.ties import explain, first_divergence

V = 32


class _Noisy:
    """A toy target whose logits depend on the context, plus (in a batch of ≥ 2 rows) a batch-shape rounding of
    up to ``eps``: what a backend that is not batch-invariant does."""

    vocab_size = V

    def __init__(self, eps: float) -> None:
        self.ctx: list[int] = []
        self.eps = eps

    @property
    def n_past(self) -> int:
        return len(self.ctx)

    def rollback(self, n: int) -> None:
        del self.ctx[n:]

    def _row(self, batch: int) -> np.ndarray:
        seed = int.from_bytes(hashlib.sha256(repr(self.ctx).encode()).digest()[:8], "little")
        rng = np.random.default_rng(seed)
        row = 3.0 * rng.standard_normal(V)
        return row + (self.eps * rng.uniform(-1, 1, V) if batch > 1 else 0.0)

    def eval(self, tokens, logits="all"):
        rows = []
        for t in tokens:
            self.ctx.append(int(t))
            rows.append(self._row(len(tokens)))
        rows = np.array(rows, np.float32)
        return rows[-1:] if logits == "last" else rows


def _greedy(b, prompt, n):
    b.rollback(0)
    row, out = b.eval(prompt, logits="last")[-1], []
    for _ in range(n):
        out.append(int(row.argmax()))
        row = b.eval([out[-1]], logits="last")[-1]
    return out


def _runner_up(b, prompt, ref, at):
    """The second-best token at position ``at`` of plain decoding, and its gap to the best."""
    b.rollback(0)
    row = b.eval(list(prompt) + ref[:at], logits="last")[-1] if at else b.eval(prompt, logits="last")[-1]
    order = np.argsort(row)
    return int(order[-2]), float(row[order[-1]] - row[order[-2]])


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2
    assert first_divergence([], []) is None


def test_a_flip_within_the_rounding_is_explained_and_a_wrong_token_is_not():
    b, prompt = _Noisy(eps=0.5), [1, 2, 3]
    ref = _greedy(b, prompt, 40)
    assert explain(b, prompt, ref, list(ref)) == {"equal": True}
    gaps = []
    for at in range(1, 40):  # position 0 is the prompt batch's own row
        tok, gap = _runner_up(_Noisy(0.0), prompt, ref, at)
        gaps.append((gap, at, tok))
    gap, at, tok = min(gaps)  # the nearest tie of the run
    assert gap < 1.0, "the toy's nearest tie should be within 2·eps"
    other = ref[:at] + [tok] + ref[at + 1:]
    r = explain(b, prompt, ref, other)
    assert r["at"] == at and r["reproduced"] and r["explained"], r
    assert r["margin"] == pytest.approx(gap, abs=1e-3) and 0 < r["noise"] <= 0.5
    gap, at, tok = max(gaps)  # planted bug: a clearly worse token kept
    assert gap > 2.0
    r = explain(b, prompt, ref, ref[:at] + [tok] + ref[at + 1:])
    assert r["at"] == at and not r["explained"], r
    r = explain(b, prompt, ref, ref[:10])  # stopped early: never explained
    assert r["at"] == 10 and not r["explained"]
    with pytest.raises(ValueError, match="empty prompt"):  # no row to compare (was an IndexError)
        explain(b, [], ref, other)


def test_on_a_batch_invariant_backend_no_divergence_is_explained(tiny_gguf):
    """The tiny q8_0 model is batch-invariant (noise 0), so even its nearest tie, flipped, is a bug."""
    path = tiny_gguf("qwen2")
    with ondevice.load(path, drafter="none", threads=1) as rt:
        prompt = rt.tokenize("the quick brown fox")
        ref = rt.generate(prompt, max_tokens=24, temperature=0).tokens
    assert len(ref) >= 8
    b = LlamaBackend(path, n_ctx=256, threads=1)
    try:
        at, tok, gap = min(((i, *_runner_up(b, prompt, ref, i)) for i in range(1, len(ref))), key=lambda x: x[2])
        r = explain(b, prompt, ref, ref[:at] + [tok] + ref[at + 1:])
        assert r["reproduced"] and r["noise"] == 0.0 and not r["explained"], r
        assert r["margin"] == pytest.approx(gap, abs=1e-4)
    finally:
        b.close()
