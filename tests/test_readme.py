"""The README's Python snippets run as written (a snippet that raised in a daemon thread, or exited before
its thread printed, looked fine and did nothing)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).parent.parent / "README.md"


def _snippets() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=900)


def test_desktop_snippet_streams_an_answer_and_its_stats(smollm2):
    code = next(s for s in _snippets() if "threading.Thread" in s)
    r = _run(code)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert "Stats(" in r.stdout and len(r.stdout.split("Stats(")[0].strip()) > 0, r.stdout


@pytest.mark.slow  # the 1.6 GB Qwen2.5-Coder pair
def test_python_api_snippet_runs():
    r = _run(next(s for s in _snippets() if "ondevice.load(\"qwen2.5-coder\")" in s))
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
