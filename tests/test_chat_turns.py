"""Chat turns: the API takes OpenAI message forms and refuses bad ones in one line, a too-long turn is refused
alone (API and piped chat) and the session kept, and a character cut by max_tokens is dropped, not replaced."""

from __future__ import annotations

import subprocess
import sys

import pytest

import ondevice
from ondevice.errors import OndeviceError

PROMPT = "The model draft and the target verify"


def test_chat_api_takes_openai_message_forms_and_refuses_bad_ones(tiny_gguf):
    with ondevice.load(tiny_gguf("llama"), drafter="none", threads=1, n_ctx=256) as rt:
        parts = [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]
        assert rt.render_chat([{"role": "user", "content": parts}]) == rt.render_chat([{"role": "user",
                                                                                       "content": "Hello there"}])
        assert rt.render_chat([{"role": "system", "content": None}, {"role": "user", "content": "x"}]) == \
            rt.render_chat([{"role": "system", "content": ""}, {"role": "user", "content": "x"}])
        cases = {
            "non-empty list": dict(messages=[]),
            "content part of type 'image_url'": dict(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
            "'role' string": dict(messages=[{"content": "x"}]),
            "seed='abc'": dict(messages=[{"role": "user", "content": "x"}], seed="abc"),
            "temperature='hot'": dict(messages=[{"role": "user", "content": "x"}], temperature="hot"),
        }
        for needle, kw in cases.items():
            with pytest.raises(OndeviceError, match=needle.replace("(", r"\(").replace("[", r"\[")) as e:
                rt.chat(**kw, max_tokens=2)
            assert "\n" not in str(e.value)
        with pytest.raises(OndeviceError, match="seed='abc'"):
            rt.generate(PROMPT, seed="abc")


def test_too_long_turn_is_refused_alone_and_the_session_kept(tiny_gguf):
    from ondevice.chat import ChatSession

    with ondevice.load(tiny_gguf("llama"), drafter="none", threads=1, n_ctx=256) as rt:
        s = ChatSession(rt, system="be brief", max_tokens=8, temperature=0)
        for q in ("first", "second"):
            st = s.ask(q)
            s.commit(q, "".join(c.text for c in st))
        with pytest.raises(OndeviceError, match="too long.*conversation is kept"):
            s.ask("word " * 400)
        assert [u for u, _ in s.turns] == ["first", "second"] and s.dropped == 0
        st = s.ask("third")
        assert "".join(c.text for c in st) is not None and st.stats.tokens > 0


def test_too_long_piped_line_is_one_error_and_the_next_lines_are_answered(tiny_gguf):
    r = subprocess.run([sys.executable, "-P", "-m", "ondevice", "chat", str(tiny_gguf("llama")), "--no-spec", "--threads", "1",
                        "--n-ctx", "256", "--max-tokens", "4", "--temperature", "0", "--stats"],
                       input=b"hello\n" + b"word " * 400 + b"\nagain\n", capture_output=True, timeout=300)
    err = r.stderr.decode()
    assert r.returncode == 1, err
    assert err.count("error:") == 1 and "too long" in err
    assert err.count(" tokens · ") == 2  # both short turns were answered (--stats line per answer)


def test_a_character_cut_by_max_tokens_is_dropped_not_replaced():
    from ondevice.text import TextAssembler

    pieces = {1: b"ok ", 2: "🙂".encode()[:2], 3: "🙂".encode()[2:]}
    t = TextAssembler(pieces.__getitem__, [])
    assert t.feed(1) + t.feed(2) + t.flush() == "ok "  # the cut half of the emoji is not "�"
    t = TextAssembler(pieces.__getitem__, [])
    assert t.feed(1) + t.feed(2) + t.feed(3) + t.flush() == "ok 🙂"
