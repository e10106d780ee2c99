"""``reasoning_budget``: after N thinking tokens the end of thinking is forced, then the answer follows.

A tiny random-weight model gets a Qwen3-style template whose generation prompt opens thinking
(``<think>\\n``, as Qwen3-Thinking-2507 and R1 distills do): a random model never closes it by itself, so
without a budget it thinks until ``max_tokens``. With the budget the forced end comes after exactly N
thinking tokens and an answer follows. Checked: the split (through the real ``openai`` client against
``ondevice serve``, whole and streamed), greedy speculation (n-gram, fixed γ) == greedy plain token for token,
and the budget's state under random advance / rollback against a recomputation from scratch.
"""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
from test_reasoning_server import KEY, MSGS, QWEN3, streamed, templated

from ondevice.errors import OndeviceError

OPENED = QWEN3.replace("{{- '<|im_start|>assistant\\n' }}", "{{- '<|im_start|>assistant\\n<think>\\n' }}")
WORDS = r"/[a-z]{1,6}( [a-z]{1,6}){0,3}/"


@pytest.fixture(scope="module")
def opened(tiny_hf, tmp_path_factory):
    assert OPENED != QWEN3
    return templated(tiny_hf, tmp_path_factory, "qwen3_opened", OPENED)


@pytest.fixture(scope="module")
def rt(opened):
    from ondevice.loader import load

    with load(opened, drafter="ngram", n_ctx=1024, threads=1) as r:
        yield r


def _ids(rt):
    from ondevice.chat import render_prompt

    return render_prompt(rt, MSGS)[1]


def test_budget_cuts_thinking_then_answers(rt):
    from ondevice.reasoning import detect, split

    ids = _ids(rt)
    th = detect(rt.target.chat_template, "<|im_start|>assistant\n<think>\n")
    assert th is not None and th.opened
    free = rt.generate(ids, temperature=0, max_tokens=40, gamma=0)
    assert "</think>" not in free.text  # the model never closes thinking by itself
    r = rt.generate(ids, temperature=0, max_tokens=60, gamma=0, reasoning_budget=12)
    end = rt.target.tokenize(th.forced_end, add_bos=False, special=True)
    assert r.tokens[:12] == free.tokens[:12] and r.tokens[12:12 + len(end)] == end
    thinking, answer = split(r.text, th)
    assert thinking is not None and answer.strip()
    # with an inner grammar, the grammar holds on the answer only
    g = rt.generate(ids, temperature=0, max_tokens=60, gamma=0, reasoning_budget=5, grammar=f"start: {WORDS}")
    assert g.tokens[:5] == free.tokens[:5] and g.tokens[5:5 + len(end)] == end
    import re

    assert re.fullmatch(r"[a-z]{1,6}( [a-z]{1,6}){0,3}", split(g.text, th)[1]), g.text
    assert g.stats.stop_reason == "eos"
    z = rt.generate(ids, temperature=0, max_tokens=30, gamma=0, reasoning_budget=0)
    assert z.tokens[:len(end)] == end


@pytest.mark.parametrize("gamma", [2, 4])
@pytest.mark.parametrize("grammar", [None, f"start: {WORDS}"])
def test_speculative_equals_plain_with_budget(rt, gamma, grammar):
    ids = _ids(rt)
    kw = dict(temperature=0, max_tokens=60, reasoning_budget=12, grammar=grammar)
    plain = rt.generate(ids, gamma=0, **kw)
    spec = rt.generate(ids, gamma=gamma, **kw)
    assert spec.tokens == plain.tokens
    assert spec.stats.drafted > 0  # speculation did run through the budget


def test_budget_needs_a_thinking_template(rt):
    from ondevice.budget import ThinkingBudget
    from ondevice.params import GenerateRequest

    with pytest.raises(OndeviceError, match="reasoning_budget"):
        GenerateRequest.of(reasoning_budget=-1)
    class Plain:  # a backend whose template does not think
        chat_template, path = "{{ messages[0].content }}", "m.gguf"
        token_bytes, vocab_tokens = staticmethod(rt.target.token_bytes), staticmethod(rt.target.vocab_tokens)

    plain = Plain()
    with pytest.raises(OndeviceError, match="no thinking convention"):
        ThinkingBudget.for_prompt(plain, [1, 2], 3)


def _fresh(rt, ids, budget, inner_grammar):
    from ondevice.budget import ThinkingBudget
    from ondevice.constrain import Constraint

    inner = Constraint.build(rt.target, grammar=inner_grammar) if inner_grammar else None
    return ThinkingBudget.for_prompt(rt.target, ids, budget, inner)


@pytest.mark.parametrize("inner_grammar", [None, f"start: {WORDS}"])
def test_rollback_matches_recomputation(rt, inner_grammar):
    """Random advance / rollback / valid_prefix / mask_rows against a budget rebuilt from the same prefix."""
    ids = _ids(rt)
    b = _fresh(rt, ids, 6, inner_grammar)
    rng = random.Random(0)
    seq: list[int] = []
    for _ in range(120):
        if seq and rng.random() < 0.35:
            n = rng.randint(1, len(seq))
            b.rollback(n)
            del seq[len(seq) - n:]
        else:
            for _ in range(rng.randint(1, 4)):
                allowed = np.flatnonzero(b.allowed())
                non_eos = [int(t) for t in allowed if int(t) not in b.eos_ids]
                if not non_eos or b.is_done():
                    break
                t = rng.choice(non_eos[:50] + non_eos[-50:])
                b.advance([t])
                seq.append(t)
        ref = _fresh(rt, ids, 6, inner_grammar)
        ref.advance(seq)
        assert (b.n, b.phase, b.thinking_tokens) == (ref.n, ref.phase, ref.thinking_tokens)
        assert np.array_equal(b.allowed(), ref.allowed())
        if b.inner is not None:
            assert b.inner.n == ref.inner.n
        # valid_prefix and mask_rows leave the state as it was
        probe = [int(t) for t in np.flatnonzero(b.allowed())[:3]]
        k = b.valid_prefix(probe)
        assert 0 <= k <= len(probe) and b.n == len(seq)
        b.mask_rows(np.zeros((2, rt.target.vocab_size), dtype=np.float32), probe[:1])
        assert np.array_equal(b.allowed(), ref.allowed()) and b.n == len(seq)


def test_server_budget_whole_equals_streamed(opened):
    openai = pytest.importorskip("openai")
    from ondevice.loader import load
    from ondevice.reasoning import detect
    from ondevice.server.run import launch

    proc, url = launch(opened, "--n-ctx", "1024", "--threads", "1", api_key=KEY)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        args = dict(model=model, messages=MSGS, temperature=0, max_tokens=60,
                    extra_body={"gamma": 3, "reasoning_budget": 12})
        msg = client.chat.completions.create(**args).choices[0].message
        st = streamed(list(client.chat.completions.create(stream=True, **args)))
        think = msg.model_extra["reasoning_content"]
        assert msg.content and msg.content.strip() and think
        assert (st["reasoning_content"], st["content"]) == (think, msg.content)
        assert "</think>" not in msg.content
        with load(opened, drafter="none", n_ctx=1024, threads=1) as direct:
            r = direct.generate(_ids(direct), temperature=0, max_tokens=60, gamma=0, reasoning_budget=12)
            th = detect(direct.target.chat_template, "<think>\n")
            end = direct.target.tokenize(th.forced_end, add_bos=False, special=True)
        assert r.tokens[12:12 + len(end)] == end and "</think>" not in r.text[:r.text.index(th.forced_end)]
        from ondevice.reasoning import split

        assert split(r.text, th) == (think, msg.content)
        effort = client.chat.completions.create(**{**args, "extra_body": {"reasoning_effort": "low"}})
        assert effort.choices[0].message.model_extra.get("reasoning_content")
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(**{**args, "extra_body": {"reasoning_budget": -2}})
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(**{**args, "extra_body": {"reasoning_effort": "huge"}})
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_serve_reasoning_budget_flag_is_the_default(opened):
    """``serve --reasoning-budget 5``: a request without a budget is cut after 5 thinking tokens; its own
    ``reasoning_budget`` (here -1, llama-server's unbounded) overrides the default."""
    openai = pytest.importorskip("openai")
    from ondevice.loader import load
    from ondevice.reasoning import detect, split
    from ondevice.server.run import launch

    proc, url = launch(opened, "--n-ctx", "1024", "--threads", "1", "--reasoning-budget", "5", api_key=KEY)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        args = dict(model=model, messages=MSGS, temperature=0, max_tokens=40)
        msg = client.chat.completions.create(**args).choices[0].message
        free = client.chat.completions.create(**args, extra_body={"reasoning_budget": -1}).choices[0].message
        with load(opened, drafter="none", n_ctx=1024, threads=1) as direct:
            ids = _ids(direct)
            th = detect(direct.target.chat_template, "<think>\n")
            cut = direct.generate(ids, temperature=0, max_tokens=40, gamma=0, reasoning_budget=5)
            unbounded = direct.generate(ids, temperature=0, max_tokens=40, gamma=0)
        assert (msg.model_extra["reasoning_content"], msg.content) == split(cut.text, th)
        assert free.model_extra["reasoning_content"] == split(unbounded.text, th)[0] and not free.content
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _budget_law(path, ids, params, budget, depth, grammar):
    """Exact law of the first ``depth`` tokens (shorter where the output ends) under the budget."""
    from ondevice import sampling
    from ondevice.backends.llama import LlamaBackend
    from ondevice.budget import ThinkingBudget
    from ondevice.constrain import Constraint

    b = LlamaBackend(path, n_ctx=256, threads=1)
    c = ThinkingBudget.for_prompt(b, ids, budget, Constraint.build(b, grammar=grammar))
    b.eval(ids[:-1])
    base, law = b.n_past, {}

    def walk(prefix, mass):
        if len(prefix) == depth:
            law[prefix] = law.get(prefix, 0.0) + mass
            return
        b.rollback(base + len(prefix))
        ctx = ids + list(prefix)
        p = sampling.probs(c.mask_row(b.eval([ctx[-1]])[0]), params, ctx)
        for t in np.flatnonzero(p):
            if b.is_eog(int(t)):
                law[prefix] = law.get(prefix, 0.0) + mass * p[t]
                continue
            c.advance([int(t)])
            walk((*prefix, int(t)), mass * p[t])
            c.rollback(1)

    try:
        walk((), 1.0)
    finally:
        b.close()
    return law


def test_sampled_budget_law_is_exact(opened, tiny_gguf, monkeypatch):
    """T = 0.8: the joint law of one thinking token, the forced end and two answer tokens under a grammar,
    speculative with a draft model (q != p), against the exact law. Planted control: q reported without the
    mask fails (it matters only where a mask is partial: the answer's grammar)."""
    from helpers import chisquare
    from test_constrain import _unmasked_q_propose

    from ondevice import drafters, sampling
    from ondevice.loader import load

    temperature, top_k, n, budget, grammar = 0.8, 6, 1500, 1, 'start: /[a-z]{1,8}/ "."'
    with load(opened, str(tiny_gguf("qwen2_draft")), threads=1, n_ctx=256) as rt:
        ids = _ids(rt)
        end = rt.target.tokenize("\n</think>\n\n", add_bos=False, special=True)
        depth = budget + len(end) + 2
        params = sampling.SamplingParams(temperature=temperature, top_k=top_k, top_p=1.0, min_p=0.0)
        law = _budget_law(opened, ids, params, budget, depth, grammar)
        assert abs(sum(law.values()) - 1) < 1e-9 and len(law) > 8
        assert all(s[budget:budget + len(end)] == tuple(end) for s in law if len(s) > budget)

        def counts():
            out = {}
            for seed in range(n):
                r = rt.generate(ids, max_tokens=depth, temperature=temperature, top_k=top_k, top_p=1.0, min_p=0.0,
                                seed=seed, gamma=3, reasoning_budget=budget, grammar=grammar)
                out[tuple(r.tokens)] = out.get(tuple(r.tokens), 0) + 1
            return out

        good = counts()
        assert rt.last_stats.drafted > 0
        assert chisquare(good, law, n) > 1e-3
        monkeypatch.setattr(drafters.ModelDrafter, "propose", _unmasked_q_propose)
        assert chisquare(counts(), law, n) < 1e-4


def test_chat_cli_reasoning_budget(opened, tiny_gguf):
    """``ondevice chat --reasoning-budget N``: the answer follows the cut thinking; on a model whose template
    does not think, one line naming the option."""
    import subprocess
    import sys

    def chat(model, *args):
        return subprocess.run([sys.executable, "-P", "-m", "ondevice", "chat", str(model), "--no-spec", "--temperature",
                               "0", "--max-tokens", "40", *args], input=b"hi\n", capture_output=True, timeout=600)

    free, cut = chat(opened), chat(opened, "--reasoning-budget", "4")
    assert free.returncode == 0 and cut.returncode == 0, cut.stderr.decode()
    assert not free.stdout.decode().strip() and cut.stdout.decode().strip()  # thinking never ends without a budget
    bad = chat(tiny_gguf("qwen2"), "--reasoning-budget", "4")
    err = [ln for ln in bad.stderr.decode().splitlines() if ln.strip()]
    assert bad.returncode != 0 and len(err) == 1 and "--reasoning-budget" in err[0], err
    help_text = subprocess.run([sys.executable, "-P", "-m", "ondevice", "serve", "--help"], capture_output=True,
                               text=True, timeout=120, env={**os.environ, "COLUMNS": "200"}).stdout
    assert "--reasoning-budget" in help_text


@pytest.mark.parametrize("kind", ["tags", "harmony", "brackets"])
@pytest.mark.parametrize("inner_grammar", [None, f"start: {WORDS}"])
def test_conventions_opened_by_the_model(rt, kind, inner_grammar):
    """A generation prompt that does not open thinking (Qwen3, gpt-oss): the model opens it (with an inner
    constraint, only the opening's first id besides the answer's, then the rest of it forced), thinks N
    tokens, the end is forced, then the answer; or the model answers at once and no budget applies. Each
    state also against a budget rebuilt from the prefix after random rollbacks."""
    from ondevice.budget import ThinkingBudget
    from ondevice.constrain import Constraint
    from ondevice.reasoning import detect

    template = {"tags": "<think></think>", "harmony": "<|channel|>", "brackets": "[THINK][/THINK]"}[kind]
    th = detect(template, "<|im_start|>assistant\n")
    assert th is not None and not th.opened

    def fresh():
        inner = Constraint.build(rt.target, grammar=inner_grammar) if inner_grammar else None
        return ThinkingBudget(rt.target, th, 3, inner)

    b = fresh()
    tok = rt.target.tokenize
    opening = tok(th.start, add_bos=False, special=True)
    assert b.phase == "start" and b.allowed()[opening[0]]
    b.advance(opening[:1])
    if inner_grammar is not None and len(opening) > 1:
        assert b.phase == "open" and np.flatnonzero(b.allowed()).tolist() == [opening[1]]
    b.advance(opening[1:])
    assert b.phase == "think", (b.phase, th)
    words = tok(" one two three four five six", add_bos=False, special=False)
    b.advance(words[:3])
    assert b.phase == "force" and b.thinking_tokens == 3
    seq = opening + words[:3]
    for t in b.end_ids:
        assert np.flatnonzero(b.allowed()).tolist() == [t]
        b.advance([t])
        seq.append(t)
    assert b.phase == "answer"
    answer = tok("abc de", add_bos=False, special=False)
    assert b.valid_prefix(answer) == len(answer)
    b.advance(answer)
    seq += answer
    rng = random.Random(1)
    for _ in range(12):  # roll back anywhere, go forward again along the same tokens: same states
        n = rng.randint(1, len(seq))
        b.rollback(n)
        ref = fresh()
        ref.advance(seq[: len(seq) - n])
        assert (b.phase, b.thinking_tokens, b.allowed().tolist()) == (ref.phase, ref.thinking_tokens, ref.allowed().tolist())
        b.advance(seq[len(seq) - n:])
    assert b.phase == "answer" and b.thinking_tokens == 3
    straight = fresh()  # no thinking at all: the answer at once
    first = tok("hello", add_bos=False, special=False)
    straight.advance(first)
    if kind != "harmony":
        assert straight.phase == "answer"
    assert straight.thinking_tokens == 0


def test_model_closing_thinking_itself_ends_the_budget(rt):
    """Thinking closed by the model within the budget: the answer follows, nothing is forced."""
    from ondevice.budget import ThinkingBudget
    from ondevice.reasoning import detect

    th = detect("<think></think>", "<think>\n")
    b = ThinkingBudget(rt.target, th, 50)
    assert b.phase == "think"
    text = rt.target.tokenize("one two\n</think>\n\nanswer", add_bos=False, special=True)
    b.advance(text)
    assert b.phase == "answer" and 0 < b.thinking_tokens < len(text)
    assert b.allowed().all()
