"""The CLI's errors and exits: paths printed as written, /help in the REPL, a symlink loop in one line, and
Ctrl-C while the CLI still imports exits quietly."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_cli_error_prints_colon_words_as_written(tmp_path):
    model = tmp_path / ":loop:" / "m.gguf"
    r = subprocess.run([sys.executable, "-P", "-m", "ondevice", "generate", str(model), "-p", "hi"], capture_output=True,
                       timeout=300)
    err = r.stderr.decode()
    assert r.returncode == 2 and ":loop:" in err and "\U0001f501" not in err, err


def test_repl_help_and_symlink_loop(tiny_gguf, tmp_path):
    r = subprocess.run([sys.executable, "-P", "-m", "ondevice", "chat", str(tiny_gguf("llama")), "--no-spec", "--threads", "1",
                        "--max-tokens", "2"], input=b"/help\n", capture_output=True, timeout=300)
    assert r.returncode == 0 and "/reset" in r.stderr.decode() and "unknown" not in r.stderr.decode(), r.stderr
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    a.symlink_to(b)
    b.symlink_to(a)
    for args in (["generate", str(a), "-p", "hi"], ["info", str(a)]):
        r = subprocess.run([sys.executable, "-P", "-m", "ondevice", *args], capture_output=True, timeout=300)
        assert r.returncode == 2 and "symlink loop" in r.stderr.decode(), r.stderr


def test_ctrl_c_while_the_cli_imports_exits_quietly():
    """Ctrl-C in the first tenth of a second of `ondevice ...` lands while typer / rich import: exit 130 and no
    traceback (as a Ctrl-C during the command), through the console script's entry point and `python -m`."""
    import tomllib

    root = Path(__file__).resolve().parent.parent
    entry = tomllib.loads((root / "pyproject.toml").read_text())["project"]["scripts"]["ondevice"]
    module, func = entry.split(":")
    interrupt = ("import builtins\nreal = builtins.__import__\n"
                 "def imp(name, *a, **kw):\n"
                 "    if name == 'typer':\n        raise KeyboardInterrupt\n"
                 "    return real(name, *a, **kw)\n"
                 "builtins.__import__ = imp\n")
    for call in (f"import {module}; {module}.{func}()", "import runpy; runpy.run_module('ondevice', run_name='__main__')"):
        p = subprocess.run([sys.executable, "-P", "-c", interrupt + call, "--help"], capture_output=True, text=True,
                           cwd=root, timeout=60)
        assert p.returncode == 130 and p.stderr == "" and p.stdout == "", (call, p.returncode, p.stderr)
