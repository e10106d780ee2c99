"""One command for a Mac (macOS 15+): Core ML's own runtime against the MIL interpreter, on SmolLM2.

    python scripts/macos_check.py [--model smollm2-135m-instruct] [--out macos_check.json]

Converts the model to Core ML (or reuses ``--work``), then runs the same token ids through Core ML
(``CoreMLBackend``: compiled once, CPU_AND_NE by default) and through the MIL interpreter
(``MILBackend``: the package's program in numpy) and compares:

- logits of a 64-token prefill and 10 decodes (top-1 agreement, max |Δ| / max |logit|);
- the KV states after the prefill and after a rollback + 5 different decodes (where coremltools has
  ``MLState.read_state``), over the written slots;
- where each op is planned to run (``MLComputePlan``: ANE / GPU / CPU op counts per function);
- draft speed: single-token decodes per second on Core ML, and prefill tokens per second.

Writes everything to a JSON report and prints a summary. Exit status 1 when Core ML and the
interpreter disagree beyond fp16 noise (top-1 < 0.9 or relative error > 0.05).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MIN_TOP1, MAX_REL_ERR = 0.9, 0.05


def compare(a: np.ndarray, b: np.ndarray) -> dict:
    """Top-1 agreement and max |a - b| / max |b| of two logit (or state) arrays."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    out = {"max_rel_err": float(np.abs(a - b).max() / max(float(np.abs(b).max()), 1e-6))}
    if a.ndim == 2:
        out["top1"] = float((a.argmax(-1) == b.argmax(-1)).mean())
    return out


def compare_states(coreml, mil, n: int) -> dict | None:
    """Per state, the relative difference over the first ``n`` written slots; None without read_state."""
    if not hasattr(coreml.state, "read_state"):
        return None
    worst = 0.0
    for name, ours in mil.state.items():
        theirs = coreml.read_state(name).reshape(ours.shape)
        worst = max(worst, compare(theirs[:, :n], ours[:, :n])["max_rel_err"])
    return {"states": len(mil.state), "slots": n, "max_rel_err": worst}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="catalog name, GGUF file or HF checkpoint dir")
    ap.add_argument("--work", type=Path, default=Path("macos_check_model"), help="Core ML directory (converted if absent)")
    ap.add_argument("--compress", default="int4", choices=("int4", "palettize4", "none"))
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--decodes", type=int, default=64, help="single-token decodes timed for the draft speed")
    ap.add_argument("--out", type=Path, default=Path("macos_check.json"))
    args = ap.parse_args()

    major = int((platform.mac_ver()[0] or "0").split(".")[0])
    if sys.platform != "darwin" or major < 15:
        print(f"macos_check: needs macOS 15 or later (this is {sys.platform} {platform.mac_ver()[0]})", file=sys.stderr)
        return 2
    from converters import convert
    from ondevice.backends.coreml import CoreMLBackend
    from ondevice.backends.mil import MILBackend
    from ondevice.store import lookup

    report: dict = {"model": args.model, "macos": platform.mac_ver()[0], "machine": platform.machine(),
                    "compress": args.compress, "context": args.context}
    if not (args.work / "manifest.json").is_file():
        t = time.perf_counter()
        summary = convert(lookup.resolve(args.model), to="coreml", out=args.work, context=args.context,
                          compress=args.compress)
        report["convert"] = {"seconds": round(time.perf_counter() - t, 1), "size_bytes": summary["size_bytes"],
                             "interpreter_check": summary["verified"]}
    t = time.perf_counter()
    coreml = CoreMLBackend(args.work, plan_devices=True)
    report["coreml_load_seconds"] = round(time.perf_counter() - t, 2)
    report["compute_units"] = coreml.compute_units
    report["op_devices"] = coreml.op_devices
    mil = MILBackend(args.work)

    text = (ROOT / "README.md").read_text()
    ids = coreml.tokenize(text)[: 64 + 10 + 5 + 5]
    prefill, decodes, redo = ids[:64], ids[64:74], ids[79:84]
    t = time.perf_counter()
    ours_prefill = coreml.eval(prefill)
    prefill_s = time.perf_counter() - t
    theirs_prefill = mil.eval(prefill)
    report["prefill"] = compare(ours_prefill, theirs_prefill)
    report["state_after_prefill"] = compare_states(coreml, mil, 64)
    got = np.concatenate([coreml.eval([tok]) for tok in decodes])
    want = np.concatenate([mil.eval([tok]) for tok in decodes])
    report["decode"] = compare(got, want)
    coreml.rollback(69)
    mil.rollback(69)
    got = np.concatenate([coreml.eval([tok]) for tok in redo])
    want = np.concatenate([mil.eval([tok]) for tok in redo])
    report["after_rollback"] = compare(got, want)
    report["state_after_rollback"] = compare_states(coreml, mil, 74)

    coreml.rollback(0)
    coreml.eval(prefill)
    n = max(1, min(args.decodes, coreml.n_ctx - coreml.n_past))
    t = time.perf_counter()
    for i in range(n):
        coreml.eval([ids[i % len(ids)]])
    report["speed"] = {"draft_decode_tok_s": round(n / (time.perf_counter() - t), 1),
                       "prefill_tok_s": round(64 / prefill_s, 1)}
    coreml.close()

    args.out.write_text(json.dumps(report, indent=2) + "\n")
    rows = [(k, report[k]) for k in ("prefill", "decode", "after_rollback", "state_after_prefill", "state_after_rollback")]
    for name, r in rows:
        print(f"{name:22s} {r}")
    for fn, counts in (report["op_devices"] or {"(no MLComputePlan in this coremltools)": {}}).items():
        print(f"ops of {fn:16s} {counts}")
    print(f"draft decode {report['speed']['draft_decode_tok_s']} tok/s, prefill {report['speed']['prefill_tok_s']} tok/s "
          f"on {report['compute_units']}; report: {args.out}")
    bad = [n for n, r in rows if r and (r.get("top1", 1.0) < MIN_TOP1 or r["max_rel_err"] > MAX_REL_ERR)]
    if bad:
        print(f"Core ML and the MIL interpreter disagree on: {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
