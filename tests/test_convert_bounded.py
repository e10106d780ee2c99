"""Issue 25: conversions whose check is bounded in memory, tokenizer readings that disagree, and Core ML
weights that keep a GGUF's blocks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from converters import convert
from ondevice.errors import OndeviceError

ROOT = Path(__file__).resolve().parents[1]


# -- memory ---------------------------------------------------------------------------------------
def _peak_convert(src: Path, out: Path, *args: str) -> tuple[int, dict]:
    """Run ``ondevice convert`` in a subprocess; (peak RssAnon of its process tree, its --json)."""
    from converters.memwatch import MemoryWatch

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "ondevice", "convert", str(src), "--out", str(out), "--json", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=ROOT)
    with MemoryWatch(proc.pid, tree=True, interval=0.005) as mw:
        stdout, stderr = proc.communicate(timeout=900)
    assert proc.returncode == 0, stderr.decode()[-2000:]
    return mw.peak_rss_bytes, json.loads(stdout)


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="RssAnon is read from /proc (Linux)")
@pytest.mark.parametrize("to,args", [("gguf", ("--quant", "q4_k_m")), ("mlx", ())], ids=["gguf", "mlx"])
def test_convert_memory_does_not_grow_with_the_model(tmp_path, to, args):
    """A ~0.11B-parameter checkpoint (226 MB of f16) and a 1-layer one (~27 MB) convert and verify; the
    larger one's peak private memory (the whole process tree) exceeds the small one's by less than half
    its f16 size. Holding the model in float32 once, as the old check did several times, is 2× it."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from make_synthetic_checkpoint import make

    big = make(tmp_path / "big", params_b=0.11, tokenizer_vocab=1024, vocab=8192)
    small = make(tmp_path / "small", params_b=0.0, tokenizer_vocab=1024, vocab=8192)
    peak_small, _ = _peak_convert(tmp_path / "small", tmp_path / "small-out", "--to", to, *args)
    peak_big, summary = _peak_convert(tmp_path / "big", tmp_path / "big-out", "--to", to, *args)
    grew = peak_big - peak_small
    growth_allowed = 0.5 * (big["f16_bytes"] - small["f16_bytes"])
    assert summary["verify"]["passed"]
    check = summary["verify"]["check"]
    assert check["seconds"] > 0 and 0 < check["peak_rss_bytes"] <= peak_big
    assert grew <= growth_allowed, (f"peak RssAnon grew by {grew / 1e6:.0f} MB for {big['f16_bytes'] / 1e6:.0f} MB of "
                                    f"f16 weights (small: {peak_small / 1e6:.0f} MB, big: {peak_big / 1e6:.0f} MB)")
