"""The real default model (SmolLM2-135M-Instruct, Q4_1): batch invariance, n-gram greedy equality, chat."""

from __future__ import annotations

import pytest

import ondevice
from ondevice.errors import OndeviceError

CODE_EDIT = (
    "Rename the variable `total` to `acc` in this function and return the code.\n\n"
    "def sum_list(xs):\n    total = 0\n    for x in xs:\n        total += x\n    return total\n"
)


def test_smollm2_is_batch_invariant(smollm2):
    from helpers import batch_invariant

    assert batch_invariant(smollm2, k=8)


@pytest.mark.parametrize("prompt", [CODE_EDIT, "The capital of France is Paris. The capital of France is"])
def test_ngram_greedy_equals_plain_on_smollm2(smollm2, prompt):
    with ondevice.load(smollm2, drafter="none") as rt:
        ref = rt.generate(prompt, max_tokens=64, temperature=0)
    with ondevice.load(smollm2, drafter="ngram") as rt:
        for gamma in (2, 5):
            res = rt.generate(prompt, max_tokens=64, temperature=0, gamma=gamma)
            assert res.tokens == ref.tokens and res.text == ref.text
            assert res.stats.drafted > 0


def test_chat_template_renders_and_generates(smollm2):
    with ondevice.load("smollm2-135m-instruct") as rt:  # the catalog name resolves to the cached file
        ids = rt.render_chat([{"role": "user", "content": "Say hi"}])
        text = "".join(rt.target.token_bytes(t).decode("utf-8", "replace") for t in ids)
        assert "user" in text and "Say hi" in text
        res = rt.chat([{"role": "user", "content": "What is 2 + 2?"}], max_tokens=24, temperature=0)
        assert res.stats.tokens > 0 and res.text.strip()


def test_sandboxed_template_cannot_reach_python(smollm2):
    from ondevice.chat import render

    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(OndeviceError, match="sandbox|template"):
        render(evil, [{"role": "user", "content": "x"}])


def _strings(n: int = 240) -> list[str]:
    """Deterministic mixed strings: prose, code, unicode, digits, whitespace runs, specials."""
    import random

    rng = random.Random(7)
    pool = ["hello", " world", "  ", "\n", "\n\n", "\t", "    ", "def", " f(x):", "return", "x**2", "123", "4567890",
            "3.14159", "café", "naïve", "東京", "日本語", "🙂", "🚀✨", "Ωμέγα", "привет", "مرحبا", "<|im_start|>",
            "<|im_end|>", "don't", "I'm", "we'll", "{\"a\": [1, 2]}", "<div class='x'>", "//", "#!", "___", "...", "!?",
            "\r\n", "   \n  ", "ABC", "camelCase", "snake_case", "x=y+z", "λ", "€100", "1e-9", "0x1F"]
    out = ["", " ", "  leading", "trailing  ", "a\u00a0b", "tabs\t\tand\tspaces  "]
    while len(out) < n:
        out.append("".join(rng.choice(pool) for _ in range(rng.randint(1, 12))))
    return out


def test_smollm2_gguf_to_mlx_tokenizes_identically_and_agrees(smollm2, tmp_path):
    """Real model: our GGUF → MLX path keeps tokenization and (teacher-forced) top-1 predictions."""
    import mlx.core as mx
    import numpy as np

    from converters import convert
    from ondevice.backends.llama import LlamaBackend
    from ondevice.backends.mlx import MLXBackend

    s = convert(smollm2, to="mlx", out=tmp_path / "smol", progress=False)
    assert s["requantized_tensors"] == 0  # Q4_1 / Q8_0: the lossless path
    v = s["verify"]  # the conversion's own check: MLX vs llama.cpp on the probe, tensors vs the GGUF's
    assert v["passed"] and v["tokenizer"]["match"] and v["source"]["top1_agreement"] >= 0.90, v
    assert v["weights"]["max_weight_rel_error"] < 0.01  # the same weights, block for block
    g = LlamaBackend(smollm2, n_ctx=1024)
    m = MLXBackend(tmp_path / "smol", n_ctx=1024, device="cpu")
    strings = _strings()
    assert len(strings) >= 200
    for text in strings:
        assert m.tokenize(text) == g.tokenize(text), repr(text)
    text = " ".join(strings)
    ids = g.tokenize(text)[:256]
    assert len(ids) == 256
    ref = g.eval(ids)
    out = np.array(m.model(mx.array([ids]))[0].astype(mx.float32))
    agree = float((out.argmax(1) == ref.argmax(1)).mean())
    print(f"SmolLM2 GGUF vs MLX teacher-forced top-1 agreement over 256 tokens: {agree:.3f}")
    assert agree >= 0.9
    g.close()
    m.close()

    # the converted model as an MLX target: greedy n-gram speculation == greedy plain, where MLX is batch-invariant
    from helpers import batch_invariant

    import ondevice

    if not batch_invariant(tmp_path / "smol", kind="mlx"):
        pytest.skip("MLX CPU logits of SmolLM2 depend on batch size here; greedy equality not asserted")
    prompt = "The capital of France is Paris. The capital of France is"
    with ondevice.load(tmp_path / "smol", drafter="none", device="cpu") as rt:
        ref = rt.generate(prompt, max_tokens=16, temperature=0)
    with ondevice.load(tmp_path / "smol", drafter="ngram", device="cpu") as rt:
        res = rt.generate(prompt, max_tokens=16, temperature=0, gamma=4)
    assert res.tokens == ref.tokens and res.stats.drafted > 0
