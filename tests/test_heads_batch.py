"""Batched recording for train-heads (many answers in one llama.cpp context), the target's own prompts,
and the policy that sizes best-first trees."""

from __future__ import annotations

import numpy as np
import pytest

from ondevice.backends.llama import LlamaBackend
from ondevice.heads import batch, data, selfprompts
from ondevice.policy import AdaptivePolicy, FixedGamma
from ondevice.tree import Tree

TEXTS = ["def add(a, b):", "The model draft and the target verify", "class Cache:", "import os\n", "x = [1, 2, 3]",
         "Once upon a time", "SELECT * FROM", "for i in range(10):"]


def test_generate_many_records_what_one_at_a_time_records(tiny_gguf):
    """Eight answers decoded four at a time (slots reused as answers end) equal the answers decoded
    alone, token for token, with the same hidden rows; the cache is left empty."""
    path = tiny_gguf("llama")
    b = LlamaBackend(path, n_ctx=1024, threads=1, n_seq_max=4)
    try:
        b.enable_hidden()
        prompts = [b.tokenize(t) for t in TEXTS]
        ref = b.eval(prompts[0])
        b.rollback(0)
        alone = [data.record_answer(b, p, 24) for p in prompts]
        got: dict[int, data.Record] = {}
        batch.generate_many(b, prompts, max_new=24, on_done=lambda i, r: got.__setitem__(i, r), slots=4)
        assert sorted(got) == list(range(len(TEXTS))) and b.n_past == 0
        for a, g in zip(alone, [got[i] for i in range(len(TEXTS))], strict=True):
            assert a.tokens.tolist() == g.tokens.tolist()
            assert a.hidden.shape == g.hidden.shape and np.allclose(a.hidden, g.hidden, atol=1e-2, rtol=1e-3)
        assert np.array_equal(b.eval(prompts[0]), ref)  # the single-sequence path is as before
    finally:
        b.close()


def test_collect_many_keeps_the_budget_and_resumes(tiny_gguf, tmp_path):
    path = tiny_gguf("llama")
    b = LlamaBackend(path, n_ctx=1024, threads=1, n_seq_max=4)
    try:
        b.enable_hidden()
        prompts = [("code", b.tokenize(t)) for t in TEXTS]
        seen = []
        recs = batch.collect_many(b, prompts, tmp_path, budget=60, max_new=16, slots=4, on_record=lambda t, n: seen.append(t))
        held = sum(len(r.hidden) for r in recs)
        assert 60 <= held <= 60 + 4 * 16 and seen[-1] == held
        files = sorted(p.name for p in tmp_path.glob("rec-*.npz"))
        assert len(files) == len(recs) and all(r.cls == "code" for r in recs)
        again = batch.collect_many(b, prompts, tmp_path, budget=60, max_new=16, slots=4)  # resumes: nothing new
        assert [r.tokens.tolist() for r in again] == [r.tokens.tolist() for r in recs]
        assert sorted(p.name for p in tmp_path.glob("rec-*.npz")) == files
    finally:
        b.close()


def test_collect_resumes_only_the_answers_to_the_same_prompts(tmp_path, monkeypatch):
    """``data.collect`` (``scripts/record_heads.py``) reads ``rec-NNNN.npz`` back only while it answers prompt NNNN:
    held-out classes added to prompts.json move the interleaved prompts (chat, code → chat, code, edit, summary), and
    a record by position alone would stand for another prompt's answer (duplicates; the new classes never recorded)."""

    class Rt:
        def __init__(self):
            self.target = type("B", (), {"n_ctx": 512, "enable_hidden": lambda self: 0})()

        def render_chat(self, msgs):
            return [ord(c) for c in msgs[0]["content"]]

        def reset(self):
            pass

    asked = []

    def answer(backend, ids, max_new):
        asked.append(ids)
        return data.Record(np.array([ids[-1], 7, 8]), np.zeros((2, 4), np.float32), np.asarray(ids, np.int64))

    monkeypatch.setattr(data, "record_answer", answer)
    rt = Rt()
    old = data.collect(rt, [("chat", "c0"), ("code", "k0")], tmp_path, budget=10**9, max_new=8)
    assert len(asked) == 2 and [r.cls for r in old] == ["chat", "code"]
    new = data.collect(rt, [("chat", "c0"), ("code", "k0"), ("edit", "e0")], tmp_path, budget=10**9, max_new=8)
    assert len(asked) == 3 and [r.cls for r in new] == ["chat", "code", "edit"]  # the first two read back
    moved = data.collect(rt, [("chat", "c0"), ("edit", "e0"), ("code", "k0")], tmp_path, budget=10**9, max_new=8)
    assert [r.cls for r in moved] == ["chat", "edit", "code"]
    assert [r.prompt.tolist() for r in moved] == [rt.render_chat([{"content": t}]) for t in ("c0", "e0", "k0")]
    assert len(asked) == 5  # rec-0001 and rec-0002 answered other prompts: recorded again


def test_generate_many_refuses_a_prompt_that_cannot_fit(tiny_gguf):
    b = LlamaBackend(tiny_gguf("llama"), n_ctx=256, threads=1, n_seq_max=2)
    try:
        with pytest.raises(ValueError, match="does not fit n_ctx"):
            batch.generate_many(b, [[1] * 250], max_new=16, on_done=lambda i, r: None)
    finally:
        b.close()


def test_self_written_prompts_skip_heldout_lookalikes():
    held = data.load_prompts()["heldout"]["code"][0]
    assert selfprompts.near(held, held) and selfprompts.near(held + " please", held)
    assert not selfprompts.near("How do volcanoes form?", held)


def test_write_prompts_on_a_tiny_model(tiny_gguf, monkeypatch):
    """The target writes requests through its own template; what comes back is finished text, none close
    to a held-out prompt (a planted held-out copy is dropped)."""
    import ondevice

    monkeypatch.setattr(selfprompts, "load_prompts", lambda: {"heldout": {"code": ["zzz planted prompt text"]},
                                                              "topics": {"code": ["lists"], "chat": ["tea"]}})
    with ondevice.load(tiny_gguf("llama"), drafter="none", threads=1, n_ctx=512) as rt:
        rt.render_chat = lambda messages: rt.tokenize(messages[0]["content"])  # the tiny model has no template
        b = LlamaBackend(rt.target.path, n_ctx=1024, threads=1, n_seq_max=4)
        try:
            got = selfprompts.write_prompts(rt, b, per_topic=3, max_new=24)
        finally:
            b.close()
    assert all(c in ("code", "chat") and len(t) >= 16 and not selfprompts.near(t, "zzz planted prompt text") for c, t in got)


def _tree(scores: list[float], parents: list[int]) -> Tree:
    return Tree(list(range(len(parents))), parents, scores=scores)


def test_policy_sizes_trees_from_the_verify_curve():
    """Flat curve: a confident tree is verified whole; steep curve (this CPU): nothing, or a short prefix;
    FixedGamma verifies γ nodes."""
    from ondevice.costs import Costs

    tree = _tree([1.0, 0.95, 0.9, 0.85, 0.8, 0.3, 0.2, 0.1, 0.05], [-1, 0, 1, 2, 3, 0, 1, 2, 3])
    flat = Costs({1: 1.0, 2: 1.02, 4: 1.05, 8: 1.1, 16: 1.3}, 0.0)
    steep = Costs({1: 1.0, 2: 1.8, 4: 2.7, 8: 5.4, 16: 10.0}, 0.0)
    p = AdaptivePolicy(flat, "heads")
    assert p.tree_nodes(tree) >= 7  # the last node (0.05) hardly pays for its cell
    s = AdaptivePolicy(steep, "heads", probe_every=4)
    assert s.tree_budget() == 8 and s.tree_nodes(tree) < 4
    weak = _tree([1.0, 0.2, 0.1, 0.05], [-1, 0, 1, 2])
    assert s.tree_nodes(weak) == 0  # a plain run starts: no tree is grown until the probe
    assert [s.tree_budget() for _ in range(3)] == [0, 0, 0]
    assert s.tree_budget() == 8 and s.tree_nodes(weak) == 1 and s.probing  # the probe: one node
    s.update_tree(expected=0.2, accepted=0)
    assert s.probe_every == 8 and s.calibration < 0.8  # a failed probe waits twice as long
    assert s.tree_budget() == 8 and s.tree_nodes(weak) == 0  # the probe's lesson is judged once, then a plain run
    assert [s.tree_budget() for _ in range(7)] == [0] * 7
    assert s.tree_budget() == 8 and s.tree_nodes(weak) == 1 and s.probing
    s.update_tree(expected=0.2, accepted=1)  # kept, but one node still does not pay on this curve:
    assert s.probe_every == 16  # the wait doubles all the same
    s.costs, s.calibration = flat, 1.0  # the world changes: verification turns cheap, drafts good
    assert s.tree_nodes(tree) > 0 and s.probe_every == 4  # drafting chosen on its merits: probes come back soon
    assert FixedGamma(3).tree_nodes(tree) == 3 and FixedGamma(3).tree_budget() == 3
    hopeless = AdaptivePolicy(Costs({1: 1.0, 2: 2.0, 4: 4.0, 8: 8.0}, 0.0), "heads")
    assert hopeless.tree_budget() == 0  # perfect trees could not beat plain decoding: never grown


def test_hidden_rows_only_when_the_next_step_may_draft(tiny_gguf):
    """want_hidden(False) stops llama.cpp's embeddings output (no row kept) and changes no logits; the policy's
    drafts_next says when a plain run needs none (peeked: tree_budget then agrees)."""
    from ondevice.costs import Costs

    b = LlamaBackend(tiny_gguf("llama"), n_ctx=256, threads=1)
    try:
        ids = b.tokenize(TEXTS[1])
        b.enable_hidden()
        on = b.eval(ids)
        assert b.hidden(len(ids) - 1) is not None
        b.rollback(0)
        b.want_hidden(False)
        assert np.array_equal(b.eval(ids), on) and b.hidden(len(ids) - 1) is None
        b.want_hidden(True)
        b.eval([5])
        assert b.hidden(len(ids)) is not None
    finally:
        b.close()
    steep = AdaptivePolicy(Costs({1: 1.0, 2: 1.8, 4: 2.7, 8: 5.4, 16: 10.0}, 0.0), "heads", probe_every=3)
    weak = _tree([1.0, 0.2, 0.1], [-1, 0, 1])
    seen = []
    for _ in range(8):
        peek = steep.drafts_next()
        budget = steep.tree_budget()
        assert peek == (budget > 0)
        seen.append(budget > 0)
        if budget:
            steep.tree_nodes(weak)
    assert seen[0] and not all(seen) and sum(seen) >= 2  # drafts at the start and at each probe only
    assert not AdaptivePolicy(Costs({1: 1.0, 2: 2.0, 4: 4.0, 8: 8.0}, 0.0), "heads").drafts_next()
