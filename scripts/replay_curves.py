"""Replay recorded greedy answers under a verify curve: the n-gram oracle and the ``auto`` policy, per class.

    python scripts/replay_curves.py ANSWERS.json [MORE.json ...] [--curve "name=2:1.85,4:2.77,..."] [--shared]
        [--json OUT.json]

ANSWERS are ``ondevice bench --ngram`` JSON documents (their greedy runs carry prompt and answer ids) or
answer files like docs/answers/*.json ({"answers": [{"id", "class", "prompt_ids", "answer_ids"}]}).
Each curve is ``name=k:cost(k),...`` in plain decodes (cost(1) = 1); the default is the idle two-thread
curve of Qwen2.5-Coder-1.5B IQ4_NL on the 2-core build machine. Per class, the speedups are total tokens ÷
total modelled time (long answers weigh more, as they do for a user). ``--shared`` replays every answer
with one policy object in suite order, as the runtime keeps one; its guess estimates restart from the priors
at every request (``AdaptivePolicy.restart``) and the replay does not refine the curve, so the results
equal those of a fresh policy per answer (the default). Timing-free: acceptance is a fact of each greedy
answer, so this isolates the policy from machine noise.
"""

from __future__ import annotations

import argparse
import copy
import json

from ondevice.bench.oracle import guesses, oracle_time, replay_policy
from ondevice.costs import Costs
from ondevice.policy import AdaptivePolicy

IDLE_QWEN_IQ4NL = "qwen-iq4_nl-2t=2:1.85,4:2.77,8:5.25,12:6.88,16:6.82,24:10.62,32:12.49"
ORDER = ("edit", "code", "summary", "chat")


def parse(spec: str) -> tuple[str, Costs]:
    name, _, pts = spec.partition("=")
    curve = {1: 1.0} | {int(k): float(v) for k, v in (p.split(":") for p in pts.split(","))}
    return name, Costs(curve)


def load_answers(paths: list[str]) -> list[tuple[str, str, list[int], list[int]]]:
    """(class, prompt id, prompt ids, answer ids) of every distinct greedy answer in the files."""
    out, seen = [], set()
    for path in paths:
        doc = json.loads(open(path).read())
        rows = doc.get("answers") or [r for r in doc.get("runs", []) if r.get("answer_ids")]
        for r in rows:
            key = (path, r.get("id") or r.get("prompt_id"))
            if key in seen or not r["answer_ids"]:
                continue
            seen.add(key)
            out.append((r["class"], key[1], r["prompt_ids"], r["answer_ids"]))
    return sorted(out, key=lambda a: ORDER.index(a[0]) if a[0] in ORDER else len(ORDER))


def replay(answers, costs: Costs, shared: bool = False) -> dict:
    """{class: {tokens, oracle, policy, policy_over_oracle, answers}} under one curve."""
    shared_policy = AdaptivePolicy(copy.deepcopy(costs), "ngram", learn_costs=False) if shared else None
    acc: dict[str, list] = {}
    for cls, _, prompt, answer in answers:
        t_oracle, _ = oracle_time(guesses(prompt, answer), costs)
        r = replay_policy(prompt, answer, costs, policy=shared_policy)
        a = acc.setdefault(cls, [0, 0.0, 0.0, 0])
        a[0] += len(answer)
        a[1] += t_oracle
        a[2] += len(answer) / r["policy_speedup"]
        a[3] += 1
    return {cls: {"tokens": n, "oracle": round(n / to, 3), "policy": round(n / tp, 3),
                  "policy_over_oracle": round(to / tp, 3), "answers": k} for cls, (n, to, tp, k) in acc.items()}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--curve", action="append", help="name=k:cost(k),... (repeatable)")
    ap.add_argument("--shared", action="store_true", help="one policy object for all answers, in suite order (it restarts at every answer, as in the runtime: the same results as fresh ones)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    answers = load_answers(args.files)
    out = {}
    for spec in args.curve or [IDLE_QWEN_IQ4NL]:
        name, costs = parse(spec)
        out[name] = replay(answers, costs, args.shared)
        for cls, r in out[name].items():
            print(f"{name:>16} {cls:>8}: oracle {r['oracle']:.2f}×  policy {r['policy']:.2f}×  "
                  f"policy/oracle {r['policy_over_oracle']:.2f}  ({r['answers']} answers, {r['tokens']} tokens)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"files": args.files, "shared_policy": args.shared, "curves": out}, f, indent=1)
    return out


if __name__ == "__main__":
    main()
