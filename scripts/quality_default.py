"""README command 1 for candidate default chat models: is the first answer right, and how long does it take?

For each model: the README prompt ("Write a Python function that reverses a string.") answered greedily and at
the chat command's own sampling settings (temperature 0.8, 256 tokens) for seeds 0..N-1, each answer's code run
against the reverse-string task's unit tests in the sandbox. With --clean: README command 1 itself
(`echo PROMPT | ondevice chat MODEL --stats`) in a fresh process with an empty ONDEVICE_HOME, so the time
includes the pull (download, assemble, sha256) as on a clean machine.

    PYTHONPATH=$PWD python scripts/quality_default.py qwen2.5-coder-0.5b-instruct smollm2-135m-instruct \
        --seeds 10 --clean --threads 1 --out docs/quality-default.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPT = "Write a Python function that reverses a string."


def sampled(model: str, seeds: int, threads: int | None) -> dict:
    import ondevice
    from ondevice.params import DEFAULT_MAX_TOKENS, DEFAULTS
    from ondevice.quality import check, load_tasks

    task = next(t for t in load_tasks() if t.id == "code-reverse-string")
    rows = []
    with ondevice.load(model, drafter="none", threads=threads) as rt:
        for seed in [None, *range(seeds)]:
            temp = 0.0 if seed is None else DEFAULTS.temperature
            t0 = time.perf_counter()
            res = rt.chat([{"role": "user", "content": PROMPT}], max_tokens=DEFAULT_MAX_TOKENS, temperature=temp,
                          seed=seed or 0)
            v = check(task, res.text)
            rows.append({"seed": seed, "temperature": temp, "passed": v.passed, "detail": v.detail, "tokens": res.stats.tokens,
                         "seconds": time.perf_counter() - t0, "answer": res.text})
            print(f"{model} seed={seed} T={temp} {'pass' if v.passed else 'FAIL'} {res.stats.tokens} tok", file=sys.stderr)
    samples = [r for r in rows if r["seed"] is not None]
    return {"model": model, "greedy_passed": rows[0]["passed"], "sampled_passed": sum(r["passed"] for r in samples),
            "sampled_n": len(samples), "answers": rows}


def clean_run(model: str, threads: int | None) -> dict:
    """README command 1 in a fresh process on an empty cache: pull + load + answer, wall time."""
    with tempfile.TemporaryDirectory(prefix="ondevice-clean-") as home:
        env = {**os.environ, "ONDEVICE_HOME": home}
        args = [sys.executable, "-P", "-m", "ondevice", "chat", model, "--stats"] + (["--threads", str(threads)] if threads else [])
        t0 = time.perf_counter()
        r = subprocess.run(args, input=PROMPT + "\n", capture_output=True, text=True, env=env, timeout=1800)
        wall = time.perf_counter() - t0
        size = sum(p.stat().st_size for p in Path(home).rglob("*.gguf"))
    from ondevice.quality import check, load_tasks

    task = next(t for t in load_tasks() if t.id == "code-reverse-string")
    v = check(task, r.stdout)
    return {"model": model, "returncode": r.returncode, "wall_seconds": wall, "downloaded_gguf_bytes": size,
            "passed": v.passed, "detail": v.detail, "answer": r.stdout, "stderr_tail": r.stderr[-2000:]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--clean", action="store_true", help="also run README command 1 on an empty cache (downloads)")
    ap.add_argument("--threads", type=int, default=None, help="threads for the seeded answers")
    ap.add_argument("--clean-threads", type=int, default=None, help="threads for --clean (default: as the README, none)")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    doc = {"prompt": PROMPT, "threads": a.threads, "clean_threads": a.clean_threads, "load_average": os.getloadavg(),
           "models": [sampled(m, a.seeds, a.threads) for m in a.models]}
    if a.clean:
        doc["clean"] = [clean_run(m, a.clean_threads) for m in a.models]
    doc["load_average_end"] = os.getloadavg()
    from ondevice.atomic import write_text

    write_text(a.out, json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
