"""``ondevice bench --draft mtp|PATH``: a drafter kind without a draft model (the model's own MTP heads, an EAGLE-3
file) is benchmarked like the others — τ, acceptance by depth, greedy == plain — and its measured cost per drafted
token ÷ a target decode is reported and charged in its bound (not taken as free)."""

from __future__ import annotations

import pytest
from helpers import tiny_gguf_target

from ondevice.bench.run import run_bench
from ondevice.costs import speedup_bound


def _check(doc: dict, kind: str, gamma: int) -> None:
    ratio = doc["costs"]["drafter_cost_ratios"][kind]
    assert 0 < ratio < 10  # measured in its graph, relative to one target decode
    runs = [r for r in doc["runs"] if r["mode"] == f"{kind}_g{gamma}"]
    assert runs and all(r["same_as_plain"] for r in runs)
    row = next(s for s in doc["summary"] if s["mode"] == f"{kind}_g{gamma}")
    assert row["draft_cost_ratio"] == ratio and row["tau"] >= 1.0
    assert "acceptance_by_position" in row or row["acceptance_rate"] == 0
    free = speedup_bound(row["acceptance_rate"], gamma, 0.0, doc["costs"]["verify_cost"][str(gamma + 1)])
    assert row["bound"] < free  # its cost is charged


def test_bench_charges_an_eagle3_file_its_measured_cost(tmp_path):
    from converters.eagle3 import convert_eagle3
    from ondevice.testing.eagle3 import make_tiny_eagle3

    target = tiny_gguf_target(tmp_path, "llama")
    src = make_tiny_eagle3(tmp_path / "e3src", own_embeddings=False, dtype="float32", draft_vocab=64,
                           layer_ids=[0, 2, 3], seed=0)
    convert_eagle3(src, target=target, out=tmp_path / "e3", dtype="f32")
    doc = run_bench(str(target), str(tmp_path / "e3" / "model.gguf"), classes=["edit"], per_class=1, repeats=1,
                    max_tokens=12, gamma="3", n_ctx=512, threads=1)
    _check(doc, "eagle3", 3)


@pytest.mark.parametrize("arch", ["qwen35"])
def test_bench_charges_a_models_mtp_heads_their_measured_cost(tmp_path, arch):
    from ondevice.testing.mtp import make_tiny_mtp_gguf

    target = make_tiny_mtp_gguf(tmp_path / f"{arch}.gguf", arch, seed=3)
    doc = run_bench(str(target), "mtp", classes=["edit"], per_class=1, repeats=1, max_tokens=12, gamma="2",
                    n_ctx=512, threads=1)
    _check(doc, "mtp", 2)


def test_the_cost_probe_and_gamma_auto_run_on_a_recurrent_target(tmp_path):
    """qwen35's recurrent state rolls back only into its last pass: the probe (``costs.measure``, behind
    ``gamma="auto"`` and every bench) re-evaluates its prefix instead of failing, and leaves the cache empty."""
    import ondevice
    from ondevice.costs import measure
    from ondevice.testing.mtp import make_tiny_mtp_gguf

    target = make_tiny_mtp_gguf(tmp_path / "qwen35.gguf", "qwen35", seed=3)
    prompt = [5, 77, 301, 12, 9, 140]
    with ondevice.load(target, draft="mtp", threads=1, n_ctx=512) as spec, \
            ondevice.load(target, drafter="none", threads=1, n_ctx=512) as plain:
        c = measure(spec.target, attempts=1, reps=2)
        assert set(c.target_seconds) >= {1, 2} and spec.target.n_past == 0
        assert spec.generate(prompt, max_tokens=24, temperature=0, gamma="auto").tokens == \
            plain.generate(prompt, max_tokens=24, temperature=0).tokens


def test_a_fixed_gamma_grows_trees_past_eight_nodes(tmp_path):
    """``gamma=16`` with a tree drafter (EAGLE-3) verifies trees of up to 16 drafted nodes (the issue measures
    trees ≤ 16), and greedy decoding still equals plain decoding token for token."""
    import ondevice
    from converters.eagle3 import convert_eagle3
    from ondevice.testing.eagle3 import make_tiny_eagle3

    target = tiny_gguf_target(tmp_path, "llama")
    src = make_tiny_eagle3(tmp_path / "e3src", own_embeddings=False, dtype="float32", draft_vocab=64,
                           layer_ids=[0, 2, 3], seed=0)
    convert_eagle3(src, target=target, out=tmp_path / "e3", dtype="f32")
    with ondevice.load(target, draft=str(tmp_path / "e3" / "model.gguf"), threads=1) as spec, \
            ondevice.load(target, drafter="none", threads=1) as plain:
        assert spec.drafter.traits.trees
        r = spec.generate("def add(a, b):", max_tokens=24, temperature=0, gamma=16)
        assert r.tokens == plain.generate("def add(a, b):", max_tokens=24, temperature=0).tokens
        assert r.stats.drafted > 8 * r.stats.target_forwards  # more than 8 drafted nodes per pass on average


def test_bench_explains_greedy_divergences_and_counts_a_planted_bug(tmp_path, monkeypatch):
    """A greedy verify that keeps every draft (planted bug) makes speculative output differ from plain: each such
    run carries its ``divergence`` and the summary counts it as unexplained (the tiny q8_0 target is batch-invariant,
    so no rounding explains any flip)."""
    import numpy as np

    from ondevice import sampling

    target = tiny_gguf_target(tmp_path, "llama")
    monkeypatch.setattr(sampling, "verify_greedy",
                        lambda d, logits, params, history, rng: (len(d), int(np.argmax(logits[len(d)]))))
    doc = run_bench(str(target), None, ngram=True, classes=["edit", "code"], per_class=1, repeats=1, max_tokens=24, gamma="4",
                    n_ctx=512, threads=1)
    bad = [r for r in doc["runs"] if r.get("same_as_plain") is False]
    assert bad, "the planted bug changed no output"
    assert all(not r["divergence"]["explained"] and r["divergence"]["noise"] == 0.0 for r in bad)
    rows = [s for s in doc["summary"] if "unexplained_divergences" in s]
    assert sum(s["unexplained_divergences"] for s in rows) == len(bad)
