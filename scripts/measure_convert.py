"""Wall time and peak private memory (RssAnon summed over the process tree) of conversion commands,
run one after another on the same machine, as JSON.

    python scripts/measure_convert.py OUT.json --run NAME -- CMD ... [--run NAME2 -- CMD2 ...]

Each command runs in a subprocess sampled every 5 ms (``converters.memwatch.MemoryWatch(tree=True)``);
a command that prints JSON on stdout (``ondevice convert --json``) has it kept beside its numbers.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from converters.memwatch import MemoryWatch  # noqa: E402


def measure(cmd: list[str]) -> dict:
    """Run ``cmd``; {"cmd", "returncode", "seconds", "peak_rss_anon_bytes", "json"?, "stderr_tail"?}."""
    t0, cpu0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    load0 = os.getloadavg()[0]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    with MemoryWatch(proc.pid, tree=True, interval=0.005) as mw:
        out, err = proc.communicate()
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    rec = {"cmd": " ".join(cmd), "returncode": proc.returncode, "seconds": round(time.perf_counter() - t0, 2),
           "cpu_seconds": round(cpu, 2), "peak_rss_anon_bytes": mw.peak_rss_bytes,
           "load_average_1min": [round(load0, 1), round(os.getloadavg()[0], 1)]}
    try:
        rec["json"] = json.loads(out)
    except ValueError:
        pass
    if proc.returncode:
        rec["stderr_tail"] = err.decode(errors="replace")[-1500:]
    return rec


def main(argv: list[str]) -> int:
    out, runs, i = Path(argv[0]), [], 1
    while i < len(argv):
        if argv[i] != "--run":
            raise SystemExit(f"expected --run NAME -- CMD, got {argv[i]!r}")
        name, j = argv[i + 1], argv.index("--", i) + 1
        k = argv.index("--run", j) if "--run" in argv[j:] else len(argv)
        runs.append((name, argv[j:k]))
        i = k
    doc = {"machine": {"platform": platform.platform(), "cpus": os.cpu_count()}, "runs": {}}
    for name, cmd in runs:
        doc["runs"][name] = measure(cmd)
        r = doc["runs"][name]
        print(f"{name}: rc {r['returncode']}, {r['seconds']} s, peak RssAnon {r['peak_rss_anon_bytes'] / 1e9:.2f} GB",
              file=sys.stderr)
        out.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
