"""The chat template worker (``python -m ondevice.templates``) is a hostile template's whole world: it must not
import code from the folder ondevice was started in, and (issue #41) it sees no environment and no network."""

from __future__ import annotations

import os
import subprocess
import sys

RENDER = ("from ondevice import templates\n"
          "print(templates.render({template!r}, [{{'role': 'user', 'content': 'hi'}}], source='t.gguf'))\n")


def _render_in(cwd, template: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """Render ``template`` from a fresh process started in ``cwd`` (itself with -P: the parent is not under test)."""
    return subprocess.run([sys.executable, "-P", "-c", RENDER.format(template=template)], cwd=cwd, capture_output=True,
                          text=True, timeout=120, env={**os.environ, **(env or {})})


def test_worker_does_not_import_from_the_working_directory(tmp_path):
    evil = tmp_path / "evil"
    evil.mkdir()
    marker = tmp_path / "marker"
    # a json.py in the folder ondevice runs in: the worker imports json first thing
    (evil / "json.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    r = _render_in(evil, "{{ messages[0]['content'] }}!")
    assert not marker.exists(), "the template worker imported json.py from the working directory"
    assert r.returncode == 0 and r.stdout.strip() == "hi!", r.stderr
