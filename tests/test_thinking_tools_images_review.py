"""A user's review of #38 (thinking, tools, images) as shipped: each test here failed before its fix."""

from __future__ import annotations

import shutil

import pytest

from ondevice.errors import OndeviceError


def _image_messages(url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": "What is this? "},
                                         {"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": " Say it."}]}]


def test_an_undecodable_image_names_no_video_tool(tiny_gguf, tmp_path):
    """libmtmd tries its video / audio probes after the image decoder fails: its lines ("is ffprobe in PATH?")
    sent the user hunting for a tool images never need. The one-line error says the image is corrupt."""
    pytest.importorskip("llama_cpp.mtmd_cpp")
    from ondevice.loader import load
    from ondevice.testing.vision import make_tiny_mmproj, png_bytes, random_image

    shutil.copy(tiny_gguf("llama"), tmp_path / "tiny-vlm.gguf")
    make_tiny_mmproj(tmp_path / "mmproj-tiny-f16.gguf", seed=3)
    good = tmp_path / "good.png"
    good.write_bytes(png_bytes(random_image(1)))
    bad = tmp_path / "cut.png"
    bad.write_bytes(good.read_bytes()[:40])  # a valid header, the pixel data cut off
    with load(tmp_path / "tiny-vlm.gguf", drafter="none", n_ctx=512, threads=1) as rt:
        with pytest.raises(OndeviceError) as e:
            rt.chat(_image_messages(str(bad)), max_tokens=2)
        msg = str(e.value)
        assert "cut.png: the PNG image cannot be decoded" in msg and "\n" not in msg
        assert "ffprobe" not in msg and "video" not in msg
        assert rt.chat(_image_messages(str(good)), max_tokens=2).stats.tokens == 2  # it goes on


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TWO_CALLS = ('start: "<tool_call>\\n{\\"name\\": \\"get_weather\\", \\"arguments\\": {\\"city\\": \\"a\\"}}\\n'
             '</tool_call>\\n<tool_call>\\n{\\"name\\": \\"get_weather\\", \\"arguments\\": {\\"city\\": \\"b\\"}}\\n'
             '</tool_call>"')


def test_a_call_marker_cut_by_the_token_limit_is_not_content(tiny_hf, tmp_path_factory):
    """Two parallel calls, the second cut by max_tokens inside its '<tool_call>' marker: the first call came
    back and the cut marker ('<tool_cal') leaked into content, in all three APIs, whole and streamed."""
    openai = pytest.importorskip("openai")
    anthropic = pytest.importorskip("anthropic")
    from ondevice.server.run import launch
    from tests.test_reasoning_server import QWEN3, templated

    path = templated(tiny_hf, tmp_path_factory, "qwen3cut", QWEN3)
    proc, base = launch(path, "--n-ctx", "1024", "--threads", "1")
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=300)
        kw = dict(model="model", messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER], temperature=0)
        full = client.chat.completions.create(**kw, max_tokens=200, extra_body={"grammar": TWO_CALLS})
        n = full.usage.completion_tokens
        assert [c.function.arguments for c in full.choices[0].message.tool_calls] == ['{"city": "a"}',
                                                                                    '{"city": "b"}']
        for m in range(1, n):  # every cut: in a marker, a call's head, its arguments, its closer
            r = client.chat.completions.create(**kw, max_tokens=m, extra_body={"grammar": TWO_CALLS})
            assert r.choices[0].message.content is None, (m, r.choices[0].message)
            assert r.choices[0].finish_reason == "length"
            chunks = list(client.chat.completions.create(**kw, max_tokens=m, stream=True,
                                                         extra_body={"grammar": TWO_CALLS}))
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).strip() == "", m
        cut = next(m for m in range(n - 1, 0, -1) if len(client.chat.completions.create(
            **kw, max_tokens=m, extra_body={"grammar": TWO_CALLS}).choices[0].message.tool_calls or []) == 1)
        ant = anthropic.Anthropic(base_url=base, api_key="none", max_retries=0, timeout=300)
        a = ant.messages.create(model="model", max_tokens=cut, messages=[{"role": "user", "content": "Weather?"}],
                                tools=[{"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}],
                                extra_body={"grammar": TWO_CALLS})
        assert [b.type for b in a.content] == ["tool_use"], a.content
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_the_thinking_budget_holds_in_every_api(tiny_hf, tmp_path_factory):
    """``serve --reasoning-budget`` and a request's budget held on /v1/chat/completions only: an Anthropic
    request (no ``thinking``, or ``budget_tokens``) and a Responses request (``reasoning.effort``) thought on
    until max_tokens, and a bad ``reasoning.effort`` was taken silently."""
    openai = pytest.importorskip("openai")
    anthropic = pytest.importorskip("anthropic")
    import httpx

    from ondevice.server.run import launch
    from tests.test_reasoning_budget import OPENED
    from tests.test_reasoning_server import MSGS, templated

    path = templated(tiny_hf, tmp_path_factory, "qwen3budget", OPENED)
    proc, base = launch(path, "--n-ctx", "1024", "--threads", "1", "--reasoning-budget", "5")
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=300)
        args = dict(model="model", messages=MSGS, temperature=0, max_tokens=40)

        def chat(**extra):
            m = client.chat.completions.create(**args, extra_body=extra).choices[0].message
            return m.model_extra["reasoning_content"], m.content

        default, three, zero = chat(), chat(reasoning_budget=3), chat(reasoning_effort="none")
        assert default[1] and three[1] and len(three[0]) < len(default[0])  # cut, then an answer
        ant = anthropic.Anthropic(base_url=base, api_key="none", max_retries=0, timeout=300)

        def blocks(**extra):
            a = ant.messages.create(model="model", max_tokens=40, messages=MSGS, extra_body={"temperature": 0}, **extra)
            return tuple(b.thinking if b.type == "thinking" else b.text for b in a.content)

        assert blocks() == default
        assert blocks(thinking={"type": "enabled", "budget_tokens": 3}) == three
        with httpx.Client(timeout=300) as h:
            def responses(**extra):
                r = h.post(base + "/v1/responses", json={"model": "model", "input": MSGS[0]["content"],
                                                         "max_output_tokens": 40, "temperature": 0, **extra})
                return r.status_code, r.json()

            def items(body):
                texts = {o["type"]: o["content"][0]["text"] for o in body["output"]}
                return texts.get("reasoning", ""), texts.get("message")

            code, body = responses()
            assert code == 200 and items(body) == default
            code, body = responses(reasoning={"effort": "none"})
            assert code == 200 and items(body) == (zero[0] or "", zero[1])
            code, body = responses(reasoning={"effort": 5})
            assert code == 400 and "reasoning.effort" in body["error"]["message"]
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_repl_checks_an_image_and_its_commands_at_once(tiny_gguf, tmp_path):
    """``/image`` of a missing file was taken, then the next message refused (and lost) for it; ``/think maybe``
    and a bare ``/think`` went to the model as a message; a bare ``/image`` was an 'unknown command'."""
    from typer.testing import CliRunner

    from ondevice.cli.main import app

    args = ["chat", str(tiny_gguf("llama")), "--no-spec", "--max-tokens", "4", "--temperature", "0", "--n-ctx",
            "256", "--threads", "1"]
    plain = CliRunner().invoke(app, args, input="hello\n")
    assert plain.exit_code == 0 and plain.stdout.strip(), plain.output
    bad = tmp_path / "nope.png"
    (tmp_path / "notes.png").write_text("not an image")
    for lines, says in (([f"/image {bad}"], "nope.png: no such image file"),
                        ([f"/image {tmp_path / 'notes.png'}"], "notes.png: not a PNG, JPEG, GIF or BMP"),
                        (["/think maybe", "/think"], "use /think on or /think off"),
                        (["/image"], "use /image FILE")):
        r = CliRunner().invoke(app, args, input="\n".join([*lines, "hello", ""]))
        assert says in r.output, r.output
        assert r.stdout == plain.stdout, r.output  # the message is answered as without the bad command


@pytest.mark.parametrize("text, want", [("<think>\nabc</think>\n\nanswer", ("\nabc", "answer")),
                                        ("  <think>abc</think>answer", ("abc", "answer")),
                                        ("<think></think>answer", (None, "answer")),
                                        ("<think>cut", ("cut", "")),
                                        ("<thin>k</think>a", ("<thin>k", "a"))])
def test_an_opened_block_whose_model_opens_it_again_leaks_no_tag(text, want):
    """A generation prompt that opens thinking (R1 distills, Qwen3-Thinking) and a model that writes
    ``<think>`` once more anyway: the tag landed in reasoning_content. Whole and streamed at every cut."""
    from ondevice.reasoning import Splitter, detect, split
    from tests.test_reasoning_server import QWEN3

    th = detect(QWEN3, "<think>\n")
    assert th is not None and th.opened
    assert split(text, th) == want
    for cut in range(1, len(text)):
        s = Splitter(th)
        parts = [s.feed(text[:cut]), s.feed(text[cut:]), s.finish()]
        assert ("".join(p[0] for p in parts) or None, "".join(p[1] for p in parts)) == want, cut


def test_an_image_file_over_the_limit_names_its_own_size(tmp_path):
    """A 3 MB file over a 1 MB limit was reported as '1000001 bytes' (the capped read), not its size."""
    from ondevice.images import load_image

    big = tmp_path / "big.png"
    big.write_bytes(bytes(3_000_008))
    with pytest.raises(OndeviceError, match=r"^.*big.png: 3000008 bytes is over the 1000000-byte image limit"):
        load_image(str(big), max_bytes=1_000_000)


@pytest.mark.parametrize("value", ["false", "no", 0, [False]])
def test_enable_thinking_must_be_a_boolean(value):
    """``chat_template_kwargs: {"enable_thinking": "false"}`` was passed to the template, where Jinja takes the
    non-empty string as true: thinking stayed on. A non-boolean is a 400 naming the field (as llama-server)."""
    from ondevice.server.errors import ApiError
    from ondevice.server.structured import Structured, template_args

    with pytest.raises(ApiError, match="enable_thinking must be true or false") as e:
        template_args({"chat_template_kwargs": {"enable_thinking": value}}, Structured())
    assert e.value.status == 400
    st = Structured()
    template_args({"chat_template_kwargs": {"enable_thinking": False, "other": "x"}}, st)
    assert st.variables == {"enable_thinking": False, "other": "x"}
    template_args({"chat_template_kwargs": {"enable_thinking": None}}, st)
    assert st.variables == {}  # null: the template's default, as if not given
