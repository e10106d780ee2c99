"""`ondevice chat` and the desktop API: piped turns, prefix reuse, one-line errors, threads, asyncio."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import threading

from helpers import PROMPT

import ondevice

SMOL = "smollm2-135m-instruct"  # the fast tiny model, named: these tests need a real chat model, not a good one


def _chat(*args, input: bytes):
    return subprocess.run([sys.executable, "-P", "-m", "ondevice", "chat", *args], input=input, capture_output=True, timeout=600)


def test_piped_chat_on_default_model_reuses_prefix(smollm2):
    r = _chat(SMOL, "--stats", "--max-tokens", "24", "--temperature", "0",
              input=b"Hello! Who are you?\nWhat is 2 + 2?\nName a colour.\n")
    assert r.returncode == 0, r.stderr.decode()
    err = r.stderr.decode()
    evaluated = [(int(a), int(b)) for a, b in re.findall(r"prompt (\d+)/(\d+) evaluated", err)]
    assert len(evaluated) == 3
    assert evaluated[0][0] == evaluated[0][1]  # first turn: the whole prompt
    for done, total in evaluated[1:]:
        assert done < total / 2  # later turns: only what follows the cached prefix
    assert len([ln for ln in r.stdout.decode().splitlines() if ln.strip()]) >= 3


def test_chat_commands_and_show_draft(smollm2):
    r = _chat(SMOL, "--show-draft", "--max-tokens", "16", "--temperature", "0", input=b"Hi\n/stats\n/reset\nHi\n/exit\nnever asked\n")
    assert r.returncode == 0
    assert "tokens/pass" in r.stderr.decode() and "history cleared" in r.stderr.decode()


def _one_line(r, needle):
    err = r.stderr.decode()
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert r.returncode != 0 and len(lines) == 1 and needle in lines[0] and "Traceback" not in err, err


def test_chat_errors_are_one_line(tmp_path, tiny_hf, smollm2):
    _one_line(_chat("no-such-model", input=b"hi\n"), "unknown model")
    _one_line(_chat(str(tmp_path / "missing.gguf"), input=b"hi\n"), "missing.gguf")
    bad = tmp_path / "corrupt.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x01" * 300)
    _one_line(_chat(str(bad), input=b"hi\n"), "corrupt.gguf")
    _one_line(_chat(SMOL, "--max-tokens", "4", input=b"hello\n\xff\xfe broken\n"), "not valid UTF-8")
    # a chat template that reaches for Python internals is stopped by the sandbox
    import shutil

    from converters import convert

    evil = tmp_path / "evil"
    shutil.copytree(tiny_hf["llama"], evil)
    tc = json.loads((evil / "tokenizer_config.json").read_text())
    tc["chat_template"] = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    (evil / "tokenizer_config.json").write_text(json.dumps(tc))
    convert(evil, to="gguf", out=tmp_path / "evil-gguf", quant="q8_0", progress=False)
    _one_line(_chat(str(tmp_path / "evil-gguf" / "model.gguf"), input=b"hi\n"), "template")


def test_two_threads_share_one_runtime(tiny_gguf):
    target, draft = tiny_gguf("llama"), tiny_gguf("llama_draft")
    prompts = [PROMPT, "def add(a, b):"]
    with ondevice.load(target, draft) as rt:
        expected = {p: rt.generate(p, max_tokens=40, temperature=0, gamma=3).tokens for p in prompts}
        got, errors = {}, []

        def worker(p):
            try:
                for _ in range(3):
                    s = rt.stream(p, max_tokens=40, temperature=0, gamma=3)
                    toks = [t for c in s for t in c.tokens]
                    assert toks == expected[p]
                got[p] = True
            except Exception as e:  # surfaced below
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(p,)) for p in prompts]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not errors and got == {p: True for p in prompts}


def test_reentrant_use_from_a_callback_is_an_error_not_a_deadlock(tiny_gguf):
    with ondevice.load(tiny_gguf("llama"), drafter="ngram") as rt:
        errors = []

        def observer(*_):  # runs inside the stream's target pass
            try:
                rt.generate(PROMPT, max_tokens=2)
            except ondevice.OndeviceError as e:
                errors.append(str(e))

        rt.observer = observer
        assert rt.generate(PROMPT, max_tokens=4, temperature=0, gamma=2).stats.tokens == 4
        assert errors and all("from inside a running stream" in e for e in errors)
        rt.observer = None
        # A stream the same thread left suspended is ended by its next request, not a deadlock.
        s = rt.stream(PROMPT, max_tokens=20, temperature=0)
        next(s)
        assert rt.generate(PROMPT, max_tokens=2).stats.tokens == 2
        assert list(s) == [] and s.stats.stop_reason == "cancelled"


def test_astream_under_asyncio(tiny_gguf):
    with ondevice.load(tiny_gguf("llama"), drafter="ngram") as rt:
        ref = rt.generate(PROMPT, max_tokens=30, temperature=0, gamma=3)

        async def main():
            chunks = [c async for c in rt.astream(PROMPT, max_tokens=30, temperature=0, gamma=3)]
            # leaving early cancels
            async for _ in rt.astream(PROMPT, max_tokens=200, temperature=0, gamma=3):
                break
            return chunks

        chunks = asyncio.run(main())
        assert [t for c in chunks for t in c.tokens] == ref.tokens
        assert "".join(c.text for c in chunks) == ref.text
        assert rt.last_stats.stop_reason == "cancelled"


def test_chat_session_starts_the_template_worker_before_the_first_turn(tiny_gguf):
    """The worker's start (a Python start and jinja2's import: ~0.1-0.2 s here) overlaps the user's typing
    instead of adding to the first turn's latency (measured: first render ~10 ms warmed against ~100 ms cold)."""
    import time

    from ondevice import templates
    from ondevice.chat import ChatSession

    templates.shutdown()
    templates._kill_worker()
    with ondevice.load(tiny_gguf("llama"), drafter="none", threads=1, n_ctx=128) as rt:
        ChatSession(rt, max_tokens=2)
        deadline = time.monotonic() + 60
        while not (templates._worker is not None and templates._worker.ready) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert templates._worker is not None and templates._worker.ready  # started without a render
        pid = templates._worker.proc.pid
        rt.render_chat([{"role": "user", "content": "hi"}])
        assert templates._worker.proc.pid == pid  # the render used the warmed worker


# -- model output reaches the terminal without its control characters ------------------------------------------
HOSTILE = "ok\x1b]52;c;ZWNobyBwd25lZA==\x07 \x1b[2J\x1b]0;title\x07\x9b31m done\r\nnext\rover\ttab\n"
SHOWN = "ok\\x1b]52;c;ZWNobyBwd25lZA==\\x07 \\x1b[2J\\x1b]0;title\\x07\\x9b31m done\r\nnext\\x0dover\ttab\n"


class _Stats:
    stop_reason = "eos"


class _Stream:
    """A fake answer: ``HOSTILE`` in three chunks."""

    stats = _Stats()

    def __iter__(self):
        from types import SimpleNamespace

        for part in (HOSTILE[:10], HOSTILE[10:30], HOSTILE[30:]):
            yield SimpleNamespace(text=part, from_draft=[False])

    def cancel(self):
        pass


def test_generate_and_chat_show_a_models_control_characters_visibly(monkeypatch, capsys):
    """A model's output is untrusted: before, ``ondevice generate`` wrote it raw and ``ondevice chat`` through rich
    (which keeps ESC), so a model could write the clipboard (OSC 52), clear the screen or set the title. Now
    every control character but newline, tab and CRLF is shown as ``\\x1b`` etc.; the chat history keeps the
    model's real text."""
    import contextlib
    import io
    from types import SimpleNamespace

    from typer.testing import CliRunner

    import ondevice.loader
    from ondevice.cli import repl
    from ondevice.cli.main import app

    runtime = SimpleNamespace(draft_choice=None, n_ctx=64, stream=lambda prompt, request: _Stream())
    monkeypatch.setattr(ondevice.loader, "load", lambda *a, **k: contextlib.nullcontext(runtime))
    r = CliRunner().invoke(app, ["generate", "any-model", "-p", "hi"])
    assert r.exit_code == 0 and r.stdout_bytes.decode() == SHOWN + "\n", repr(r.stdout_bytes)

    sessions = []

    class Session:
        def __init__(self, *a, **k):
            self.thinking, self.dropped, self.variables, self.turns = None, 0, {}, []
            sessions.append(self)

        def ask(self, user):
            return _Stream()

        def commit(self, user, answer):
            self.turns.append((user, answer))

    monkeypatch.setattr(repl, "ChatSession", Session)
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"hello\n")))
    capsys.readouterr()
    assert repl.run_chat(runtime, system=None, show_draft=False, show_stats=False, request=None, title="t") == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and "\x9b" not in out, repr(out)
    # rich drops a CR and expands tabs itself; what is left is the model's text, visibly escaped
    assert out.replace("\r", "").split() == SHOWN.replace("\r", "").split(), repr(out)
    assert sessions[0].turns == [("hello", HOSTILE)]
