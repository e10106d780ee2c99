"""Images through ``Runtime.chat`` and ``ondevice chat --image`` (#38 item 2) with a tiny random projector beside a
tiny text model: the same image gives the same greedy answer with and without n-gram speculation and when its
prefix is reused from the cache; another image is never taken for the cached one; a text-only model given an
image is one line naming the missing projector."""

from __future__ import annotations

import base64
import shutil

import pytest
from typer.testing import CliRunner

from ondevice.errors import OndeviceError
from ondevice.loader import load
from ondevice.testing.vision import make_tiny_mmproj, png_bytes, random_image

pytest.importorskip("llama_cpp.mtmd_cpp")


@pytest.fixture(scope="module")
def vlm(tiny_gguf, tmp_path_factory):
    """A folder as LM Studio keeps a VLM: the text model and its mmproj*.gguf side by side, and two images."""
    d = tmp_path_factory.mktemp("vlm")
    shutil.copy(tiny_gguf("llama"), d / "tiny-llama-q8_0.gguf")
    make_tiny_mmproj(d / "mmproj-tiny-f16.gguf", seed=3)
    for i in (1, 2):
        (d / f"img{i}.png").write_bytes(png_bytes(random_image(i)))
    return d


def _messages(image) -> list[dict]:
    return [{"role": "system", "content": "Describe images. " * 3},
            {"role": "user", "content": [{"type": "text", "text": "What is in this picture? "},
                                         {"type": "image_url", "image_url": {"url": image}},
                                         {"type": "text", "text": " Answer in detail, then repeat it."}]}]


def _data_url(path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


def test_same_image_same_greedy_answer_with_and_without_speculation(vlm):
    model, img = vlm / "tiny-llama-q8_0.gguf", vlm / "img1.png"
    with load(model, drafter="none", n_ctx=512, threads=1) as rt:
        assert rt.mmproj == vlm / "mmproj-tiny-f16.gguf" and rt.projector is None  # found, attached at first use
        plain = rt.chat(_messages(_data_url(img)), max_tokens=24, temperature=0)
        assert rt.projector is not None and plain.stats.cached_tokens == 0
        again = rt.chat(_messages(str(img)), max_tokens=24, temperature=0)  # the same pixels by path: reused
        assert again.tokens == plain.tokens and again.stats.cached_tokens == again.stats.prompt_tokens - 1
        assert sum(isinstance(k, tuple) for k in rt.slot.kv) == 16  # the cache's image positions keep the image's key
    with load(model, drafter="ngram", n_ctx=512, threads=1) as rt:
        spec = rt.chat(_messages(str(img)), max_tokens=24, temperature=0, gamma=3)
        assert spec.tokens == plain.tokens and spec.stats.drafted > 0
        assert spec.stats.prompt_tokens == plain.stats.prompt_tokens


def test_another_image_is_not_taken_for_the_cached_one(vlm):
    model = vlm / "tiny-llama-q8_0.gguf"
    with load(model, drafter="none", n_ctx=512, threads=1) as rt:
        fresh = rt.chat(_messages(str(vlm / "img2.png")), max_tokens=16, temperature=0)
    with load(model, drafter="none", n_ctx=512, threads=1) as rt:
        first = rt.chat(_messages(str(vlm / "img1.png")), max_tokens=16, temperature=0)
        second = rt.chat(_messages(str(vlm / "img2.png")), max_tokens=16, temperature=0)
        text = rt.chat([{"role": "user", "content": "hello"}], max_tokens=4, temperature=0)  # text after images
    assert second.tokens == fresh.tokens != first.tokens
    assert 0 < second.stats.cached_tokens < second.stats.prompt_tokens - 16  # the text before the image only
    assert text.stats.tokens == 4


def test_text_only_model_given_an_image_is_one_line(tiny_gguf, vlm):
    with load(tiny_gguf("llama"), drafter="none", n_ctx=256, threads=1) as rt:
        assert rt.mmproj is None
        with pytest.raises(OndeviceError, match=r"^model.gguf: this model has no vision projector .*pass --mmproj"):
            rt.chat(_messages(str(vlm / "img1.png")), max_tokens=4)
        assert rt.chat([{"role": "user", "content": "hi"}], max_tokens=2).stats.tokens == 2  # still serving
    with pytest.raises(OndeviceError, match="no such projector file"):
        load(tiny_gguf("llama"), drafter="none", n_ctx=256, mmproj=vlm / "nope.gguf")
    with load(tiny_gguf("llama"), drafter="none", n_ctx=256, threads=1, mmproj=vlm / "mmproj-tiny-f16.gguf") as rt:
        assert rt.chat(_messages(str(vlm / "img1.png")), max_tokens=3).stats.tokens == 3  # named: loaded at once


def test_bad_image_is_one_line_and_the_runtime_goes_on(vlm):
    with load(vlm / "tiny-llama-q8_0.gguf", drafter="none", n_ctx=512, threads=1) as rt:
        (vlm / "bad.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 40)
        with pytest.raises(OndeviceError, match="bad.png"):
            rt.chat(_messages(str(vlm / "bad.png")), max_tokens=4)
        with pytest.raises(OndeviceError, match="image_url.url"):
            rt.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], max_tokens=4)
        assert rt.chat(_messages(str(vlm / "img1.png")), max_tokens=3).stats.tokens == 3


def test_cli_chat_image(vlm, tiny_gguf):
    from ondevice.cli.main import app

    model = str(vlm / "tiny-llama-q8_0.gguf")
    args = ["chat", model, "--no-spec", "--max-tokens", "6", "--temperature", "0", "--n-ctx", "512", "--threads", "1"]
    r = CliRunner().invoke(app, [*args, "--image", str(vlm / "img1.png")], input="What is it?\nAnd now?\n")
    assert r.exit_code == 0, r.output
    r2 = CliRunner().invoke(app, args, input=f"/image {vlm / 'img1.png'}\nWhat is it?\nAnd now?\n")
    assert r2.exit_code == 0 and r2.stdout == r.stdout  # /image attaches to the next message: the same answers
    r = CliRunner().invoke(app, ["chat", str(tiny_gguf("llama")), "--no-spec", "--max-tokens", "2", "--image",
                                 str(vlm / "img1.png")], input="What is it?\n")
    assert r.exit_code == 1 and "no vision projector" in r.output
