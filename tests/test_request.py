"""One typed request: every surface builds a ``GenerateRequest`` and γ has one rule, in ``ondevice.params``."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ondevice.errors import OndeviceError
from ondevice.params import MAX_GAMMA, GenerateRequest, SamplingParams, gamma_value

RULE = f"must be 'auto' or an integer in [0, {MAX_GAMMA}]"


@pytest.mark.parametrize("bad", [-1, MAX_GAMMA + 1, 2.5, "x", True, None, "4x"])
def test_gamma_has_one_rule(bad):
    with pytest.raises(OndeviceError, match=r"gamma=.*must be 'auto' or an integer in \[0, 64\]"):
        gamma_value(bad)


@pytest.mark.parametrize("good,want", [("auto", "auto"), (0, 0), (4, 4), ("4", 4), (4.0, 4), (MAX_GAMMA, MAX_GAMMA)])
def test_gamma_accepted_values(good, want):
    assert gamma_value(good) == want


def test_request_round_trips_and_refuses_unknown_options():
    r = GenerateRequest.of(temperature=0, top_k=5, max_tokens=7, gamma="3", stop="END", seed=1)
    assert r.sampling == SamplingParams(temperature=0, top_k=5, seed=1) and r.gamma == 3 and r.stop == ("END",)
    assert GenerateRequest.of(**r.to_dict()) == r
    with pytest.raises(OndeviceError, match="unknown generation option"):
        GenerateRequest.of(temprature=0)
    with pytest.raises(OndeviceError, match="max_tokens"):
        GenerateRequest(max_tokens=0)


def test_gamma_followed_from_every_surface_to_the_same_rule(tiny_gguf):
    """The API, the server and the CLI refuse a bad γ with the words of the one rule (``gamma_value``)."""
    import ondevice
    from ondevice.server.openai_api import ApiError, generation_args

    with ondevice.load(tiny_gguf("llama"), drafter="ngram", n_ctx=64) as rt:
        with pytest.raises(OndeviceError, match=RULE.replace("[", r"\[").replace("]", r"\]")):
            rt.generate("hi", gamma=MAX_GAMMA + 1)
        res = rt.generate("hi", GenerateRequest.of(max_tokens=3, temperature=0, gamma=2))
        assert res.stats.tokens <= 3
    with pytest.raises(ApiError) as e:
        generation_args({"gamma": MAX_GAMMA + 1}, 3, 64)
    assert RULE in str(e.value.body())
    r = subprocess.run([sys.executable, "-P", "-m", "ondevice", "generate", str(tiny_gguf("llama")), "-p", "hi",
                        "--gamma", str(MAX_GAMMA + 1)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and RULE in r.stderr and "Traceback" not in r.stderr


def test_request_or_keywords_one_rule_on_every_entry_point(tiny_gguf):
    """``Runtime.stream``/``chat`` and ``ChatSession`` take a GenerateRequest *or* keyword options: both at once
    (keywords silently ignored before) or a request of another type is refused by one rule."""
    import ondevice
    from ondevice.chat import ChatSession

    req = GenerateRequest.of(max_tokens=2)
    assert GenerateRequest.resolve(req, {}) is req and GenerateRequest.resolve(None, {"max_tokens": 2}) == req
    with ondevice.load(tiny_gguf("llama"), drafter="ngram", n_ctx=64) as rt:
        for call in (lambda: rt.generate("hi", req, max_tokens=3), lambda: ChatSession(rt, request=req, max_tokens=3),
                     lambda: rt.chat([{"role": "user", "content": "hi"}], req, max_tokens=3)):
            with pytest.raises(OndeviceError, match="not both"):
                call()
        for call in (lambda: rt.generate("hi", 5), lambda: ChatSession(rt, request={"max_tokens": 3})):
            with pytest.raises(OndeviceError, match="must be a GenerateRequest"):
                call()
        assert ChatSession(rt, max_tokens=3).request == GenerateRequest.of(max_tokens=3)


def test_server_names_the_bad_field_and_refuses_unknown_roles():
    """A bad γ is a 400 with ``param: gamma`` (was None); a message role OpenAI does not define (a typo such as
    'assitant') is a 400 instead of reaching the chat template; the API keeps any role for custom templates."""
    from ondevice.chat import normalize_messages
    from ondevice.server.openai_api import ApiError, chat_messages, generation_args

    with pytest.raises(ApiError) as e:
        generation_args({"gamma": "x"}, 3, 64)
    assert e.value.body()["error"]["param"] == "gamma"
    with pytest.raises(ApiError) as e:
        chat_messages({"messages": [{"role": "user", "content": "a"}, {"role": "assitant", "content": "b"}]})
    err = e.value.body()["error"]
    assert e.value.status == 400 and err["param"] == "messages" and "messages[1].role 'assitant'" in err["message"]
    assert chat_messages({"messages": [{"role": "developer", "content": [{"type": "text", "text": "x"}]}]}) == \
        [{"role": "system", "content": "x"}]
    assert normalize_messages([{"role": "ipython", "content": "x"}])[0]["role"] == "ipython"
