"""KV-cache element types (f16 | q8_0 | q4_0): the type reaches llama.cpp, and speculation stays exact on the
cache it runs on (greedy n-gram speculation equals greedy plain decoding; a rollback replays bit for bit)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import PROMPT

from ondevice.backends.llama import LlamaBackend
from ondevice.drafters import NgramDrafter
from ondevice.errors import OndeviceError
from ondevice.runtime import Runtime

TYPES = [("f16", "f16"), ("q8_0", "q8_0"), ("q4_0", "q4_0"), ("q8_0", "f16"), ("f16", "q4_0")]
# Repeats give the n-gram drafter something to copy, so drafts are made, accepted and rejected.
TEXT = PROMPT + " and the target verify again. " + PROMPT + " then the draft"


class _Oracle(NgramDrafter):
    """Guesses the reference answer with a wrong token planted in every other guess: long accepted runs and
    rejections on every cache type (a random tiny model gives the n-gram drafter few accepted tokens)."""

    def __init__(self, n_prompt: int, ref: list[int], vocab: int) -> None:
        super().__init__()
        self.n_prompt, self.ref, self.vocab, self.calls = n_prompt, ref, vocab, 0

    def propose(self, context, gamma, params, rng, keep_drafting=None, constraint=None):
        pos = len(context) - self.n_prompt
        guess = list(self.ref[pos : pos + gamma])
        self.calls += 1
        if guess and self.calls % 2 == 0:
            i = len(guess) // 2
            guess[i] = (guess[i] + 1) % self.vocab
        return guess, None


def _logits(path, k, v):
    b = LlamaBackend(path, n_ctx=256, threads=1, cache_type_k=k, cache_type_v=v)
    try:
        return b.eval(b.tokenize(TEXT), logits="all")
    finally:
        b.close()


def test_unknown_cache_type_is_one_line_error(tiny_gguf):
    with pytest.raises(OndeviceError, match=r"cache_type_v='q5_9': choose a KV-cache type among f16, q8_0, q4_0"):
        LlamaBackend(tiny_gguf("llama"), n_ctx=64, cache_type_v="q5_9")
    with pytest.raises(OndeviceError, match="cache_type_k=8"):
        LlamaBackend(tiny_gguf("llama"), n_ctx=64, cache_type_k=8)


def test_cache_type_reaches_llama_cpp(tiny_gguf):
    """Each quantized cache changes the logits (the option is not silently dropped); f16 is the default."""
    path = tiny_gguf("llama")
    base = _logits(path, "f16", "f16")
    b = LlamaBackend(path, n_ctx=64, threads=1)
    try:
        assert (b.cache_type_k, b.cache_type_v) == ("f16", "f16")
        assert np.array_equal(b.eval(b.tokenize(TEXT)[:40]), base[:40])
    finally:
        b.close()
    for k, v in [("q8_0", "f16"), ("f16", "q8_0"), ("q4_0", "q4_0")]:
        assert not np.array_equal(_logits(path, k, v), base), (k, v)


@pytest.mark.parametrize("k,v", TYPES)
def test_rollback_replays_exactly(tiny_gguf, k, v):
    b = LlamaBackend(tiny_gguf("qwen2"), n_ctx=256, threads=1, cache_type_k=k, cache_type_v=v)
    try:
        ids = b.tokenize(TEXT)
        b.eval(ids[:10])
        first = b.eval(ids[10:16])
        b.rollback(12)
        again = b.eval(ids[12:16])
        assert np.array_equal(first[2:], again)
        b.rollback(0)
        assert np.array_equal(b.eval(ids[:16])[10:], first)
    finally:
        b.close()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("k,v", TYPES)
def test_greedy_ngram_speculation_equals_plain(tiny_gguf, arch, k, v):
    target = LlamaBackend(tiny_gguf(arch), n_ctx=512, threads=1, cache_type_k=k, cache_type_v=v)
    with Runtime(target, NgramDrafter(), vocab_limit=target.vocab_size) as rt:
        plain = rt.generate(TEXT, max_tokens=48, temperature=0, gamma=0)
        spec = rt.generate(TEXT, max_tokens=48, temperature=0, gamma=4)
        assert spec.tokens == plain.tokens
        assert spec.stats.drafted > 0
        rt.drafter = _Oracle(len(rt.tokenize(TEXT)), plain.tokens, target.vocab_size)
        spec = rt.generate(TEXT, max_tokens=48, temperature=0, gamma=4)
    assert spec.tokens == plain.tokens
    assert 0 < spec.stats.accepted < spec.stats.drafted  # both branches of the verify rule, on this cache
