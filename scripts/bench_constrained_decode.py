"""Constrained JSON answers: n-gram drafting vs plain constrained decoding, side by side in one run.

For each schema (flat record, nested list, enum-heavy) the chat prompt shows one example record and asks
for another; each answer is generated greedily under the schema, plain (γ = 0) and with n-gram drafting,
interleaved rep by rep so load changes hit both alike. Reports tokens per target pass (τ), decode tok/s,
the speed ratio, that both answers are identical and valid (jsonschema), and prints one JSON document.

    PYTHONPATH=$PWD python scripts/bench_constrained_decode.py --out docs/bench-constrained-ngram-smollm2.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_constrain import ENUMS, FLAT, NESTED  # noqa: E402

from ondevice.bench.tools import emit_json

EXAMPLES = {
    "flat_record": (FLAT, {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "active": True},
                    "Now the record for Alan Turing, aged 41, email alan@example.org, not active."),
    "nested_list": (NESTED, {"order": 1042, "items": [{"sku": "A-17", "qty": 2, "tags": ["red", "sale"]},
                                                      {"sku": "B-3", "qty": 1, "tags": ["blue"]}]},
                    "Now order 1043: three of A-17 tagged red, one C-9 tagged green and sale."),
    "enum_heavy": (ENUMS, {"color": "magenta", "size": "XL", "unit": "cm", "day": "friday"},
                   "Now a small blue item measured in mm, delivered on monday."),
}


def _messages(schema, example, ask):
    return [{"role": "system", "content": "You answer with one JSON object only."},
            {"role": "user", "content": f"Schema: {json.dumps(schema)}\nExample record: {json.dumps(example)}\n{ask}"}]


def main() -> None:
    import jsonschema

    import ondevice

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--gamma", default="auto", help="n-gram γ: 'auto' or an integer")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    gamma = a.gamma if a.gamma == "auto" else int(a.gamma)
    rows = {}
    with ondevice.load(a.model, drafter="ngram", threads=a.threads) as rt:
        rt.generate("warm up", max_tokens=4, temperature=0, gamma=gamma)  # the cost probe of gamma="auto", once
        for name, (schema, example, ask) in EXAMPLES.items():
            rf = {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
            msgs = _messages(schema, example, ask)
            runs = {"plain": [], "ngram": [], "plain_unconstrained": [], "ngram_unconstrained": []}
            texts = {}
            for _ in range(a.reps):
                for mode in runs:
                    kw = dict(temperature=0, max_tokens=a.max_tokens, gamma=0 if mode.startswith("plain") else gamma)
                    if not mode.endswith("unconstrained"):
                        kw["response_format"] = rf
                    res = rt.chat(msgs, **kw)
                    texts[mode] = res.tokens, res.text
                    s = res.stats
                    runs[mode].append({"tokens": s.tokens, "tau": s.mean_accepted_per_forward,
                                       "decode_tps": s.decode_tokens_per_second, "stop": s.stop_reason})
            valid = True
            try:
                jsonschema.validate(json.loads(texts["plain"][1]), schema)
            except (ValueError, jsonschema.ValidationError):
                valid = False

            def med(mode, key, runs=runs):
                return round(statistics.median(r[key] for r in runs[mode]), 3)

            rows[name] = {
                "answer": texts["plain"][1],
                "valid": valid,
                "ngram_equals_plain": texts["ngram"][0] == texts["plain"][0],
                "tokens": runs["plain"][0]["tokens"],
                "stop": runs["plain"][0]["stop"],
                **{f"{m}_{k}": med(m, k) for m in runs for k in ("tau", "decode_tps")},
                "speed_ratio_ngram_vs_plain": round(med("ngram", "decode_tps") / med("plain", "decode_tps"), 3),
                "speed_ratio_unconstrained": round(med("ngram_unconstrained", "decode_tps")
                                                   / med("plain_unconstrained", "decode_tps"), 3),
                "runs": runs,
            }
            print(name, {k: v for k, v in rows[name].items() if k != "runs"}, file=sys.stderr)
    doc = {"what": "greedy constrained JSON answers, n-gram drafting vs plain, interleaved (median of reps)",
           "model": a.model, "gamma": gamma, "reps": a.reps, "max_tokens": a.max_tokens,
           "machine": {"cpu_count": __import__("os").cpu_count(), "platform": platform.platform()},
           "schemas": rows}
    emit_json(doc, a.out)


if __name__ == "__main__":
    main()
