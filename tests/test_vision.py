"""Images in through libmtmd: a tiny random-weight projector beside a tiny text model (#38 item 2).

The image must reach the logits (different pixels → different logits; the same pixels in another file →
the same logits), greedy decoding after the image prefix is deterministic and equals a batched verify
(what speculation does on the text after the image), and bad images / missing projectors are one-line
OndeviceErrors that leave the projector usable.
"""

from __future__ import annotations

import base64
import hashlib
import shutil
import struct
import zlib

import numpy as np
import pytest

from ondevice.errors import OndeviceError
from ondevice.images import load_image
from ondevice.testing.vision import ProjectorShape, make_tiny_mmproj, png_bytes, png_header_only, random_image

pytest.importorskip("llama_cpp.mtmd_cpp")

USER = "<|im_start|>user\nWhat is in this picture? "
AFTER = "\nAnswer briefly.<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def vlm(tiny_gguf, tmp_path_factory):
    """A folder as LM Studio keeps a VLM: the text model and its mmproj*.gguf side by side."""
    d = tmp_path_factory.mktemp("vlm")
    shutil.copy(tiny_gguf("llama"), d / "tiny-llama-q8_0.gguf")
    make_tiny_mmproj(d / "mmproj-tiny-f16.gguf", seed=3)
    return d / "tiny-llama-q8_0.gguf"


@pytest.fixture(scope="module")
def proj(vlm):
    from ondevice.backends.llama import LlamaBackend
    from ondevice.backends.llama_mtmd import attach

    b = LlamaBackend(vlm, n_ctx=512, device="cpu")
    p = attach(b)  # found beside the model
    yield p
    p.close()
    b.close()


def _img(seed: int, level: int = 6):
    return load_image(png_bytes(random_image(seed)) if level == 6 else _png(random_image(seed), level))


def _png(rgb: np.ndarray, level: int) -> bytes:
    """The same pixels as ``png_bytes`` with another zlib level: other bytes (another SHA-256), same image."""
    data = png_bytes(rgb)
    raw = b"".join(b"\x00" + rgb[y].tobytes() for y in range(rgb.shape[0]))
    idat = zlib.compress(raw, level)
    ihdr_end = 8 + 25
    chunk = struct.pack(">I", len(idat)) + b"IDAT" + idat + struct.pack(">I", zlib.crc32(b"IDAT" + idat))
    return data[:ihdr_end] + chunk + data[-12:]


def _logits(proj, image) -> np.ndarray:
    with proj.tokenize([USER, image, AFTER]) as p:
        return proj.eval(p).copy()


def _greedy(proj, image, n: int = 12) -> list[int]:
    with proj.tokenize([USER, image, AFTER]) as p:
        logits = proj.eval(p)
    out = []
    for _ in range(n):
        out.append(int(np.argmax(logits)))
        logits = proj.backend.eval(out[-1:], "last")[-1]
    return out


def test_tiny_projector_loads_beside_the_model(vlm, proj):
    from ondevice.backends.mmproj import find_mmproj

    assert find_mmproj(vlm) == vlm.parent / "mmproj-tiny-f16.gguf"
    with proj.tokenize([USER, _img(1), AFTER]) as p:
        kinds = [(c.kind, c.n_tokens) for c in p.chunks]
        assert kinds[1] == ("image", 16) and [k for k, _ in kinds] == ["text", "image", "text"]
        assert p.chunks[1].image_id == hashlib.sha256(png_bytes(random_image(1))).hexdigest()
        n_past, tail = proj.eval_prefix(p)
        assert n_past == p.chunks[0].n_tokens + 16 == proj.backend.n_past
        assert tail == list(p.chunks[2].tokens) and len(p.key) == p.n_pos
        ids = p.ids(fill=-1)
        assert len(ids) == p.n_pos and ids.count(-1) == 16 and ids[-len(tail):] == tail


def test_find_mmproj_prefers_f16_and_ignores_other_files(tmp_path):
    from ondevice.backends.mmproj import find_mmproj

    model = tmp_path / "m.gguf"
    model.write_bytes(b"")
    assert find_mmproj(model) is None
    for n in ("mmproj-F32.gguf", "mmproj-model-f16.gguf", "mmproj-notes.txt", "model-Q4_K_M.gguf"):
        (tmp_path / n).write_bytes(b"")
    assert find_mmproj(model) == tmp_path / "mmproj-model-f16.gguf"


def test_same_image_same_greedy_continuation(proj):
    first = _greedy(proj, _img(1))
    _greedy(proj, _img(2))
    assert _greedy(proj, _img(1)) == first  # after another image in between: nothing of it left behind


def test_the_image_reaches_the_logits_and_the_hidden_state(proj):
    a, b = _logits(proj, _img(1)), _logits(proj, _img(2))
    assert np.abs(a - b).max() > 1e-2
    # The same pixels in a differently compressed file (another SHA-256): the same logits, bit for bit.
    same = _img(1, level=1)
    assert same.data != _img(1).data
    np.testing.assert_array_equal(_logits(proj, same), a)
    # The post-norm hidden state of the last prompt position differs too (what heads drafters read).
    be = proj.backend
    be.enable_hidden()
    try:
        hs = []
        for seed in (1, 2):
            with proj.tokenize([USER, _img(seed), AFTER]) as p:
                proj.eval(p)
            hs.append(be.hidden(be.n_past - 1).copy())
        assert np.abs(hs[0] - hs[1]).max() > 1e-3
    finally:
        be.want_hidden(False)


def test_greedy_after_the_image_equals_a_batched_verify_and_rollback(proj):
    """Speculation on the text after the image: verifying k drafted tokens in one batch gives the logits of
    decoding them one by one, and rolling back inside the text tail leaves the image prefix intact."""
    seq = _greedy(proj, _img(4), n=8)
    be = proj.backend
    with proj.tokenize([USER, _img(4), AFTER]) as p:
        first = proj.eval(p)
        base = be.n_past
        rows = be.eval(seq[:-1], "all")  # a verify step over the drafted chain
        assert int(np.argmax(first)) == seq[0]
        assert [int(np.argmax(r)) for r in rows] == seq[1:]
        be.rollback(base + 3)  # rejected drafts
        again = be.eval(seq[3:7], "all")
        assert [int(np.argmax(r)) for r in again] == seq[4:8]
        np.testing.assert_allclose(again, rows[3:7], rtol=0, atol=1e-3)
        # Prefix reuse: the cache still holds this prompt; evaluating from a position inside the last text
        # chunk (or inside the image: re-done whole) reproduces the same first logits.
        np.testing.assert_array_equal(proj.eval(p, n_past=base - 2), first)
        np.testing.assert_array_equal(proj.eval(p, n_past=p.chunks[0].n_tokens + 5), first)


def _one_line_error(fn, *words):
    with pytest.raises(OndeviceError) as e:
        fn()
    msg = str(e.value)
    assert "\n" not in msg, msg
    for w in words:
        assert w.lower() in msg.lower(), (w, msg)
    return msg


def test_bad_images_are_one_clear_error_and_the_projector_keeps_working(proj, tmp_path):
    good = png_bytes(random_image(5))
    cut = good[: len(good) // 2]  # truncated inside IDAT: passes the header checks, stb_image refuses it
    _one_line_error(lambda: proj.tokenize([USER, load_image(cut), AFTER]), "cannot be decoded")
    _one_line_error(lambda: load_image(b"\x89PNG\r\n\x1a\n" + b"\0" * 40), "png")
    _one_line_error(lambda: load_image(b"hello, I am not an image"), "not a png, jpeg", "convert")
    _one_line_error(lambda: load_image(b"RIFF\0\0\0\0WEBPVP8 " + b"\0" * 32), "webp", "convert")
    _one_line_error(lambda: load_image(b"\xff\xd8\xff\xe0\x00\x10JFIF\0" + b"\0" * 16), "jpeg")
    _one_line_error(lambda: load_image(png_header_only(100_000, 100_000, zlib.compress(b"\0" * 99))), "100000×100000",
                    "limit")
    bomb = zlib.compress(b"\0" * (64 << 20), 9)  # 64 MiB of zeros for a 4×4 image, ~64 KB on disk
    _one_line_error(lambda: load_image(png_header_only(4, 4, bomb)), "decompression bomb")
    _one_line_error(lambda: load_image(png_header_only(4, 4, b"not zlib at all")), "corrupt")
    _one_line_error(lambda: load_image(good, max_bytes=100), "limit")
    gguf = proj.path.read_bytes()[:4096]
    _one_line_error(lambda: load_image(gguf), "not a png")
    _one_line_error(lambda: load_image(tmp_path / "nope.png"), "no such image file")
    _one_line_error(lambda: load_image("https://example.com/cat.png"), "not fetched")
    _one_line_error(lambda: load_image("data:text/plain;base64,aGk="), "not an image")
    _one_line_error(lambda: load_image("data:image/png;base64,@@@@"), "base64")
    _one_line_error(lambda: proj.tokenize([USER, good, AFTER]), "checked image")
    # …and the same projector still answers, identically.
    assert _greedy(proj, _img(1), n=4) == _greedy(proj, _img(1), n=4)


def test_images_by_path_file_url_and_data_url_are_the_same_image(proj, tmp_path):
    data = png_bytes(random_image(6))
    f = tmp_path / "photo.png"
    f.write_bytes(data)
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    imgs = [load_image(f), load_image(str(f)), load_image("file://" + str(f)), load_image(url), load_image(data)]
    assert {i.data for i in imgs} == {data} and {(i.format, i.width, i.height) for i in imgs} == {("png", 48, 48)}
    assert imgs[0].name == str(f) and imgs[3].name == "data URL"


def test_a_text_only_model_asked_with_an_image_names_the_missing_projector(tiny_gguf, tmp_path):
    from ondevice.backends.llama import LlamaBackend
    from ondevice.backends.llama_mtmd import attach

    shutil.copy(tiny_gguf("llama"), tmp_path / "text-only.gguf")
    b = LlamaBackend(tmp_path / "text-only.gguf", n_ctx=256, device="cpu")
    try:
        _one_line_error(lambda: attach(b), "text-only.gguf", "projector", "--mmproj")
        # --mmproj pointing at a text model, at nothing, or at a projector for another width: one line each.
        _one_line_error(lambda: attach(b, tmp_path / "text-only.gguf"), "not a vision projector", "mmproj")
        _one_line_error(lambda: attach(b, tmp_path / "missing.gguf"), "no such projector file", "--mmproj")
        other = make_tiny_mmproj(tmp_path / "mmproj-other.gguf", shape=ProjectorShape(n_embd_text=128))
        _one_line_error(lambda: attach(b, other), "mmproj-other.gguf", "another model", "n_embd")
        cut = tmp_path / "mmproj-cut.gguf"
        cut.write_bytes(other.read_bytes()[:-1000])
        _one_line_error(lambda: attach(b, cut), "truncated")
    finally:
        b.close()


def _encoded(rgb: np.ndarray) -> dict[str, bytes]:
    import io

    pil = pytest.importorskip("PIL.Image")
    out = {"png": png_bytes(rgb)}
    for fmt, kw in (("jpeg", {}), ("progressive jpeg", {"progressive": True}), ("gif", {}), ("bmp", {})):
        buf = io.BytesIO()
        pil.fromarray(rgb).save(buf, fmt.split()[-1].upper(), **kw)
        out[fmt] = buf.getvalue()
    return out


def test_every_supported_format_decodes_and_lossless_ones_give_the_same_logits(proj):
    rgb = random_image(7)
    files = _encoded(rgb)
    ref = _logits(proj, load_image(files["png"]))
    for fmt, data in files.items():
        img = load_image(data)
        assert (img.format, img.width, img.height) == (fmt.split()[-1], 48, 48)
        got = _logits(proj, img)
        if fmt == "bmp":  # lossless and RGB: the same pixels, so the same logits bit for bit
            np.testing.assert_array_equal(got, ref)


def test_mutated_images_never_crash_only_decode_or_refuse_in_one_line(proj):
    """Hostile files: random byte flips and truncations of every format reach libmtmd's decoder or are
    refused before it; either way the process survives and the error is one line."""
    rng = np.random.default_rng(0)
    refused = 0
    for data in _encoded(random_image(8)).values():
        for _ in range(40):
            d = bytearray(data)
            for _ in range(int(rng.integers(1, 8))):
                d[int(rng.integers(0, len(d)))] = int(rng.integers(0, 256))
            if rng.random() < 0.3:
                d = d[: int(rng.integers(1, len(d)))]
            try:
                with proj.tokenize([USER, load_image(bytes(d)), AFTER]) as p:
                    assert np.isfinite(proj.eval(p)).all()
            except OndeviceError as e:
                assert "\n" not in str(e)
                refused += 1
    assert 0 < refused < 200


def test_markers_in_user_text_are_text_and_interleave_places_images(proj):
    from ondevice.images import interleave, new_marker

    with proj.tokenize([USER + "<__media__> <image> <start_of_image>", AFTER]) as p:
        assert [c.kind for c in p.chunks] == ["text"]
    m = new_marker()
    assert m != new_marker()
    a, b = _img(1), _img(2)
    parts = interleave(f"{USER}{m} and {m}{AFTER}", m, [a, b])
    assert parts == [USER, a, " and ", b, AFTER]
    with proj.tokenize(parts) as p:
        assert [c.kind for c in p.chunks] == ["text", "image", "text", "image", "text"]
        assert [c.image_id for c in p.chunks if c.kind == "image"] == [
            hashlib.sha256(i.data).hexdigest() for i in (a, b)]
        proj.eval(p)
        assert proj.backend.n_past == p.n_pos
    _one_line_error(lambda: interleave(f"{USER}{AFTER}", m, [a]), "kept 0 of 1 images")


def test_find_mmproj_in_ollamas_store(tmp_path):
    """Ollama keeps a VLM's projector as a layer of the model's manifest, in a blob of its own."""
    import json

    from ondevice.backends.mmproj import find_mmproj

    blobs, model, projector = tmp_path / "blobs", "a" * 64, "b" * 64
    blobs.mkdir()
    for d in (model, projector, "c" * 64):
        (blobs / f"sha256-{d}").write_bytes(b"GGUF")
    manifest = tmp_path / "manifests" / "registry.ollama.ai" / "library" / "llava" / "7b"
    manifest.parent.mkdir(parents=True)
    layers = [{"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{model}"},
              {"mediaType": "application/vnd.ollama.image.projector", "digest": f"sha256:{projector}"}]
    manifest.write_text(json.dumps({"layers": layers}))
    (manifest.parent / "broken").write_text("{not json")
    assert find_mmproj(blobs / f"sha256-{model}") == blobs / f"sha256-{projector}"
    assert find_mmproj(blobs / f"sha256-{'c' * 64}") is None  # a text-only model's blob


G_USER = "<start_of_turn>user\nWhat is in this picture? "
G_AFTER = "<end_of_turn>\n<start_of_turn>model\n"


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """A tiny Gemma 3 text model with a Gemma 3 projector beside it (libmtmd decodes its images
    non-causally, between <start_of_image> and <end_of_image>)."""
    from converters import convert
    from ondevice.backends.llama import LlamaBackend
    from ondevice.backends.llama_mtmd import attach
    from ondevice.testing import make_tiny_hf

    d = tmp_path_factory.mktemp("gemma3-vlm")
    make_tiny_hf(d / "hf", arch="gemma3_text", seed=0)
    convert(d / "hf", to="gguf", quant="q8_0", out=d / "gguf", progress=False)
    make_tiny_mmproj(d / "gguf" / "mmproj-gemma3-f32.gguf", kind="gemma3", seed=5)
    b = LlamaBackend(d / "gguf" / "model.gguf", n_ctx=512, device="cpu")
    p = attach(b)
    yield p
    p.close()
    b.close()


def test_gemma3_projector_and_causal_text_after_its_non_causal_image(gemma):
    """After a non-causally decoded image the text must be causal again: greedy one by one equals a
    batched verify (what speculation relies on). The control turns causal attention off after the image
    and shows the same check then fails."""
    be, lib = gemma.backend, gemma.backend._lib
    assert gemma._mtmd.mtmd_decode_use_non_causal(gemma._ctx, None)  # libmtmd's own Gemma 3 rule
    outs = {}
    for seed in (1, 2):
        with gemma.tokenize([G_USER, _img(seed), G_AFTER]) as p:
            assert [(c.kind, c.n_tokens) for c in p.chunks if c.kind == "image"] == [("image", 4)]
            logits = gemma.eval(p)
            outs[seed] = logits.copy()
            seq = [int(np.argmax(logits))]
            for _ in range(7):
                seq.append(int(np.argmax(be.eval(seq[-1:], "last")[-1])))
            gemma.eval(p)  # back to the prompt alone
            rows = be.eval(seq[:-1], "all")
            assert [int(np.argmax(r)) for r in rows] == seq[1:]
            if seed == 1:  # the control: a context left non-causal after the image
                gemma.eval(p)
                lib.llama_set_causal_attn(be._ctx, False)
                try:
                    bad = be.eval(seq[:-1], "all")
                finally:
                    lib.llama_set_causal_attn(be._ctx, True)
                assert np.abs(bad - rows).max() > 1e-3
    assert np.abs(outs[1] - outs[2]).max() > 1e-3


def test_a_closed_model_or_projector_is_an_error_not_a_crash(vlm):
    from ondevice.backends.llama import LlamaBackend
    from ondevice.backends.llama_mtmd import attach

    b = LlamaBackend(vlm, n_ctx=256, device="cpu")
    p = attach(b)
    _one_line_error(lambda: p.tokenize(["bad \udcff text"]), "prompt part 0", "utf-8")
    b.close()  # the model first: libmtmd must not read its freed vocabulary
    _one_line_error(lambda: p.tokenize([USER, _img(1), AFTER]), "closed")
    p.close()
    _one_line_error(lambda: p.tokenize([USER]), "projector was closed")


@pytest.mark.parametrize("shape", [(1, 1), (1, 8192), (8192, 1), (3, 5)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_tiny_and_extreme_aspect_images_encode(proj, shape):
    img = load_image(png_bytes(np.full((*shape, 3), 200, np.uint8)))
    with proj.tokenize([USER, img, AFTER]) as p:
        assert [c.n_tokens for c in p.chunks if c.kind == "image"] == [16]
        assert np.isfinite(proj.eval(p)).all()
