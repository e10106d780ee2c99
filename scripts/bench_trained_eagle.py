"""The drafter ``train-heads`` trained (EAGLE-style) through the runtime, on held-out prompts by class: τ (tokens
per target pass, hardware-free) at fixed greedy chains of γ 3 and 5, against plain decoding's tokens (must be
equal, or differ only where a near tie flips within the target's own batch rounding: ``ondevice.bench.ties``) and
n-gram drafting; the draft's cost per token ÷ a target decode; decode speed ratios in one run. JSON.

    PYTHONPATH=$PWD python scripts/bench_trained_eagle.py MODEL [--drafter X.eagle.gguf | X.heads.safetensors]
        [--per-class 3] [--tokens 128]
        [--copy-min N] [--json OUT]

Modes: chains of γ 3 and 5, EAGLE-2 trees of ≤ 8 and ≤ 16 nodes, ``gamma="auto"`` (the policy, from the measured
verify curve: never slower than plain is its promise), n-gram γ 3; per mode τ, the speed ratio and the
acceptance by position (the share of drafting passes that kept ≥ i drafts); for chains the speed their τ implies
on the measured verify curve and draft cost (``modelled_speed``) and a perfect drafter's (``perfect_drafter_speed``,
the bound on this machine). ``--copy-min 0`` runs the draft alone,
without prompt-lookup copies (``ondevice.drafters.copies``; default: the drafter's own).

Held-out prompts are ``prompts.json``'s "heldout" set, never used in training.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

import ondevice
from ondevice.bench.ties import explain
from ondevice.bench.tools import emit_json
from ondevice.costs import cached_measure
from ondevice.heads import data, eagle_store
from ondevice.heads import store as heads_store
from ondevice.store import lookup


def _trees(drafter, on: bool) -> None:
    import dataclasses

    drafter.traits = dataclasses.replace(drafter.traits, trees=on)


def _cost(rt, reps: int = 15) -> dict:
    """A drafted token of the trained draft ÷ one target decode, interleaved (the machine's load cancels)."""
    d, t = [], []
    target, drafter = rt.target, rt.drafter
    ids = target.tokenize("def fibonacci(n):")
    target.rollback(0)
    target.eval(ids)
    from ondevice.drafters.heads import HeadsDrafter

    if isinstance(drafter, HeadsDrafter):  # Medusa heads: a numpy step, timed by the drafter itself
        for _ in range(reps):
            t0 = time.perf_counter()
            target.eval([int(ids[-1])])
            t.append(time.perf_counter() - t0)
        target.rollback(0)
        spt = drafter.seconds_per_token()
        return {"draft_ms": round(1e3 * spt, 3), "decode_ms": round(1e3 * float(np.median(t)), 3),
                "ratio": round(spt / float(np.median(t)), 4)}
    g = drafter.graph
    pre = np.zeros((1, g.n_embd), np.float32)
    base = g.n_past
    for i in range(reps):
        t0 = time.perf_counter()
        _, pre = g.decode([int(ids[-1])], pre, base + i)
        d.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        target.eval([int(ids[-1])])
        t.append(time.perf_counter() - t0)
    g.rollback(base)
    rt.reset()
    return {"draft_ms": round(1e3 * float(np.median(d)), 3), "decode_ms": round(1e3 * float(np.median(t)), 3),
            "ratio": round(float(np.median(d) / np.median(t)), 4)}


def _drafter_file(drafter, given: str | None, gguf: Path) -> tuple[str, dict]:
    """The file of the drafter the run loaded and its metadata: ``--drafter``, else the one ``draft="heads"`` chose
    (the EAGLE-style drafter stored for the target, or its Medusa heads where there is none)."""
    from ondevice.drafters.heads import HeadsDrafter

    medusa = isinstance(drafter, HeadsDrafter)
    p = Path(given) if given else heads_store.find(gguf) if medusa else eagle_store.find(gguf)
    return str(p), heads_store.read_meta(p) if medusa else eagle_store.read_meta(p)


def _by_position(counts: np.ndarray) -> list[float]:
    """Share of drafting passes that kept at least i drafts, i = 1.. (``accept_counts[i]``: passes keeping i)."""
    n = counts.sum()
    return [round(float(counts[i:].sum() / n), 3) for i in range(1, len(counts)) if counts[i:].sum()] if n > 0 else []


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--per-class", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--drafter", default=None, help="an EAGLE-3 GGUF or Medusa .heads.safetensors (default: the "
                    "EAGLE-style drafter train-heads stored for MODEL)")
    ap.add_argument("--copy-min", type=int, default=None, help="copies' match length (0: none; default: the drafter's)")
    a = ap.parse_args()
    path = lookup.resolve(a.model)
    gguf = path / "model.gguf" if path.is_dir() else path
    heldout = data.load_prompts()["heldout"]
    rows: dict = {}
    with ondevice.load(path, drafter="none", threads=a.threads) as plain, \
            ondevice.load(path, draft=a.drafter or "heads", threads=a.threads) as spec, \
            ondevice.load(path, drafter="ngram", threads=a.threads) as ngram:
        drafter, meta = _drafter_file(spec.drafter, a.drafter, gguf)  # before the runs: a report that can be written
        cost = _cost(spec)
        if a.copy_min is not None:
            spec.drafter.copies.copy_min = a.copy_min
        copy_min = spec.drafter.copies.copy_min
        traits = spec.drafter.traits
        spec.chat([{"role": "user", "content": "hi"}], max_tokens=2, temperature=0, gamma="auto")  # the cost probe,
        spec.reset()  # once, outside the measured runs
        curve = cached_measure(spec.target, None, attempts=1)  # the verify curve the policy read (cached)
        for cls, prompts in sorted(heldout.items()):
            acc = {k: {"tokens": 0, "passes": 0, "seconds": 0.0, "draft_seconds": 0.0, "counts": np.zeros(17)}
                   for k in ("plain", "eagle3", "eagle5", "tree8", "tree16", "auto", "ngram3")}
            equal, divergences = 0, []
            for j, text in enumerate(prompts[: a.per_class]):
                msgs = [{"role": "user", "content": text}]
                ids = plain.render_chat(msgs)
                ref = plain.generate(ids, max_tokens=a.tokens, temperature=0)
                runs = {"plain": ref}
                _trees(spec.drafter, False)
                runs["eagle3"] = spec.chat(msgs, max_tokens=a.tokens, temperature=0, gamma=3)
                runs["eagle5"] = spec.chat(msgs, max_tokens=a.tokens, temperature=0, gamma=5)
                _trees(spec.drafter, True)  # best-first trees of ≤ 8 nodes
                runs["tree8"] = spec.chat(msgs, max_tokens=a.tokens, temperature=0, gamma=8)
                runs["tree16"] = spec.chat(msgs, max_tokens=a.tokens, temperature=0, gamma=16)
                spec.drafter.traits = traits  # the drafter as loaded: the policy picks chain, tree or plain
                runs["auto"] = spec.chat(msgs, max_tokens=a.tokens, temperature=0, gamma="auto")
                runs["ngram3"] = ngram.chat(msgs, max_tokens=a.tokens, temperature=0, gamma=3)
                for k, r in runs.items():
                    if r.tokens == ref.tokens:
                        equal += k != "plain"
                    else:
                        target = (ngram if k == "ngram3" else spec).target
                        divergences.append({"mode": k, "prompt": j, **explain(target, ids, ref.tokens, r.tokens)})
                    acc[k]["tokens"] += r.stats.tokens
                    acc[k]["passes"] += r.stats.target_forwards
                    acc[k]["seconds"] += r.stats.total_seconds - r.stats.prompt_seconds
                    acc[k]["draft_seconds"] += r.stats.draft_seconds
                    c = np.asarray(list(r.stats.accept_counts)[:17], float)
                    acc[k]["counts"][: len(c)] += c
                    acc[k]["counts"][0] -= r.stats.plain_steps  # accept_counts[0] holds plain steps too
                for rt in (plain, spec, ngram):  # explain() overwrote a cache: the next prompt starts afresh
                    rt.reset()
            rows[cls] = {k: {"tau": round(v["tokens"] / max(1, v["passes"]), 3),
                             "speed_vs_plain": round(acc["plain"]["seconds"] / max(1e-9, v["seconds"]), 3),
                             "acceptance_by_position": _by_position(v["counts"])}
                         for k, v in acc.items()}
            for k, v in acc.items():  # drafting's measured share of a pass, in target decodes
                rows[cls][k]["draft_per_pass"] = round(v["draft_seconds"] / max(1, v["passes"]) / (cost["decode_ms"] / 1e3), 3)
            for k, g in (("eagle3", 3), ("eagle5", 5)):  # a pass: γ drafted tokens, then a verify of γ + 1
                per_pass = curve.verify_cost(g + 1) + g * cost["ratio"]
                rows[cls][k]["modelled_speed"] = round(rows[cls][k]["tau"] / per_pass, 3)
                rows[cls][k]["perfect_drafter_speed"] = round((g + 1) / per_pass, 3)
            for k, n in (("tree8", 8), ("tree16", 16)):  # a tree's drafting: one draft decode per expanded node,
                # measured (its nodes ≤ n, so c(n + 1) bounds its verify from above)
                rows[cls][k]["modelled_speed"] = round(rows[cls][k]["tau"] / (curve.verify_cost(n + 1) + rows[cls][k]["draft_per_pass"]), 3)
            rows[cls]["greedy"] = {"equal_runs": equal, "runs": 6 * min(a.per_class, len(prompts)),
                                   "divergences": divergences}
    emit_json({"model": path.name, "drafter": drafter, "meta": meta,
               "greedy_unexplained": sum(not d["explained"] for r in rows.values() for d in r["greedy"]["divergences"]),
               "draft_cost": cost, "verify_cost": {k: round(curve.verify_cost(k), 3) for k in (2, 4, 6, 9, 17)}, "copy_min": copy_min, "by_class": rows, "per_class": a.per_class, "max_tokens": a.tokens}, a.json)


if __name__ == "__main__":
    main()
