"""The adaptive γ policy on synthetic cost curves and acceptance sequences, and exactness with it on."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import PROMPT

import ondevice
from ondevice.costs import Costs, speedup_bound
from ondevice.policy import RISK, AdaptivePolicy, expected_rate


def curve(per_token: float, c_seconds: float = 0.0, base: float = 1.0) -> Costs:
    """cost(k) = base + per_token·(k − 1) seconds."""
    return Costs({k: base + per_token * (k - 1) for k in (1, 2, 4, 8, 16)}, c_seconds)


def feed(policy, outcomes, hint=0):
    for drafted, accepted in outcomes:
        policy.update(drafted, accepted, hint)


def test_plain_when_verify_is_expensive():
    p = AdaptivePolicy(curve(per_token=1.0, c_seconds=0.5), "model")  # verifying k costs k decodes
    feed(p, [(4, 4)] * 50)  # even perfect acceptance cannot pay for it
    assert [p.next_gamma() for _ in range(10)] == [0] * 10


def test_gamma_grows_with_acceptance_when_verify_is_cheap():
    cheap = curve(per_token=0.05, c_seconds=0.05)
    low, high = AdaptivePolicy(cheap, "model"), AdaptivePolicy(cheap, "model")
    feed(low, [(4, 0)] * 40)
    feed(high, [(4, 4)] * 40)
    assert low.next_gamma() == 0
    assert high.next_gamma() >= 6


def test_this_cpu_shape_prefers_plain_for_a_costly_draft():
    # measured here for the Qwen pair: c ≈ 0.43, cost(k) ≈ k^0.8 → even α = 0.97 loses
    costs = Costs({k: k ** 0.8 for k in range(1, 17)}, 0.43)
    assert max(speedup_bound(0.97, g, 0.43, costs.verify_cost(g + 1)) for g in range(1, 9)) < 1.0
    p = AdaptivePolicy(costs, "model")
    feed(p, [(2, 2)] * 30)
    assert p.next_gamma() == 0


def test_never_drafts_or_probes_when_even_perfect_drafts_lose():
    costs = Costs({k: k ** 0.8 for k in range(1, 17)}, 0.43)  # the Qwen pair on this CPU
    p = AdaptivePolicy(costs, "model", probe_every=2)
    assert [p.next_gamma() for _ in range(20)] == [0] * 20  # no probes either: they could not pay


def test_a_lagging_draft_cache_is_charged_to_the_step():
    p = AdaptivePolicy(curve(per_token=0.2, c_seconds=0.3), "model")
    feed(p, [(4, 4)] * 40)
    assert p.next_gamma(lag=1) > 0
    assert p.next_gamma(lag=200) == 0  # catching up 200 tokens would cost more than speculation gains


def test_probe_refreshes_estimates_after_plain_run():
    p = AdaptivePolicy(curve(per_token=0.1), "model", probe_every=5)
    feed(p, [(4, 0)] * 40)
    gammas = [p.next_gamma() for _ in range(10)]
    assert gammas.count(1) == 2 and gammas.count(0) == 8  # a γ = 1 probe every 5 plain steps
    feed(p, [(1, 1)] * 40)  # the world changed: drafts are now accepted
    assert p.next_gamma() >= 2


def test_probes_fade_while_drafting_does_not_pay():
    """A probe that keeps its token, on a curve where one kept token still loses, doubles the wait like a
    failed one: over a long answer the probes cost nothing; choosing to draft brings them back."""
    p = AdaptivePolicy(curve(per_token=0.8), "model", probe_every=4)
    feed(p, [(4, 0)] * 40)
    steps = []
    for _ in range(200):
        g = p.next_gamma()
        steps.append(g)
        if g:
            p.update(1, 1)  # accepted, yet on this curve it did not pay
    assert steps.count(1) <= 6 and p.probe_every >= 64  # probes at 4, 8, 16, 32, 64… steps apart
    feed(p, [(1, 1)] * 200)
    p.costs = curve(per_token=0.05)
    assert p.next_gamma() > 0 and p.probe_every == 4


def test_ngram_long_copies_unlock_long_drafts():
    p = AdaptivePolicy(curve(per_token=0.3), "ngram")
    assert p.max_gamma == 32
    feed(p, [(8, 8)] * 30, hint=4)
    assert p.next_gamma(hint=4) > 8  # a long verbatim copy under way: past the usual γ ≤ 8 ceiling
    feed(p, [(8, 0)] * 30, hint=1)
    assert p.next_gamma(hint=1) == 0  # one-token matches are rejected here: plain steps


def test_ngram_match_length_reports_how_far_a_copy_agrees():
    from ondevice.drafters import NgramDrafter

    d = NgramDrafter()
    text = list(range(100, 140))
    ctx = [1, 2, 3] + text + [7, 8] + text[:25]  # copying `text`: 25 tokens in
    draft, _ = d.propose(ctx, 6, None, None)
    assert draft == text[25:31]
    assert d.last_match_len == 25  # agreement back to where the copy began, not just the 4-gram
    ctx = [5, 6, 9, 1, 2, 3, 4, 11, 12, 1, 2, 3, 4]
    assert d.propose(ctx, 2, None, None)[0] == [11, 12] and d.last_match_len == 4
    assert d.propose([1, 2, 3], 2, None, None) == ([], None) and d.last_match_len == 0


def test_ngram_long_agreement_drafts_from_the_first_step():
    idle = Costs({1: 1.0, 2: 1.85, 4: 2.77, 8: 5.25, 12: 6.88, 16: 6.82, 24: 10.62, 32: 12.49})  # Qwen 1.5B IQ4_NL here
    p = AdaptivePolicy(idle, "ngram")
    assert p.next_gamma(hint=2) == 0  # short matches: not worth a verify until shown otherwise
    assert p.next_gamma(hint=40) >= 2  # a 40-token verbatim agreement: a copy is under way


def test_keep_drafting_stops_on_low_confidence():
    p = AdaptivePolicy(curve(per_token=0.1, c_seconds=0.2), "model")
    feed(p, [(4, 4)] * 30)
    assert p.keep_drafting([0.99, 0.98])
    assert not p.keep_drafting([0.99, 0.02])


def test_expected_rate_matches_closed_form():
    costs = curve(per_token=0.3, c_seconds=0.1)
    for a in (0.3, 0.8, 0.95):
        for g in (1, 3, 6):
            assert np.isclose(expected_rate([a] * g, g, 0.1, costs), speedup_bound(a, g, 0.1, costs.verify_cost(g + 1)))


def _forced_policy(rt):
    """An adaptive policy that believes verification is cheap, so it speculates with varying γ."""
    rt._adaptive = AdaptivePolicy(curve(per_token=0.05, c_seconds=0.05), rt.drafter.name, max_gamma=6, learn_costs=False)
    return rt


def test_greedy_equality_with_policy_on(tiny_gguf):
    target, draft = tiny_gguf("llama"), tiny_gguf("llama_draft")
    with ondevice.load(target, drafter="none") as rt:
        ref = rt.generate(PROMPT, max_tokens=48, temperature=0)
    with _forced_policy(ondevice.load(target, draft)) as rt:
        res = rt.generate(PROMPT, max_tokens=48, temperature=0, gamma="auto")
        assert res.tokens == ref.tokens
        assert res.stats.drafted > 0 and len(res.stats.gamma_counts) >= 2  # γ really varied
    with ondevice.load(target, drafter="ngram") as rt:  # real measured costs
        assert rt.generate(PROMPT, max_tokens=48, temperature=0, gamma="auto").tokens == ref.tokens


def test_sampled_law_with_policy_on(tiny_gguf, monkeypatch):
    from helpers import chisquare, exact_joint_law

    from ondevice import sampling

    target, draft = tiny_gguf("qwen2"), tiny_gguf("qwen2_draft")
    n = 1500
    with _forced_policy(ondevice.load(target, draft)) as rt:
        ids = rt.tokenize(PROMPT)
        params = sampling.SamplingParams(temperature=1.0, top_k=6, top_p=1.0, min_p=0.0)
        law = exact_joint_law(target, ids, params)

        def counts():
            c = {}
            for seed in range(n):
                key = tuple(rt.generate(ids, max_tokens=3, temperature=1.0, top_k=6, top_p=1.0, min_p=0.0, seed=seed,
                                        gamma="auto").tokens)
                c[key] = c.get(key, 0) + 1
            return c

        assert chisquare(counts(), law, n) > 1e-3
        assert rt.last_stats.drafted > 0
        monkeypatch.setattr(sampling, "residual", lambda p, q: p)
        monkeypatch.setattr(sampling, "residual_sparse", lambda ids, pr, qv, V: pr)  # the loop's sparse form
        assert chisquare(counts(), law, n) < 1e-4


def test_sampled_law_with_ngram_drafts(tiny_gguf, monkeypatch):
    """n-gram drafts are one-hot q: a guess x is kept with chance p(x), else the residual p − δ_x is
    sampled. The whole loop (drafter, policy, sparse verification) keeps the target's law."""
    from helpers import chisquare, exact_joint_law

    from ondevice import sampling

    target = tiny_gguf("qwen2")
    n = 1500
    with _forced_policy(ondevice.load(target, drafter="ngram", n_ctx=256)) as rt:
        # PROMPT, a token g, PROMPT's last two tokens again: the lookup guesses g, chosen as the target's
        # most likely next token in that very context, so guesses are often kept and sometimes rejected
        from ondevice.backends.llama import LlamaBackend

        start, g = rt.tokenize(PROMPT), 0
        probe = LlamaBackend(target, n_ctx=256)
        for _ in range(5):
            probe.rollback(0)
            g = int(np.argmax(probe.eval(start + [g] + start[-2:])[-1]))
        probe.close()
        ids = start + [g] + start[-2:]
        params = sampling.SamplingParams(temperature=1.0, top_k=6, top_p=1.0, min_p=0.0)
        eog = rt.target.is_eog
        law: dict = {}
        for seq, pr in exact_joint_law(target, ids, params).items():  # an answer ends at its first EOS
            end = next((i for i, t in enumerate(seq) if eog(t)), None)
            key = seq if end is None else (*seq[:end], "eos")
            law[key] = law.get(key, 0.0) + pr

        def counts():
            c, drafted, accepted = {}, 0, 0
            for seed in range(n):
                r = rt.generate(ids, max_tokens=3, temperature=1.0, top_k=6, top_p=1.0, min_p=0.0, seed=seed,
                                gamma="auto")
                key = (*r.tokens, "eos") if r.stats.stop_reason == "eos" else tuple(r.tokens)
                c[key] = c.get(key, 0) + 1
                drafted, accepted = drafted + r.stats.drafted, accepted + r.stats.accepted
            return c, drafted, accepted

        c, drafted, accepted = counts()
        assert chisquare(c, law, n) > 1e-3
        assert drafted > n and 0 < accepted < drafted  # drafts were made, kept and rejected
        monkeypatch.setattr(sampling, "residual", lambda p, q: p)
        monkeypatch.setattr(sampling, "residual_sparse", lambda ids, pr, qv, V: pr)  # a rejected guess stays possible
        assert chisquare(counts()[0], law, n) < 1e-4


def test_auto_is_default_and_reports_gamma_histogram(tiny_gguf, tmp_path, monkeypatch):
    from helpers import steady_probe

    monkeypatch.setenv("ONDEVICE_HOME", str(tmp_path))
    steady_probe(monkeypatch)  # a probe stalled by a loaded machine is (rightly) never cached
    with ondevice.load(tiny_gguf("llama"), drafter="ngram") as rt:
        res = rt.generate(PROMPT, max_tokens=24, temperature=0)
        assert res.stats.probe_seconds > 0  # measured once, at the first auto request
        assert sum(res.stats.gamma_counts.values()) == res.stats.target_forwards
        again = rt.generate(PROMPT, max_tokens=24, temperature=0)
        assert again.stats.probe_seconds == 0
    assert (tmp_path / "costs.json").is_file()


# -- spending cheap verification (issue 14) ---------------------------------------------------------------


def _shadow(policy, proposal, emitted, hint=1, rounds=40):
    """Plain steps (γ = 0) whose unused n-gram guess agreed with ``emitted`` as given."""
    for _ in range(rounds):
        policy.update(0, 0, hint, proposal, emitted)


def test_ngram_drafts_when_the_curve_is_flat_and_never_when_steep():
    flat = Costs({1: 1.0, 2: 1.15, 4: 1.63, 8: 2.93, 16: 3.88})  # IQ4_NL 1.5B target, measured (issue 14)
    steep = Costs({k: float(k) for k in (1, 2, 4, 8, 16)})  # verifying k tokens costs k decodes
    for alpha_pattern in ([1, 2, 3, 9], [1, 2, 9, 9]):  # guesses agree for 2–3 tokens, then not
        p_flat, p_steep = AdaptivePolicy(flat, "ngram"), AdaptivePolicy(steep, "ngram")
        _shadow(p_flat, [1, 2, 3, 4], alpha_pattern)
        _shadow(p_steep, [1, 2, 3, 4], alpha_pattern)
        assert p_flat.next_gamma(hint=1) >= 2
        assert all(p_steep.next_gamma(hint=h) == 0 for h in (0, 1, 4, 30))
    # even single guesses right 60 % of the time pay on the flat curve: 0.6 > RISK · (cost(2) − 1) = 0.26
    half = AdaptivePolicy(flat, "ngram")
    for i in range(60):
        half.update(0, 0, 1, [7], [7] if i % 5 < 3 else [8])
    assert half.next_gamma(hint=1) >= 1
    # ... and not on Q4_K_M's curve, where one more token costs more than half a decode (control)
    q4km = Costs({1: 1.0, 2: 1.6, 4: 3.14, 8: 5.30, 16: 6.08})
    half_k = AdaptivePolicy(q4km, "ngram")
    for i in range(60):
        half_k.update(0, 0, 1, [7], [7] if i % 5 < 3 else [8])
    assert half_k.next_gamma(hint=1) == 0


def test_plain_steps_teach_the_ngram_estimate_without_probes():
    flat = Costs({1: 1.0, 2: 1.15, 4: 1.63, 8: 2.93, 16: 3.88})
    p = AdaptivePolicy(flat, "ngram")
    feed(p, [(4, 0)] * 40, hint=2)  # drafts failed: the estimate for short matches collapses
    assert p.next_gamma(hint=2) == 0
    _shadow(p, [5, 6, 7, 8], [5, 6, 7, 8, 9], hint=2)  # but the unused guesses turn out right, step after step
    assert p.next_gamma(hint=2) >= 3
    # the same plain steps without the guesses teach nothing (control)
    q = AdaptivePolicy(flat, "ngram")
    feed(q, [(4, 0)] * 40, hint=2)
    feed(q, [(0, 0)] * 40, hint=2)
    assert q.next_gamma(hint=2) == 0


def test_gain_not_ratio_picks_gamma():
    from ondevice.policy import expected_gain

    flat = Costs({1: 1.0, 2: 1.15, 4: 1.63, 8: 2.93, 16: 3.88})
    alphas = [0.9] * 8
    gains = {g: expected_gain(alphas, g, 0.0, flat, risk=RISK) for g in range(9)}
    rates = {g: expected_rate(alphas, g, 0.0, flat) for g in range(1, 9)}
    p = AdaptivePolicy(flat, "ngram", max_gamma=8)
    p.guesses.cells[p.guesses.bucket(4)] = [[1.0, 0.9] for _ in range(6)]  # α = 0.9 at every position
    g = p.next_gamma(hint=4)
    assert g == max(gains, key=gains.get)
    assert g > max(rates, key=rates.get)  # the per-step ratio would stop earlier


def test_a_renamed_copy_resumes_after_a_long_accepted_step_but_not_after_two_differences():
    from ondevice.drafters import NgramDrafter

    src = list(range(100, 160))
    prompt = [1, 2, 3] + src + [7, 8]
    d = NgramDrafter()
    ctx = prompt + src[:10]
    guess, _ = d.propose(ctx, 32, None, None)
    assert guess == src[10:42] and d.guess == (10, True)  # copying the prompt
    ctx += src[10:30] + [999]  # one step kept 20 guessed tokens, then the target renamed one token
    guess, _ = d.propose(ctx, 8, None, None)
    assert guess == src[31:39]  # the copy goes on past the renamed token, aligned by position
    ctx += [998]  # ... but differs again at once: that was no rename, the copy has ended
    guess, _ = d.propose(ctx, 8, None, None)
    assert guess != src[32:40]


def test_a_guess_repeating_the_answer_is_told_from_one_copying_the_prompt():
    from ondevice.drafters import NgramDrafter

    d = NgramDrafter()
    ctx = [1, 2, 3, 4, 5]  # the prompt: the drafter sees this list first
    d.propose(ctx, 2, None, None)
    ctx += [50, 51, 52, 53, 54, 9, 50, 51, 52]  # the answer (extended in place, as the loop does) repeats itself
    assert d.propose(ctx, 2, None, None)[0] == [53, 54] and d.guess == (3, False)
    ctx += [53, 54, 1, 2, 3]  # ... then quotes the prompt
    assert d.propose(ctx, 2, None, None)[0] == [4, 5] and d.guess[1] is True


def test_the_verify_curve_past_its_last_point_is_never_cheaper_per_token():
    flat_end = Costs({1: 1.0, 2: 1.8, 12: 6.9, 16: 6.8})  # noise or a kernel's sweet spot: flat from 12 to 16
    vc = flat_end.verify_costs(33)
    assert vc[15] == 6.8 / 1.0 and vc[32] >= 6.8 * 33 / 16 - 1e-9  # not 6.8 + (6.8 − 6.9)/4 · 17


def test_a_probe_on_a_swamped_machine_is_retried_and_never_cached(tiny_gguf, monkeypatch, tmp_path):
    """Seen live: a probe under heavy load timed 2 tokens at 1/15 of 1 token; cached, it made every
    1-token draft look free for every later process (γ = 1 on every step of every request)."""
    from ondevice import costs
    from ondevice.backends.llama import LlamaBackend

    monkeypatch.setenv("ONDEVICE_HOME", str(tmp_path))
    b = LlamaBackend(tiny_gguf("llama"), n_ctx=256, threads=1)
    swamped = {1: 1.185, 2: 0.078, 3: 2.46, 4: 3.09}  # seconds, the cached entry seen
    calls = []

    def fake(target, ids, tokens, reps):
        calls.append(len(tokens))
        return swamped.get(len(tokens), 3.1) if len(calls) < 40 else 0.01 * (1 + 0.5 * (len(tokens) - 1))

    monkeypatch.setattr(costs, "_time_eval", fake)
    c = costs.measure(b, ks=(1, 2, 3, 4), reps=5, attempts=3)
    assert costs.plausible(c.target_seconds) and c.verify_cost(2) == pytest.approx(1.5)  # the third attempt
    # an implausible probe is used but not cached, and an implausible cached entry is measured again
    calls.clear()
    monkeypatch.setattr(costs, "_time_eval", lambda t, i, tokens, r: swamped.get(len(tokens), 3.1))
    bad = costs.cached_measure(b)
    assert not costs.plausible(bad.target_seconds) and not (tmp_path / "costs.json").exists()
    ks, ctx = costs.probe_shape(b)
    key = costs._key(b) + f"|probe {ctx}+{max(ks)}"
    (tmp_path / "costs.json").write_text(json.dumps({key: {"target_seconds": swamped, "draft_seconds": 0.0}}))
    monkeypatch.setattr(costs, "_time_eval", lambda t, i, tokens, r: 0.01 * len(tokens) ** 0.5)
    good = costs.cached_measure(b)
    assert costs.plausible(good.target_seconds) and good.target_seconds != {int(k): v for k, v in swamped.items()}
    assert json.loads((tmp_path / "costs.json").read_text())[key]["target_seconds"]["2"] == pytest.approx(0.01 * 2 ** 0.5)
    b.close()


def test_a_fixed_shape_backends_padded_prefill_is_plausible_and_cached(tiny_hf, monkeypatch, tmp_path):
    """A Core ML / MIL model runs a 4-token batch as one prefill padded to its chunk: that batch honestly
    costs like many decodes. Judged implausible, every probe ran three times and was never cached."""
    import math

    from ondevice import costs
    from ondevice.backends.static import ReferenceBackend

    monkeypatch.setenv("ONDEVICE_HOME", str(tmp_path))
    b = ReferenceBackend(tiny_hf["qwen2"], context=256, chunk=64)
    calls = []

    def padded(target, ids, tokens, reps):  # decodes below 4 tokens, else 64-wide prefills at 12 decodes each
        calls.append(len(tokens))
        k = len(tokens)
        return 0.01 * (k if k < 4 else 12 * math.ceil(k / 64))

    monkeypatch.setattr(costs, "_time_eval", padded)
    ks, _ = costs.probe_shape(b)
    c = costs.cached_measure(b)
    assert len(calls) == 1 + 7 * len(ks)  # the warm-up and one attempt of 7 reps
    assert c.target_seconds[4] == pytest.approx(0.12) and (tmp_path / "costs.json").exists()
    assert not costs.plausible(c.target_seconds)  # the same times from a batch-computing backend are a stall


def test_whole_file_writes_get_the_users_normal_permissions(tmp_path):
    import os

    from ondevice.atomic import write_text

    old = os.umask(0o022)
    try:
        write_text(tmp_path / "costs.json", "{}")
    finally:
        os.umask(old)
    assert (tmp_path / "costs.json").stat().st_mode & 0o777 == 0o644  # mkstemp alone leaves 0600
