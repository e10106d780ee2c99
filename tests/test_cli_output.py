"""Command output through pipes: a closed pipe ends every command the same quiet way (exit 141), and tables
that are not written to a terminal keep whole cells (rich's default 80 columns cut names to "qwen2.5-…")."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ondevice.cli.app import PIPE_WIDTH, console


def test_console_off_terminal_is_wide_and_a_closed_pipe_raises(tmp_path, monkeypatch):
    import os

    monkeypatch.delenv("COLUMNS", raising=False)
    c = console(file=open(tmp_path / "out.txt", "w"))
    assert not c.is_terminal and c.width == PIPE_WIDTH
    r, w = os.pipe()
    os.close(r)
    c = console(file=os.fdopen(w, "w"))
    with pytest.raises(BrokenPipeError):  # rich's own handler would SystemExit(1) and point stdout at /dev/null
        c.print("x")


def test_models_table_through_a_pipe_keeps_whole_names():
    import os

    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    r = subprocess.run([sys.executable, "-P", "-m", "ondevice", "models"], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    assert "qwen2.5-coder-0.5b-instruct " in r.stdout and "…" not in r.stdout


def test_chat_under_a_closed_pipe_exits_141_like_generate(smollm2):
    cmd = (f"printf 'Hi\\nTell me a long story\\n' | {sys.executable} -P -m ondevice chat smollm2-135m-instruct "
           f"--max-tokens 200 --temperature 0 --no-spec --threads 1 | head -c 5; echo \" rc=${{PIPESTATUS[1]}}\"")
    r = subprocess.run(["bash", "-c", cmd], capture_output=True, timeout=300)
    assert r.stdout.rstrip().endswith((b" rc=0", b" rc=141")), r.stdout  # was rc=1: a refused turn's status
    assert r.stderr == b"", r.stderr


def test_generate_reads_a_piped_prompt(tiny_gguf):
    """`echo TEXT | ondevice generate MODEL` (was: "Missing option '--prompt'") and `-p -` read stdin, exactly."""
    import json

    def gen(*args, stdin=None):
        r = subprocess.run([sys.executable, "-P", "-m", "ondevice", "generate", str(tiny_gguf("llama")), "--max-tokens", "6",
                            "--temperature", "0", "--no-spec", "--threads", "1", "--json", *args], input=stdin,
                           capture_output=True, timeout=300)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)["tokens"]

    want = gen("-p", "Once upon a time\n")
    assert gen(stdin=b"Once upon a time\n") == want and gen("-p", "-", stdin=b"Once upon a time\n") == want
    r = subprocess.run([sys.executable, "-P", "-m", "ondevice", "generate", str(tiny_gguf("llama"))], input=b"\xff\xfe",
                       capture_output=True, timeout=300)
    assert r.returncode == 2 and b"not valid UTF-8" in r.stderr and b"Traceback" not in r.stderr


def test_an_answer_cut_by_the_context_says_so(tiny_gguf):
    """generate printed a cut answer with nothing on stderr (asked for 50 tokens, got 3, exit 0, no word)."""
    import ondevice

    model = str(tiny_gguf("llama"))
    with ondevice.load(model, drafter="none", threads=1, n_ctx=256) as rt:
        n_ctx = rt.n_ctx
        prompt = next("word " * k for k in range(n_ctx, 0, -1) if len(rt.tokenize("word " * k)) <= n_ctx - 3)
        assert rt.generate(prompt, max_tokens=50, temperature=0).stats.stop_reason == "context"
    r = subprocess.run([sys.executable, "-P", "-m", "ondevice", "generate", model, "-p", prompt, "--n-ctx", str(n_ctx),
                        "--max-tokens", "50", "--temperature", "0", "--no-spec", "--threads", "1"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and f"end of the context, {n_ctx} tokens; raise --n-ctx" in r.stderr, r.stderr
