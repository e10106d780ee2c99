"""Heads vs n-gram on held-out prompts: τ of a fixed greedy chain (heads alone, and as the drafter runs:
prompt-lookup copies first), of best-first trees, acceptance by position, the oracle (every draft right), head cost ÷ target decode, live checks. JSON.

    OPENBLAS_NUM_THREADS=1 PYTHONPATH=$PWD python scripts/bench_heads.py MODEL [--heads FILE] [--live 2] --json OUT

Needs held-out answers recorded by ``scripts/record_heads.py MODEL --part heldout`` (prompts never used
in training). τ (tokens per target pass) of a greedy chain is computed offline from the recorded
answers and their hidden states, which is exact for greedy decoding: a verify pass accepts exactly the
drafts that equal the target's tokens. n-gram drafting (``NgramDrafter``, γ fixed) is walked over the
same answers. Head cost and target decode are timed interleaved, in one process (a ratio, so the
machine's load cancels). ``--live N`` runs N held-out prompts per class through ``ondevice.load``
(heads, n-gram, plain; greedy, γ = 3) and checks that speculative tokens equal plain ones.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from ondevice.bench.tools import emit_json
from ondevice.drafters.heads import HeadsDrafter
from ondevice.heads import data, fit, store
from ondevice.sampling import SamplingParams
from ondevice.store import catalog, lookup

GREEDY = SamplingParams(temperature=0.0)


def ngram_tau(recs: list[data.Record], gamma: int) -> dict:
    """τ of greedy n-gram drafting with a fixed γ, walked over recorded greedy answers (exact): the heads
    drafter's walk with every copy taken and no heads."""
    flat = fit.Flat.of(recs)
    return fit.offline_tau_copy(np.zeros(len(flat.H), np.int64), flat, recs, gamma, 1)


def head_cost(path: Path, drafter_heads, recs: list[data.Record], reps: int = 30) -> dict:
    """Median time of a K-step heads chain (greedy and T = 0.7) ÷ a target decode, interleaved."""
    from ondevice.backends.llama import LlamaBackend

    b = LlamaBackend(path, n_ctx=1024, threads=1)
    try:
        dr = HeadsDrafter(b, *drafter_heads, copy_min=0)  # the heads themselves, not a copy
        ids = [int(t) for t in recs[0].prompt]
        b.eval(ids[:-1], logits="last")
        ctx = list(ids)
        sampled = SamplingParams(temperature=0.7, top_p=0.9, top_k=0, min_p=0.0)
        rng = np.random.default_rng(0)
        tg, tp, ts, tt = [], [], [], []
        for _ in range(reps):
            t0 = time.perf_counter()
            lg = b.eval([ctx[-1]], logits="all")[-1]
            t1 = time.perf_counter()
            ctx.append(int(np.argmax(lg)))  # pending; the row just evaluated feeds the heads
            dr.propose(ctx, dr.heads.K, GREEDY, rng)
            t2 = time.perf_counter()
            dr.propose(ctx, dr.heads.K, sampled, rng)
            t3 = time.perf_counter()
            dr.propose_tree(ctx, 8, GREEDY, rng)
            tt.append(time.perf_counter() - t3)
            tg.append(t1 - t0)
            tp.append(t2 - t1)
            ts.append(t3 - t2)
            assert dr.target.hidden(len(ctx) - 2) is not None
        med = float(np.median(tg))
        return {"target_decode_ms": round(med * 1e3, 2), "heads_chain_greedy_ms": round(float(np.median(tp)) * 1e3, 2),
                "heads_chain_sampled_ms": round(float(np.median(ts)) * 1e3, 2),
                "ratio_greedy": round(float(np.median(tp)) / med, 4), "ratio_sampled": round(float(np.median(ts)) / med, 4),
                "heads_tree8_ms": round(float(np.median(tt)) * 1e3, 2), "ratio_tree8": round(float(np.median(tt)) / med, 4),
                "per_draft_token_ratio": round(float(np.median(tp)) / med / dr.heads.K, 4), "reps": reps}
    finally:
        b.close()


def live(path: Path, heads_file: Path, prompts: list[tuple[str, str]], max_tokens: int, gamma: int) -> list[dict]:
    """Greedy runs through the runtime: heads, n-gram and plain; speculative tokens must equal plain ones."""
    import ondevice

    out = []
    with ondevice.load(path, draft=heads_file, threads=1) as h, ondevice.load(path, drafter="ngram", threads=1) as g:
        for cls, text in prompts:
            ids = h.render_chat([{"role": "user", "content": text}])
            row = {"class": cls, "prompt": text}
            plain = h.generate(ids, max_tokens=max_tokens, temperature=0, gamma=0)
            for name, rt in (("heads", h), ("ngram", g)):
                rt.reset()
                r = rt.generate(ids, max_tokens=max_tokens, temperature=0, gamma=gamma)
                s = r.stats
                row[name] = {"tau": round(s.mean_accepted_per_forward, 3), "tokens": s.tokens, "target_passes": s.target_forwards,
                             "acceptance": round(s.acceptance_rate, 3), "decode_tok_s": round(s.decode_tokens_per_second, 2),
                             "same_tokens_as_plain": r.tokens == plain.tokens}
            row["plain_decode_tok_s"] = round(plain.stats.decode_tokens_per_second, 2)
            out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--heads", default=None, help="heads file (default: the one stored for the model)")
    ap.add_argument("--gamma", type=int, default=3)
    ap.add_argument("--copy-min", type=int, default=HeadsDrafter.COPY_MIN,
                    help="heads_with_copies: a copy drafts the chain when this many tokens of its match agree")
    ap.add_argument("--live", type=int, default=1, help="held-out prompts per class run live (0 = none)")
    ap.add_argument("--live-tokens", type=int, default=64)
    ap.add_argument("--tree-nodes", type=lambda v: [int(x) for x in v.split(",")], default=[4, 8],
                    help="best-first tree sizes (drafted nodes) measured offline, comma-separated")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    path = lookup.resolve(a.model)
    work = catalog.home() / "heads" / "work" / store.target_sha256(path)[:16]
    recs = [data.load_record(p) for p in sorted((work / "heldout").glob("rec-*.npz"))]
    heads_file = Path(a.heads) if a.heads else store.find(path)
    heads, meta = store.load(heads_file, path)
    inv = heads.index(int(meta["target_vocab_size"]))
    res = {"model": path.name, "heads_file": str(heads_file), "gamma": a.gamma, "copy_min": a.copy_min,
           "heads": {k: meta.get(k) for k in ("K", "rank", "draft_vocab_size", "hidden_size", "training_tokens", "seed",
                                               "record_seconds", "fit_seconds", "tau_heldout_greedy_chain")},
           "heldout": {}}
    for cls in sorted({r.cls for r in recs}) + ["all"]:
        sub = [r for r in recs if cls in ("all", r.cls)]
        flat = fit.Flat.of(sub)
        hits = fit.chain_hits(heads, flat, inv, K=a.gamma)
        ans = np.concatenate([r.tokens[1:] for r in sub])
        drafting = max(1, int(np.sum(flat.left >= 1)))
        res["heldout"][cls] = {"answers": len(sub), "tokens": int(len(flat.H)), "heads": fit.offline_tau(hits, flat),
                               "heads_with_copies": fit.offline_tau_copy(hits, flat, sub, a.gamma, a.copy_min),
                               "heads_acceptance_by_position": [round(float(np.sum(hits >= i)) / drafting, 4)
                                                                for i in range(1, a.gamma + 1)],
                               **{f"heads_tree_{n}": fit.offline_tau(fit.tree_hits(heads, flat, inv, n), flat)
                                  for n in a.tree_nodes},
                               "oracle_chain": fit.offline_tau(np.full(len(flat.H), a.gamma), flat),
                               "ngram": ngram_tau(sub, a.gamma),
                               "draft_vocab_coverage": round(float(np.mean(np.isin(ans, heads.vocab))), 4)}
    res["head_cost"] = head_cost(path, (heads, meta), recs)
    if a.live:
        h = data.load_prompts()["heldout"]
        prompts = [(c, h[c][i]) for c in sorted(h) for i in range(min(a.live, len(h[c])))]
        res["live"] = live(path, heads_file, prompts, a.live_tokens, a.gamma)
    emit_json(res, a.json, indent=1)


if __name__ == "__main__":
    main()
