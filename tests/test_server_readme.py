"""The README's client snippets for the server (OpenAI Responses, Anthropic Messages, embeddings) run as written
against ``ondevice serve smollm2-135m-instruct`` (only the port differs)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("openai")
pytest.importorskip("anthropic")

README = Path(__file__).parent.parent / "README.md"


def _client_snippets() -> list[str]:
    return [s for s in re.findall(r"```python\n(.*?)```", README.read_text(), re.S) if "127.0.0.1:8080" in s]


def test_readme_client_snippets_run(smollm2):
    from ondevice.server.run import launch

    snippets = _client_snippets()
    assert len(snippets) == 3 and any("anthropic" in s for s in snippets) and any("embeddings" in s for s in snippets)
    proc, url = launch("smollm2-135m-instruct", "--n-ctx", "256", "--threads", "1")
    try:
        for code in snippets:
            code = code.replace("http://127.0.0.1:8080", url) + "\nprint('vectors' in dir() and len(vectors[0]))\n"
            r = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=300)
            assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
            assert r.stdout.strip(), code
            if "embeddings" in code:
                assert r.stdout.strip().splitlines()[-1] == "576"  # SmolLM2-135M's hidden size
    finally:
        proc.terminate()
        proc.wait(timeout=30)
