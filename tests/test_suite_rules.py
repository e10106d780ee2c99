"""The test suite's own rules: a skip for a missing module fails the run, and the dev extra installs what the
tests import."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_a_skip_for_a_missing_module_fails_the_run(tmp_path):
    (tmp_path / "conftest.py").write_text(f"import sys\nsys.path.insert(0, {str(TESTS)!r})\n"
                                          "from skipcheck import *  # noqa\n")
    (tmp_path / "test_missing.py").write_text("import pytest\nnope = pytest.importorskip('no_such_module_xyz', "
                                              "reason='not installed')\n\ndef test_x():\n    pass\n")
    (tmp_path / "test_platform.py").write_text("import pytest\n\n@pytest.mark.skip(reason='needs macOS')\n"
                                               "def test_y():\n    pass\n\ndef test_z():\n    pass\n")
    run = [sys.executable, "-P", "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path)]
    r = subprocess.run([*run, str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 1 and "no_such_module_xyz" in r.stdout, r.stdout
    r = subprocess.run([*run, str(tmp_path / "test_platform.py")], capture_output=True, text=True, timeout=300,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stdout  # a platform skip is allowed


def test_dev_extra_installs_what_the_tests_import():
    import tomllib

    dev = tomllib.loads((TESTS.parent / "pyproject.toml").read_text())["project"]["optional-dependencies"]["dev"]
    names = {d.split(">")[0].split("=")[0].split("[")[0].split(";")[0].strip().lower() for d in dev}
    assert {"httpx", "openai", "pytest", "scipy", "jsonschema"} <= names
