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
    from test_engine import batch_invariant

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
