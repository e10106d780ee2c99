"""Thinking split from the answer: conventions detected from template text, exact splits, any cut of the
text into pieces gives the whole-text result, markers never reach content, bounded work on hostile text."""

from __future__ import annotations

import time

import pytest

from ondevice import reasoning as R

# Generation-prompt tails as the families' real templates write them (llama.cpp's models/templates copies):
QWEN3 = ("{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- if enable_thinking is defined and "
         "enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}")
QWEN35 = ("{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- if enable_thinking is defined and "
          "enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- else %}{{- '<think>\\n' }}"
          "{%- endif %}{%- endif %}")
R1 = "{% if add_generation_prompt and not ns.is_tool %}{{'<｜Assistant｜><think>\\n'}}{% endif %}"
GPT_OSS = ("{{- '<|start|>system<|message|>' }}{{- '# Valid channels: analysis, commentary, final.' }}{{- '<|end|>' }}"
           "{%- for message in messages %}{{- '<|start|>assistant<|channel|>final<|message|>' + message.content + "
           "'<|end|>' }}{%- endfor %}{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}")
GEMMA4 = ("{%- if add_generation_prompt -%}{{- '<|turn>model\\n' -}}{%- if not enable_thinking | default(false) -%}"
          "{{- '<|channel>thought\\n<channel|>' -}}{%- endif -%}{%- endif -%}")
MAGISTRAL = "Your thinking process must follow the template below:[THINK]Your thoughts[/THINK]Here, a response."
PLAIN = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"


def _render(template: str, **kw) -> str:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    return ImmutableSandboxedEnvironment().from_string(template).render(messages=[], add_generation_prompt=True, **kw)


def _pieces(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def _stream(thinking, pieces):
    s = R.Splitter(thinking)
    rs, cs = [], []
    for p in [*pieces, None]:
        r, c = s.feed(p) if p is not None else s.finish()
        rs.append(r)
        cs.append(c)
    return rs, cs


def test_detect_conventions_from_real_template_text():
    t = R.detect(QWEN3, _render(QWEN3))
    assert (t.kind, t.start, t.end, t.opened) == ("tags", "<think>", "</think>", False)
    assert R.detect(QWEN3, _render(QWEN3, enable_thinking=False)).opened is False
    assert R.detect(QWEN35, _render(QWEN35)).opened is True  # Qwen3.5 opens thinking in the prompt
    assert R.detect(QWEN35, _render(QWEN35, enable_thinking=False)).opened is False
    r1 = R.detect(R1, _render(R1, ns={"is_tool": False}))
    assert r1.opened and r1.forced_end == "\n</think>\n\n"
    h = R.detect(GPT_OSS, _render(GPT_OSS))
    assert h.kind == "harmony" and not h.opened and h.forced_end.endswith("<|channel|>final<|message|>")
    g = R.detect(GEMMA4, _render(GEMMA4, enable_thinking=True))
    assert (g.start, g.end, g.opened) == ("<|channel>thought", "<channel|>", False)
    assert R.detect(MAGISTRAL).start == "[THINK]"
    assert R.detect(PLAIN) is None and R.detect(None) is None


THINK = R.Thinking("tags", "<think>", "</think>")
OPENED = R.Thinking("tags", "<think>", "</think>", opened=True)
HARMONY = R.detect(GPT_OSS)

CASES = [  # (convention, model output, expected thinking, expected answer)
    (THINK, "<think>\nLet me see.\n</think>\n\nParis.", "\nLet me see.\n", "Paris."),
    (THINK, "  <think>a<b</think>c", "a<b", "c"),
    (THINK, "<think></think>\n\nHi", None, "Hi"),
    (THINK, "No thinking at all.", None, "No thinking at all."),
    (THINK, "Text, then <think>x</think> later", None, "Text, then <think>x</think> later"),
    (THINK, "<think>unclosed at the end", "unclosed at the end", ""),
    (THINK, "<thi", None, "<thi"),
    (THINK, "<think>x</thin", "x</thin", ""),
    (OPENED, "step 1, step 2</think>\n\n42", "step 1, step 2", "42"),
    (OPENED, "never closed </thi", "never closed </thi", ""),
    (OPENED, "</think>answer", None, "answer"),
    (None, "<think>x</think>y", None, "<think>x</think>y"),
    (R.detect(MAGISTRAL), "[THINK]hm[/THINK]Yes.", "hm", "Yes."),
    (R.detect(GEMMA4), "<|channel>thought\nplan<channel|>Done.", "\nplan", "Done."),
    (HARMONY, "<|channel|>analysis<|message|>User asks.<|end|><|start|>assistant<|channel|>final<|message|>"
              "Hello!<|return|>", "User asks.", "Hello!"),
    (HARMONY, "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary "
              'to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>', "Need weather.",
     '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>'),
    (HARMONY, "<|channel|>analysis<|message|>cut by max_tokens", "cut by max_tokens", ""),
    (HARMONY, "plain text, no channels <|", None, "plain text, no channels <|"),
    (R.Thinking("harmony", HARMONY.start, HARMONY.end, opened=True), "thinking<|end|><|start|>assistant<|channel|>"
     "final<|message|>ok", "thinking", "ok"),
]


@pytest.mark.parametrize("thinking,text,want_r,want_c", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_exact_split_and_every_cut_gives_the_same(thinking, text, want_r, want_c):
    assert R.split(text, thinking) == (want_r, want_c)
    for i in range(len(text) + 1):  # two pieces, cut at every boundary
        rs, cs = _stream(thinking, _pieces(text, [i]))
        assert ("".join(rs) or None, "".join(cs)) == (want_r, want_c), i
    rs, cs = _stream(thinking, list(text))  # one character at a time
    assert ("".join(rs) or None, "".join(cs)) == (want_r, want_c)
    if thinking is not None and len(text) < 60:  # three pieces, every pair of cuts
        for i in range(len(text) + 1):
            for j in range(i, len(text) + 1):
                rs, cs = _stream(thinking, _pieces(text, [i, j]))
                assert ("".join(rs) or None, "".join(cs)) == (want_r, want_c), (i, j)


@pytest.mark.parametrize("thinking,text", [(c[0], c[1]) for c in CASES if c[0] is not None],
                         ids=[f"case{i}" for i, c in enumerate(CASES) if c[0] is not None])
def test_markers_never_reach_content_deltas(thinking, text):
    """No content delta, however the text is cut, carries a marker or a start of one that the text later
    completes (a held-back tail that turns out to be text goes out in a later delta)."""
    markers = ([thinking.start, thinking.end] if thinking.kind == "tags"
               else ["<|channel|>analysis", "<|channel|>final", "<|start|>", "<|end|>", "<|return|>"])
    if "to=functions" in text:
        return  # a harmony tool call passes through whole for the tool parser
    for i in range(len(text) + 1):
        _, cs = _stream(thinking, _pieces(text, [i]))
        for c in cs:
            for m in markers:
                assert m not in c or m in R.split(text, thinking)[1]


def test_in_thinking_tracks_the_block():
    s = R.Splitter(THINK)
    s.feed("<think>a")
    assert s.in_thinking
    s.feed("</think>b")
    assert not s.in_thinking
    s = R.Splitter(OPENED)
    assert s.in_thinking
    h = R.Splitter(HARMONY)
    h.feed("<|channel|>analysis<|message|>x")
    assert h.in_thinking
    h.feed("<|end|><|start|>assistant<|channel|>final<|message|>y")
    assert not h.in_thinking


@pytest.mark.parametrize("thinking,text", [
    (THINK, "<" * (1 << 20)),
    (THINK, "<think>" + "</thin" * (1 << 18)),
    (OPENED, "</think" * (1 << 17) + "x"),
    (HARMONY, "<|channel|>" * (1 << 17)),
    (HARMONY, "<|channel|>analysis<|message|>" + "<|en" * (1 << 18)),
    (HARMONY, ("<|start|>" + "a" * 200) * 5000),
    (HARMONY, "<|start|>" + "a" * 250 + "<|message|>x"),
    (THINK, " " * (1 << 20) + "<think>x"),
], ids=[f"hostile{i}" for i in range(8)])
def test_hostile_text_is_linear(thinking, text):
    t0 = time.perf_counter()
    whole = R.split(text, thinking)
    rs, cs = _stream(thinking, [text[i:i + 7] for i in range(0, len(text), 7)])
    assert ("".join(rs) or None, "".join(cs)) == whole
    assert time.perf_counter() - t0 < 10  # ~1 MB cut in 7-character pieces; quadratic work would take minutes


def test_fuzz_any_cut_gives_the_whole_split():
    """Seeded random texts built from the markers' pieces, for every convention, cut at random places."""
    import random

    rng = random.Random(38)
    parts = ["<think>", "</think>", "<thi", "</", "[THINK]", "[/THINK]", "<|channel>thought", "<channel|>", "<|start|>",
             "<|channel|>", "analysis", "final", "commentary to=functions.f", "<|message|>", "<|end|>", "<|return|>",
             "<|call|>", "<|", "|>", " ", "\n", "x", "hello"]
    conventions = [THINK, OPENED, HARMONY, R.detect(MAGISTRAL), R.detect(GEMMA4), None]
    for _ in range(3000):
        text = "".join(rng.choice(parts) for _ in range(rng.randint(0, 12)))
        thinking = rng.choice(conventions)
        whole = R.split(text, thinking)
        cuts = sorted(rng.randint(0, len(text)) for _ in range(rng.randint(1, 4)))
        rs, cs = _stream(thinking, _pieces(text, cuts))
        assert ("".join(rs) or None, "".join(cs)) == whole, (thinking, text, cuts)
