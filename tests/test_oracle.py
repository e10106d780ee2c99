"""The oracle bound, the n-gram copy that survives a renamed token, the quant advisor's recommendation rule and
the cost probe's plausibility check."""

from __future__ import annotations

import numpy as np
import pytest

from ondevice.costs import Costs


def test_oracle_dp_on_hand_made_guesses():
    from ondevice.bench.oracle import oracle_time

    flat = Costs({1: 1.0, 2: 1.1, 4: 1.3, 8: 1.7})
    # 6 tokens; at 0 a guess of 5 of which all are right: one pass of γ=5 then a plain one
    steps = [(5, 5), (4, 4), (3, 3), (2, 2), (1, 1), (0, 0)]
    t, path = oracle_time(steps, flat)
    assert path == [5] and np.isclose(t, flat.verify_cost(6))
    # nothing right: every pass plain, and the oracle never pays for a useless verify
    t, path = oracle_time([(4, 0)] * 5, flat)
    assert path == [0] * 5 and t == 5.0
    # a steep curve (cost(k) = k): drafting never saves time, so the oracle is exactly plain
    steep = Costs({k: float(k) for k in (1, 2, 4, 8)})
    assert oracle_time(steps, steep)[0] == pytest.approx(6.0)


def test_oracle_replays_the_ngram_drafter():
    from ondevice.bench.oracle import guesses, oracle_speedup

    prompt = [1, 2, 3] + list(range(100, 140)) + [5]
    answer = list(range(100, 140))  # the answer copies the prompt
    g = guesses(prompt, answer)
    assert g[1][1] >= 30  # after the first token the guess is the rest of the copy
    r = oracle_speedup(prompt, answer, Costs({1: 1.0, 2: 1.1, 4: 1.3, 8: 1.7, 16: 2.5}))
    assert r["oracle_speedup"] > 5 and r["oracle_passes"] <= 4


def test_ngram_copy_survives_a_renamed_token():
    from ondevice.drafters import NgramDrafter

    d = NgramDrafter()
    src = list(range(100, 130))
    ctx = [1, 2] + src + [5] + src[:10]
    assert d.propose(ctx, 4, None, None)[0] == src[10:14]
    ctx.append(999)  # the answer renames src[10]
    guess, _ = d.propose(ctx, 4, None, None)
    assert guess == src[11:15] and d.last_match_len >= 10  # the copy goes on past the renamed token
    ctx += [998, 997]  # a second divergence: the copy has ended
    assert d.propose(ctx, 4, None, None) == ([], None)
    # control: without the continuation, a fresh drafter on the renamed context has nothing to copy
    assert NgramDrafter().propose([1, 2] + src + [5] + src[:10] + [999], 4, None, None) == ([], None)


def test_advisor_recommends_the_fastest_format_within_the_quality_budget():
    from converters.advisor import recommend

    rows = [
        {"format": "q4_k_m", "decode_tokens_per_second": 40.0, "edit_speedup": 1.3, "top1_agreement": 0.97, "mean_kl": 0.02},
        {"format": "q4_0", "decode_tokens_per_second": 40.0, "edit_speedup": 1.6, "top1_agreement": 0.95, "mean_kl": 0.05},
        {"format": "iq4_nl", "decode_tokens_per_second": 35.0, "edit_speedup": 1.8, "top1_agreement": 0.96, "mean_kl": 0.04},
        {"format": "q2", "decode_tokens_per_second": 80.0, "edit_speedup": 2.0, "top1_agreement": 0.70, "mean_kl": 0.9},
    ]
    best, why = recommend(rows)
    assert best == "q4_0"  # 40 × 1.6 = 64 effective tok/s beats iq4_nl's 63; q2 fails the quality budget
    assert "q2" in why and "quality" in why
    # Judged against the source itself (no more precise file): the source's trivial 100 % must not set the
    # budget, or no requantization could ever be recommended.
    against_source = [{"format": "q4_k_m", "decode_tokens_per_second": 40.0, "edit_speedup": 1.3, "top1_agreement": 1.0,
                       "mean_kl": 0.0, "is_reference": True},
                      {"format": "iq4_nl", "decode_tokens_per_second": 35.0, "edit_speedup": 1.8, "top1_agreement": 0.906,
                       "mean_kl": 0.039},
                      {"format": "q2", "decode_tokens_per_second": 80.0, "edit_speedup": 2.0, "top1_agreement": 0.70,
                       "mean_kl": 0.9}]
    assert recommend(against_source)[0] == "iq4_nl"
    del against_source[0]["is_reference"]  # control: the old rule let the reference set the budget
    assert recommend(against_source)[0] == "q4_k_m"


def test_bench_reports_the_oracle_next_to_the_realized_speedup(tiny_gguf):
    from ondevice.bench.run import run_bench

    doc = run_bench(str(tiny_gguf("llama", "q8_0")), ngram=True, classes=["edit"], per_class=1, repeats=1,
                    max_tokens=24, gamma="auto", n_ctx=1024, threads=1)
    ngram = [r for r in doc["runs"] if r["mode"] == "ngram_auto"]
    assert ngram and all(r["same_as_plain"] for r in ngram)  # greedy: token for token
    assert all(r["oracle_speedup"] >= 1.0 and r["oracle_passes"] >= 1 for r in ngram)  # γ = 0 everywhere is allowed
    row = next(s for s in doc["summary"] if s["mode"] == "ngram_auto")
    assert row["oracle_speedup"] >= 1.0 and "realized_over_oracle" in row and 0 <= row["plain_steps_share"] <= 1


def test_advisor_end_to_end_on_a_tiny_model(tiny_gguf, tmp_path, monkeypatch):
    from converters.advisor import advise, plot

    monkeypatch.setenv("ONDEVICE_HOME", str(tmp_path))
    doc = advise(str(tiny_gguf("qwen2", "q8_0")), ["q8_0", "q4_0"], classes=["edit"], per_class=1, max_tokens=8,
                 rounds=1, threads=1, tasks_per_class=1)
    rows = {r["format"]: r for r in doc["formats"]}
    assert rows["q8_0"]["made"] == "source" and rows["q8_0"]["top1_agreement"] == 1.0
    assert rows["q4_0"]["made"] == "requantized into a temp dir" and not list(tmp_path.glob("ondevice-formats-*"))
    for r in rows.values():
        assert r["decode_tokens_per_second"] > 0 and set(r["verify_cost"]) == {"2", "4", "8", "16"}
        assert r["ngram"]["edit"]["same_as_plain"] is True
        assert r["tasks"]["overall"]["n"] == 4 and 0 <= r["pass_rate"] <= 1  # the task eval, one task per class
    assert doc["recommendation"]["format"] in rows and doc["recommendation"]["why"]
    assert plot(doc, tmp_path / "plots").is_file()


def test_one_slow_plain_step_does_not_make_batches_look_free():
    """A preempted plain step (k = 1 timed 10× too slow) once raised every batch to its time, so cost(k) = 1
    for all k and the policy drafted every pass, never timing a plain step again to correct it."""
    from ondevice.policy import AdaptivePolicy

    costs = Costs({1: 1.0, 2: 1.9, 4: 3.0, 8: 5.5, 16: 9.0})
    for _ in range(3):
        costs.observe(1, 50.0)  # preempted plain steps folded into the curve
    assert costs.target_seconds[1] < 1.2 and costs.verify_cost(4) >= 2.5  # the batches keep their own cost
    p = AdaptivePolicy(costs, "ngram", learn_costs=False)
    for _ in range(30):
        p.update(0, 0, 1, [5, 6], [7])  # guesses are wrong
    assert p.next_gamma(hint=1) == 0
    # an inconsistent curve (plain step slower than a batch of 16) is made monotone from above, never below
    bad = Costs({1: 10.0, 2: 1.9, 4: 3.0, 8: 5.5, 16: 9.0})
    assert bad.verify_cost(16) > 4.0
    # control: the old rule (monotone from below, each k raised to the slowest smaller batch) says free
    t = bad.target_seconds
    assert max(min(t[j], j * t[1]) for j in t) / t[1] <= 1.0
