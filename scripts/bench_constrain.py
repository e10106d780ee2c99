"""Choose the constraint library by measurement: llguidance vs outlines-core (xgrammar: see ``unavailable``).

For each model's real vocabulary (read through ondevice's own llama.cpp backend) it measures, per library:
the one-time tokenizer/vocabulary build, the per-request compile of each constraint (JSON schemas, a
regex, a grammar), and the per-token mask time while walking a valid answer's tokens (mask, then
advance), plus a rollback. Prints one JSON document (and writes it with --out).

    PYTHONPATH=$PWD python scripts/bench_constrain.py smollm2-135m-instruct qwen2.5-coder-0.5b-instruct \
        --out docs/bench-constrain-libraries.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np

from ondevice.bench.tools import emit_json

FLAT = {"type": "object", "additionalProperties": False, "required": ["name", "age", "email", "active"],
        "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
                       "email": {"type": "string"}, "active": {"type": "boolean"}}}
NESTED = {"type": "object", "additionalProperties": False, "required": ["order", "items"],
          "properties": {"order": {"type": "integer"},
                         "items": {"type": "array", "minItems": 1, "items": {
                             "type": "object", "additionalProperties": False, "required": ["sku", "qty", "tags"],
                             "properties": {"sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1},
                                            "tags": {"type": "array", "items": {"type": "string"}}}}}}}
COLORS = ["red", "green", "blue", "cyan", "magenta", "yellow", "black", "white"]
ENUMS = {"type": "object", "additionalProperties": False, "required": ["color", "size", "unit", "day"],
         "properties": {"color": {"enum": COLORS}, "size": {"enum": ["XS", "S", "M", "L", "XL", "XXL"]},
                        "unit": {"enum": ["mm", "cm", "m", "km", "in", "ft"]},
                        "day": {"enum": ["monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday"]}}}
REGEX = r"\d{4}-\d{2}-\d{2}( \d{2}:\d{2})? (INFO|WARN|ERROR): [a-z ]{1,40}"
GBNF = r'''root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= number | "(" expr ")"
number ::= [0-9]+
'''

SEP = {"separators": (", ", ": ")}
CASES = {  # name → (kind, spec, a valid answer)
    "json_flat": ("json_schema", FLAT, json.dumps({"name": "Ada Lovelace", "age": 36, "email": "ada@example.org",
                                                   "active": True}, **SEP)),
    "json_nested": ("json_schema", NESTED, json.dumps({"order": 1042, "items": [
        {"sku": "A-17", "qty": 2, "tags": ["red", "sale"]}, {"sku": "B-3", "qty": 1, "tags": []},
        {"sku": "C-99", "qty": 12, "tags": ["bulk"]}]}, **SEP)),
    "json_enums": ("json_schema", ENUMS, json.dumps({"color": "magenta", "size": "XL", "unit": "cm", "day": "friday"}, **SEP)),
    "regex_log": ("regex", REGEX, "2026-12-01 15:34 WARN: disk almost full"),
    "gbnf_arith": ("grammar", GBNF, "(12+3)*4-56/7"),
}


def _vocab(backend):
    """Token bytes as ondevice's constrain module sees them (specials marked with 0xFF) and the EOS ids."""
    from ondevice.constrain import _Vocab

    return _Vocab(backend)


class LLG:
    name = "llguidance"

    def __init__(self, backend):
        import llguidance

        from ondevice.constrain import tokenizer_for

        self.version = llguidance.__version__
        t0 = time.perf_counter()
        self.tok = tokenizer_for(backend)
        self.build_s = time.perf_counter() - t0

    def compile(self, kind, spec):
        from ondevice.constrain import Constraint, grammar_text

        rf = {"json_schema": {"type": "json_schema", "json_schema": {"schema": spec}},
              "regex": {"type": "regex", "regex": spec}}.get(kind)
        text = grammar_text(rf, None) if rf else grammar_text(None, spec)
        return Constraint(self.tok, text)

    def walk(self, c, tokens):
        times = []
        for t in tokens:
            t0 = time.perf_counter()
            m = c.allowed()
            times.append(time.perf_counter() - t0)
            assert m[t], f"llguidance refused token {t}"
            c.advance([t])
        assert c.is_accepting()
        t0 = time.perf_counter()
        c.rollback(len(tokens) // 2)
        return times, time.perf_counter() - t0


class Outlines:
    name = "outlines-core"

    def __init__(self, backend, vocab):
        import importlib.metadata

        import outlines_core as oc

        self.version = importlib.metadata.version("outlines_core")
        self.V = backend.vocab_size
        t0 = time.perf_counter()
        groups: dict[bytes, list[int]] = {}
        eos = set(vocab.eos_ids)
        for i, b in enumerate(vocab.tokens):
            if i not in eos and b and not b.startswith(b"\xff"):
                groups.setdefault(b, []).append(i)
        self.vocab = oc.Vocabulary(vocab.eos_ids[0], groups)
        self.build_s = time.perf_counter() - t0

    def compile(self, kind, spec):
        import outlines_core as oc
        from outlines_core.json_schema import build_regex_from_schema

        if kind == "grammar":
            return None  # regular languages only: no context-free grammars
        rx = build_regex_from_schema(json.dumps(spec), whitespace_pattern=r" ?") if kind == "json_schema" else spec
        return oc.Guide(oc.Index(rx, self.vocab), max_rollback=4096)

    def walk(self, g, tokens):
        mask = np.zeros((self.V + 31) // 32, dtype=np.int32)
        times = []
        for t in tokens:
            t0 = time.perf_counter()
            g.write_mask_into(mask.ctypes.data, mask.size, 4)
            m = np.unpackbits(mask.view(np.uint8), bitorder="little")[: self.V].astype(bool)
            times.append(time.perf_counter() - t0)
            assert m[t], f"outlines-core refused token {t}"
            g.advance(t, return_tokens=False)
        assert g.is_finished() or True
        t0 = time.perf_counter()
        g.rollback_state(len(tokens) // 2)
        return times, time.perf_counter() - t0


def bench_model(name: str, reps: int) -> dict:
    from ondevice.backends.llama import LlamaBackend
    from ondevice.store.lookup import resolve

    backend = LlamaBackend(resolve(name), n_ctx=256)
    try:
        vocab = _vocab(backend)
        libs = [LLG(backend), Outlines(backend, vocab)]
        out = {"model": name, "vocab_size": backend.vocab_size, "eos_ids": vocab.eos_ids, "libraries": {}}
        for lib in libs:
            res = {"version": lib.version, "vocab_build_s": round(lib.build_s, 4), "cases": {}}
            for case, (kind, spec, answer) in CASES.items():
                tokens = backend.tokenize(answer, add_bos=False, special=False)
                compile_s, mask_us, rollback_s, err = [], [], [], None
                for _ in range(reps):
                    try:
                        t0 = time.perf_counter()
                        c = lib.compile(kind, spec)
                        compile_s.append(time.perf_counter() - t0)
                        if c is None:
                            err = "unsupported (regular languages only)"
                            break
                        times, rb = lib.walk(c, tokens)
                    except Exception as e:  # noqa: BLE001 - recorded, not hidden
                        err = f"{type(e).__name__}: {e}"[:300]
                        break
                    mask_us += [t * 1e6 for t in times]
                    rollback_s.append(rb)
                res["cases"][case] = {"error": err} if err else {
                    "tokens": len(tokens),
                    "compile_ms_median": round(statistics.median(compile_s) * 1e3, 2),
                    "compile_ms_first": round(compile_s[0] * 1e3, 2),
                    "mask_us_median": round(statistics.median(mask_us), 1),
                    "mask_us_mean": round(statistics.fmean(mask_us), 1),
                    "mask_us_max": round(max(mask_us), 1),
                    "rollback_half_us": round(statistics.median(rollback_s) * 1e6, 1),
                }
            out["libraries"][lib.name] = res
        return out
    finally:
        backend.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+", help="catalog names or GGUF paths")
    ap.add_argument("--reps", type=int, default=3, help="compiles and walks per case (median reported)")
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    a = ap.parse_args()
    doc = {
        "what": "per-request compile and per-token mask time of constraint libraries on real vocabularies",
        "machine": {"cpu_count": __import__("os").cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version()},
        "unavailable": {"xgrammar": "requires torch, transformers and triton at install (xgrammar 0.2.9 wheel "
                                    "metadata; `import xgrammar` imports torch): gigabytes of dependencies for an "
                                    "on-device runtime, so not measured",
                        "llama.cpp grammar (llama-cpp-python)": "GBNF only, and tied to the llama.cpp backend while "
                                                                "drafters and targets may be MLX / Core ML / n-gram"},
        "models": [bench_model(m, a.reps) for m in a.models],
    }
    emit_json(doc, a.out)


if __name__ == "__main__":
    main()
