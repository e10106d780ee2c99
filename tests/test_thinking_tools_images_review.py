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
