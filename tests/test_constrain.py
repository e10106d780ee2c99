"""Constrained output: valid answers, exact under speculation (greedy equality, chi-square), logprobs.

Tiny models (conftest) with byte-level BPE vocabularies: any text is reachable, so every schema can be
followed; the answers say nothing about quality, only about the constraint and the law.
"""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
from helpers import PROMPT, chisquare

import ondevice
from ondevice import drafters, sampling
from ondevice.backends.llama import LlamaBackend
from ondevice.constrain import Constraint, grammar_text, tokenizer_for
from ondevice.errors import OndeviceError

SCHEMAS = {
    "required_fields": {"type": "object", "additionalProperties": False, "required": ["name", "age"],
                        "properties": {"name": {"type": "string", "maxLength": 12},
                                       "age": {"type": "integer", "minimum": 0, "maximum": 120}}},
    "nested": {"type": "object", "additionalProperties": False, "required": ["user"],
               "properties": {"user": {"type": "object", "additionalProperties": False, "required": ["id", "ok"],
                                       "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999},
                                                      "ok": {"type": "boolean"}}}}},
    "array_enum": {"type": "object", "additionalProperties": False, "required": ["tags"],
                   "properties": {"tags": {"type": "array", "minItems": 1, "maxItems": 3,
                                           "items": {"enum": ["red", "green", "blue"]}}}},
    "bounded_number": {"type": "object", "additionalProperties": False, "required": ["x", "level"],
                       "properties": {"x": {"type": "integer", "minimum": -5, "maximum": 5},
                                      "level": {"enum": ["low", "high"]}}},
}
REGEX = "(cat|dog|bird) (is|was) (here|there)"


def _rf(schema):
    return {"type": "json_schema", "json_schema": {"name": "t", "schema": schema, "strict": True}}


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_answers_parse_and_validate(tiny_gguf, name):
    schema = SCHEMAS[name]
    with ondevice.load(tiny_gguf("qwen2"), drafter="ngram", threads=1) as rt:
        for kw in (dict(temperature=0, gamma=0), dict(temperature=1.0, seed=3, gamma=4), dict(temperature=0.7, seed=5)):
            res = rt.generate(PROMPT, response_format=_rf(schema), max_tokens=120, **kw)
            assert res.stats.stop_reason == "eos", (kw, res.text)
            jsonschema.validate(json.loads(res.text), schema)
        res = rt.generate(PROMPT, response_format={"type": "json_object"}, max_tokens=300, temperature=0)
        if res.stats.stop_reason == "eos":
            assert isinstance(json.loads(res.text), dict)


@pytest.mark.parametrize("name", ["required_fields", "array_enum"])
def test_greedy_speculative_equals_plain_constrained(tiny_gguf, name):
    """Token for token, with logprobs (and their top alternatives) identical: n-gram and a target+draft pair."""
    target, draft = tiny_gguf("qwen2"), tiny_gguf("qwen2_draft")
    kw = dict(response_format=_rf(SCHEMAS[name]), max_tokens=80, temperature=0, top_logprobs=5)
    with ondevice.load(target, drafter="none", threads=1) as rt:
        ref = rt.generate(PROMPT, gamma=0, **kw)
    assert ref.stats.stop_reason == "eos"
    runs = []
    with ondevice.load(target, draft, threads=1) as rt:
        runs += [rt.generate(PROMPT, gamma=g, **kw) for g in (1, 3, 5)]
    with ondevice.load(target, drafter="ngram", threads=1) as rt:
        runs += [rt.generate(PROMPT, gamma=g, **kw) for g in (2, 6)]
    for res in runs:
        assert res.tokens == ref.tokens and res.text == ref.text
        assert res.logprobs == ref.logprobs  # the same rows, whichever pass computed them
    assert len(ref.logprobs) == len(ref.tokens) and all(1 <= len(lp.top) <= 5 for lp in ref.logprobs)
    assert any(len(lp.top) == 5 for lp in ref.logprobs)  # forced bytes allow one token; free text many
    assert any(r.stats.accepted > 0 for r in runs)
    if name == "required_fields":  # free text inside the string: drafts both kept and rejected
        assert any(r.stats.drafted > r.stats.accepted > 0 for r in runs)


def test_sampled_logprobs_are_the_sampling_law(tiny_gguf):
    """logprob of each emitted token = log of the (constrained) p it was drawn from, with and without drafts."""
    target, draft = tiny_gguf("qwen2"), tiny_gguf("qwen2_draft")
    kw = dict(response_format=_rf(SCHEMAS["nested"]), max_tokens=60, temperature=0.8, top_k=8, seed=11, logprobs=True)
    with ondevice.load(target, draft, threads=1) as rt:
        spec = rt.generate(PROMPT, gamma=3, **kw)
        ids = rt.tokenize(PROMPT)
    b = LlamaBackend(target, n_ctx=256, threads=1)
    try:
        c = Constraint.build(b, _rf(SCHEMAS["nested"]))
        params = sampling.SamplingParams(temperature=0.8, top_k=8)
        ctx = list(ids)
        b.eval(ctx[:-1])
        for tok, lp in zip(spec.tokens, spec.logprobs, strict=True):
            p = sampling.probs(c.mask_row(b.eval([ctx[-1]])[0]), params, ctx)
            assert lp.token == tok and lp.logprob == pytest.approx(np.log(p[tok]), abs=1e-9)
            c.advance([tok])
            ctx.append(tok)
    finally:
        b.close()


def _constrained_law(path, ids, params, response_format, depth):
    """Exact law of the first ``depth`` tokens (shorter where the answer ends) under the constraint."""
    b = LlamaBackend(path, n_ctx=256, threads=1)
    c = Constraint.build(b, response_format)
    b.eval(ids[:-1])
    base = b.n_past
    law = {}

    def walk(prefix, mass):
        if len(prefix) == depth or c.is_done():
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


def _counts(rt, ids, n, rf, temperature, top_k, gamma):
    counts = {}
    for seed in range(n):
        res = rt.generate(ids, max_tokens=4, temperature=temperature, top_k=top_k, top_p=1.0, min_p=0.0, seed=seed,
                          gamma=gamma, response_format=rf)
        counts[tuple(res.tokens)] = counts.get(tuple(res.tokens), 0) + 1
    return counts


def _unmasked_q_propose(self, context, gamma, params, rng, keep_drafting=None, constraint=None):
    """The planted bug: draws from the constrained q but hands the verifier the unconstrained q."""
    hist, logits = list(context), self._sync(context)
    tokens, rows, mark = [], [], constraint.checkpoint()
    for i in range(gamma):
        ids, pr = sampling.probs_sparse(constraint.mask_row(logits), params, hist, self.vocab_limit)
        t = sampling.sample_sparse(ids, pr, rng)
        tokens.append(t)
        rows.append(sampling.probs(logits, params, hist, self.vocab_limit))  # unmasked
        hist.append(t)
        if t in constraint.eos_ids:
            break
        constraint.advance([t])
        if i + 1 < gamma:
            logits = self.backend.eval([t], logits="last")[-1]
            self._cached.append(t)
    constraint.restore(mark)
    return tokens, np.stack(rows)[:, : self.target_vocab]


def test_sampled_constrained_law_is_exact(tiny_gguf, monkeypatch):
    """Joint law of the answer's first 4 tokens under a small regex, speculative (draft != target) against
    the exact constrained target law. Planted control: q reported without the mask fails."""
    target, draft = tiny_gguf("qwen2"), tiny_gguf("qwen2_draft")
    rf, temperature, top_k, n = {"type": "regex", "regex": REGEX}, 1.0, 6, 2500
    with ondevice.load(target, draft, threads=1) as rt:
        ids = rt.tokenize(PROMPT)
        params = sampling.SamplingParams(temperature=temperature, top_k=top_k, top_p=1.0, min_p=0.0)
        law = _constrained_law(target, ids, params, rf, depth=4)
        assert abs(sum(law.values()) - 1) < 1e-9 and len(law) > 4
        counts = _counts(rt, ids, n, rf, temperature, top_k, gamma=2)
        s = rt.last_stats
        assert chisquare(counts, law, n) > 1e-3
        acc = rt.generate(ids, max_tokens=4, temperature=temperature, top_k=top_k, top_p=1.0, min_p=0.0, seed=1,
                          gamma=3, response_format=rf).stats
        assert s.drafted > 0 and acc.drafted >= 0
        monkeypatch.setattr(drafters.ModelDrafter, "propose", _unmasked_q_propose)
        bug = _counts(rt, ids, n, rf, temperature, top_k, gamma=2)
        assert chisquare(bug, law, n) < 1e-4


def test_grammar_regex_and_errors(tiny_gguf):
    with ondevice.load(tiny_gguf("qwen2"), drafter="ngram", threads=1) as rt:
        for seed in range(4):
            res = rt.generate(PROMPT, grammar='root ::= "yes" | "no" | "maybe later"', temperature=1.0, seed=seed)
            assert res.text in ("yes", "no", "maybe later") and res.stats.stop_reason == "eos"
        res = rt.generate(PROMPT, response_format={"type": "regex", "regex": REGEX}, temperature=0.9, seed=2)
        assert res.text.split(" ")[0] in ("cat", "dog", "bird") and res.text.split(" ")[2] in ("here", "there")
        for bad in (dict(response_format={"type": "yaml"}), dict(response_format={"type": "json_schema"}),
                    dict(grammar="root ::= ( "), dict(response_format={"type": "json_object"}, grammar="root ::= \"a\""),
                    dict(response_format=_rf({"type": "object", "properties": {"a": {"type": "nosuchtype"}}})),
                    dict(top_logprobs=21)):
            with pytest.raises(OndeviceError) as e:
                rt.generate(PROMPT, **bad)
            assert "\n" not in str(e.value)


def test_eos_only_where_the_constraint_accepts(tiny_gguf):
    b = LlamaBackend(tiny_gguf("qwen2"), n_ctx=64, threads=1)
    try:
        c = Constraint(tokenizer_for(b), grammar_text({"type": "regex", "regex": "ab|abc"}))
        eos = c.eos_ids
        assert not c.allowed()[eos].any()
        c.advance(b.tokenize("ab", add_bos=False, special=False)[:1])
        while not c.is_accepting():
            c.advance([int(np.flatnonzero(c.allowed())[0])])
        assert c.allowed()[eos].all()
    finally:
        b.close()


def test_bad_schema_fails_when_the_grammar_is_built():
    """A schema llguidance cannot compile is refused by grammar_text itself (no model, no decoding started)."""
    with pytest.raises(OndeviceError, match=r"^json schema: .*nosuchtype"):
        grammar_text(_rf({"type": "object", "properties": {"a": {"type": "nosuchtype"}}}))
    assert grammar_text(_rf({"type": "object"}))
