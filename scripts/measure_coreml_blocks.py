"""SmolLM2's catalog GGUF → Core ML with the default compression, GGUF blocks kept vs re-quantized to
symmetric int4 (the earlier default), each package checked against llama.cpp on held-out text through
the MIL interpreter (``device="mil"``). Writes JSON.

    python scripts/measure_coreml_blocks.py OUT.json [--model smollm2-135m-instruct]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    from converters.coreml import to_coreml
    from ondevice.store import lookup

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    a = ap.parse_args()
    src = lookup.resolve(a.model)
    doc = {"model": a.model, "source": str(src), "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name, keep in (("gguf_blocks_kept", True), ("requantized_int4_symmetric", False)):
            out = Path(tmp) / name
            out.mkdir()
            t0 = time.perf_counter()
            s = to_coreml(src, out, progress=False, keep_blocks=keep)
            v = s["verified"]
            doc["runs"][name] = {"seconds": round(time.perf_counter() - t0, 1), "size_bytes": s["size_bytes"],
                                 "bits_per_weight": s["bits_per_weight"], "weights": s.get("weights", "int4 (coremltools)"),
                                 "blocks": s.get("blocks"), "source_agreement": v["source"],
                                 "self_check": {k: v[k] for k in ("top1", "max_rel_err", "tokens")}}
            print(name, json.dumps(doc["runs"][name]["source_agreement"]), file=sys.stderr)
            a.out.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
