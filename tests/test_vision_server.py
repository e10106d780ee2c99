"""Images through ``ondevice serve`` (#38 item 2), with the openai client on loopback: a tiny VLM (a tiny text
model with a tiny random projector beside it) answers an ``image_url`` data URL the same with and without n-gram
speculation; a text-only model given an image is one 400 naming the missing projector and the server keeps
serving; a path or http URL as an image is refused (a client never makes the server read its files)."""

from __future__ import annotations

import base64
import shutil

import pytest

from ondevice.testing.vision import make_tiny_mmproj, png_bytes, random_image

pytest.importorskip("llama_cpp.mtmd_cpp")
openai = pytest.importorskip("openai")


def _ask(image_url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": "What is in this picture? "},
                                         {"type": "image_url", "image_url": {"url": image_url}},
                                         {"type": "text", "text": " Answer in detail, then repeat it."}]}]


def test_images_through_the_server(tiny_gguf, tmp_path):
    from ondevice.server.run import launch

    vlm = tmp_path / "vlm"
    vlm.mkdir()
    shutil.copy(tiny_gguf("llama"), vlm / "tiny-vlm.gguf")
    make_tiny_mmproj(vlm / "mmproj-tiny-f16.gguf", seed=3)
    img = vlm / "img.png"
    img.write_bytes(png_bytes(random_image(1)))
    url = "data:image/png;base64," + base64.b64encode(img.read_bytes()).decode()
    proc, base = launch(str(vlm / "tiny-vlm.gguf"), str(tiny_gguf("llama")), "--threads", "1", "--n-ctx", "512",
                        "--ngram")
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=300)
        kw = dict(model="tiny-vlm", messages=_ask(url), max_tokens=24, temperature=0)
        plain = client.chat.completions.create(**kw, extra_body={"gamma": 0})
        spec = client.chat.completions.create(**kw, extra_body={"gamma": 3})
        assert plain.choices[0].message.content == spec.choices[0].message.content
        assert plain.usage.completion_tokens > 0
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            **kw, stream=True, extra_body={"gamma": 3}) if c.choices)
        assert streamed == plain.choices[0].message.content
        other = "data:image/png;base64," + base64.b64encode(png_bytes(random_image(2))).decode()
        assert client.chat.completions.create(**{**kw, "messages": _ask(other)}, extra_body={"gamma": 0}) \
            .choices[0].message.content != plain.choices[0].message.content  # the image is read, not ignored
        for bad in (str(img), img.as_uri(), "http://127.0.0.1:1/x.png"):  # never a file of this machine
            with pytest.raises(openai.BadRequestError, match="data: URL"):
                client.chat.completions.create(**{**kw, "messages": _ask(bad)})
        with pytest.raises(openai.BadRequestError, match="no vision projector.*--mmproj"):
            client.chat.completions.create(**{**kw, "model": "model"})
        again = client.chat.completions.create(model="model", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=3, temperature=0)
        assert again.usage.completion_tokens > 0  # the server keeps serving
    finally:
        proc.terminate()
        proc.wait(timeout=60)
