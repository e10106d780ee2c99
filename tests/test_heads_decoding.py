"""Decoding with heads: Ctrl-C between a tree pass and its kept path, a rollback after an unkept tree, a seeded
request independent of the prefix cache, and draft="auto" choosing n-gram leaves hidden states off."""

from __future__ import annotations

import numpy as np
import pytest

import ondevice
from ondevice import tree
from ondevice.backends.llama import LlamaBackend

PROMPTS = ("Once upon a time", "def f(x):")  # the tiny target writes 120 tokens after each (no early end)
GREEDY = dict(max_tokens=120, temperature=0.0)


def _stop_at(n: int, fn):
    """``fn`` that raises KeyboardInterrupt (as Ctrl-C would, between two bytecodes) on its ``n``-th call."""
    calls = [0]

    def wrapped(*a, **kw):
        calls[0] += 1
        if calls[0] == n:
            raise KeyboardInterrupt
        return fn(*a, **kw)

    return wrapped


class _LibStoppingAt:
    """llama_cpp with one function raising KeyboardInterrupt on its first call (Ctrl-C between two native calls)."""

    def __init__(self, lib, name: str) -> None:
        self._lib, self._name = lib, name

    def __getattr__(self, attr):
        fn = getattr(self._lib, attr)
        if attr == self._name:
            self._name = None
            return _stop_at(1, fn)
        return fn


@pytest.mark.parametrize("where", ["verify_tree", "keep_path"])
def test_ctrl_c_between_a_tree_pass_and_its_kept_path_then_greedy_equals_plain(heads_home, monkeypatch, where):
    """Ctrl-C after a tree was evaluated but before its path was kept (while the tree is verified, the moment the
    decode returns) left the other branches' cells in llama.cpp's cache: the next request's tokens went into
    other cells, and a greedy answer of the same loaded model then differed from plain decoding."""
    target, home = heads_home
    monkeypatch.setenv("ONDEVICE_HOME", str(home))
    with ondevice.load(target, drafter="none", threads=1, n_ctx=512) as plain:
        want = [plain.generate(p, **GREEDY).tokens for p in PROMPTS]
    with ondevice.load(target, draft="heads", threads=1, n_ctx=512) as rt:
        assert rt.drafter.name == "heads" and rt.target.tree_unsupported() is None
        if where == "verify_tree":
            monkeypatch.setattr(tree, "verify_tree", _stop_at(3, tree.verify_tree))
        else:
            monkeypatch.setattr(LlamaBackend, "keep_path", _stop_at(3, LlamaBackend.keep_path))
        with pytest.raises(KeyboardInterrupt):
            rt.generate(PROMPTS[0], gamma=3, **GREEDY)
        monkeypatch.undo()
        monkeypatch.setenv("ONDEVICE_HOME", str(home))
        assert [rt.generate(p, gamma=3, **GREEDY).tokens for p in PROMPTS] == want


@pytest.mark.parametrize("stop", [None, "llama_memory_seq_keep", "llama_state_seq_get_size"])
def test_rollback_after_an_unkept_tree_leaves_the_cache_a_chain_would(tiny_gguf, stop):
    """The backend alone: eval_tree, then keep_path never called (None) or interrupted between two of its native
    calls (a kept path off the first branch: moved to sequence 0, then re-laid in order), then a rollback into
    the context: the next tokens, a kept tree and more tokens score as in a context that never saw the tree.
    Before, the tree's other cells stayed taken, the next tokens went into cells after them and later ones
    filled the holes, out of position order (llama.cpp's CPU attention sums in cell order: ~0.4 apart)."""

    path = tiny_gguf("llama")
    a, b = LlamaBackend(path, n_ctx=512, threads=1), LlamaBackend(path, n_ctx=512, threads=1)
    try:
        ids = [1, *range(20, 60)]
        for be in (a, b):
            be.eval(ids[:13], logits="last")
        a.eval_tree([ids[13], 5, 6, 7, 8], [-1, 0, 0, 2, 3])
        if stop is not None:
            lib, a._lib = a._lib, _LibStoppingAt(a._lib, stop)
            with pytest.raises(KeyboardInterrupt):
                a.keep_path([0, 2, 3])
            a._lib = lib
        got = []
        for be in (a, b):
            be.rollback(11)
            rows = [be.eval([t]) for t in ids[11:14]]
            be.eval_tree([ids[14], ids[15], 9], [-1, 0, 0])
            be.keep_path([0, 1])
            rows += [be.eval([t]) for t in ids[16:40]]
            got.append(np.concatenate(rows))
        assert a.n_past == b.n_past == 40 and np.array_equal(got[0], got[1])
    finally:
        a.close()
        b.close()


@pytest.fixture
def target(heads_trained):
    """The tiny llama target copied outside the test cache (its heads go to <home>/heads)."""
    return heads_trained[0]


@pytest.fixture
def clean(heads_trained):
    """(home, summary) of one uninterrupted small run."""
    return heads_trained[1:]


def test_a_seeded_request_does_not_depend_on_the_prefix_cache(target, clean, monkeypatch):
    """The same request twice: the second finds its prompt cached whole, yet drafts its first step as the
    first did (the runtime evaluates the last cached token again for the heads' hidden row)."""
    monkeypatch.setenv("ONDEVICE_HOME", str(clean[0]))
    with ondevice.load(target, draft="heads", threads=1) as rt:
        for kw in (dict(temperature=0), dict(temperature=0.7, top_p=0.9)):
            runs = [rt.generate("def add(a, b):", max_tokens=24, seed=3, gamma=3, **kw) for _ in range(2)]
            a, b = runs
            assert a.tokens == b.tokens and a.stats.accept_counts == b.stats.accept_counts
            assert a.stats.drafted == b.stats.drafted > 0 and b.stats.prompt_eval_tokens == 2  # the cached last token again, and the pending one


def test_auto_choosing_ngram_leaves_the_targets_hidden_states_off(target, clean, monkeypatch):
    """draft="auto" times the stored heads to judge them; it switched the target's hidden-state output on even
    when it then chose n-gram drafting (every pass paid for rows nobody reads)."""
    from ondevice.costs import Costs

    monkeypatch.setenv("ONDEVICE_HOME", str(clean[0]))
    monkeypatch.setattr("ondevice.store.discovery.local_models", lambda: [])
    steep = Costs({1: 1e-3, 2: 2e-3, 4: 4e-3, 8: 8e-3}, 0.0)
    monkeypatch.setattr("ondevice.drafters.heads.seconds_per_token", lambda heads, reps=15: 2e-5)  # cheap: the curve decides
    monkeypatch.setattr("ondevice.costs.cached_measure", lambda target, draft=None, cancelled=None: steep)
    with ondevice.load(target, draft="auto", threads=1) as rt:
        assert rt.drafter.name == "ngram" and rt.draft_choice["candidates"][0]["ok"]
        rt.generate("def add(a, b):", max_tokens=8, temperature=0, gamma=3)
        assert rt.target.hidden(rt.target.n_past - 1) is None
