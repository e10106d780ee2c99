"""Image inputs as untrusted data: read a local path, a ``data:`` URL or raw bytes, and check the format and
the size from the header before any decoder sees them (no backend imports; libmtmd and mlx-vlm decode).

Formats: PNG, JPEG, GIF (first frame) and BMP, the ones every decoder here reads (stb_image in libmtmd).
Limits: ``MAX_IMAGE_BYTES`` of file and ``MAX_IMAGE_SIDE`` / ``MAX_IMAGE_PIXELS`` as the header declares
them, so a small file cannot ask the decoder for gigabytes; a PNG's compressed stream is also inflated
here (bounded, output discarded) so a decompression bomb is refused before the decoder allocates for it.
Every refusal is one ``OndeviceError`` line naming the image and the fix.
"""

from __future__ import annotations

import base64
import binascii
import os
import re
import secrets
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

from ondevice.errors import OndeviceError

MAX_IMAGE_BYTES = 20 * 1024 * 1024
MAX_IMAGE_SIDE = 8192
MAX_IMAGE_PIXELS = 8192 * 4096
FORMATS = ("png", "jpeg", "gif", "bmp")
_DATA_URL = re.compile(r"data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w.+-]+=[\w.+-]+)*)(?P<b64>;base64)?,", re.I)
_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}


@dataclass(frozen=True)
class Image:
    """A checked image: its file bytes (still encoded), format and declared size.

    Attributes:
        data: the encoded file, as given.
        format: one of ``FORMATS``.
        width, height: pixels, from the header.
        name: what to call it in errors (a path, "data URL", "image 2").
    """

    data: bytes
    format: str
    width: int
    height: int
    name: str


def load_image(src: str | Path | bytes, *, name: str | None = None, max_bytes: int = MAX_IMAGE_BYTES,
               max_side: int = MAX_IMAGE_SIDE, max_pixels: int = MAX_IMAGE_PIXELS) -> Image:
    """Read and check one image.

    Args:
        src: raw file bytes, a ``data:image/...;base64,`` URL, a ``file://`` URL or a local path.
            http(s) URLs are refused here: fetching is the caller's decision (and its own limits).
        name: what errors call the image (default: the path, or "data URL" / "image bytes").
        max_bytes, max_side, max_pixels: the limits (file size; each side and width × height as declared).
    Returns:
        The checked ``Image``.
    Raises:
        OndeviceError: unreadable, too big, not a supported format, or a corrupt / hostile header.
    """
    if isinstance(src, (bytes, bytearray, memoryview)):
        data, label = bytes(src), name or "image bytes"
    elif isinstance(src, (str, Path)):
        data, label = _read_source(src, name, max_bytes)
    else:
        raise OndeviceError(f"an image must be a path, a data: URL or bytes, not {type(src).__name__}")
    if len(data) > max_bytes:
        raise OndeviceError(f"{label}: {len(data)} bytes is over the {max_bytes}-byte image limit; send a smaller image")
    fmt, w, h = sniff(data, label)
    if w <= 0 or h <= 0:
        raise OndeviceError(f"{label}: the {fmt.upper()} header declares a {w}×{h} image; the file is corrupt")
    if w > max_side or h > max_side or w * h > max_pixels:
        raise OndeviceError(f"{label}: {w}×{h} pixels is over the image limit ({max_side} per side, {max_pixels} "
                            "pixels); downscale it first")
    if fmt == "png":
        _check_png_stream(data, w, h, label)
    return Image(data, fmt, w, h, label)


def new_marker() -> str:
    """A per-request image placeholder no user text can forge (``interleave`` splits on it)."""
    return f"<ondevice-image-{secrets.token_hex(8)}>"


def interleave(text: str, marker: str, images: list[Image]) -> list[str | Image]:
    """Split a rendered prompt at each ``marker`` and put the images there, in order.

    Args:
        text: the prompt as the chat template rendered it, with ``marker`` where each image goes (render
            image content parts as the marker text, as llama-server does with its media marker).
        marker: from ``new_marker()``.
        images: one per marker.
    Returns:
        The parts for ``Projector.tokenize``: strings (empty ones dropped) and images.
    Raises:
        OndeviceError: the count of markers and images differ (a template that drops image parts).
    """
    pieces = text.split(marker)
    if len(pieces) - 1 != len(images):
        raise OndeviceError(f"the chat template kept {len(pieces) - 1} of {len(images)} images; this model's template "
                            "does not place images where the messages have them")
    out: list[str | Image] = []
    for i, piece in enumerate(pieces):
        if piece:
            out.append(piece)
        if i < len(images):
            out.append(images[i])
    return out


def _read_source(src: str | Path, name: str | None, max_bytes: int) -> tuple[bytes, str]:
    s = str(src)
    if isinstance(src, str) and s[:5].lower() == "data:":
        return _data_url(s, name or "data URL", max_bytes), name or "data URL"
    if isinstance(src, str) and re.match(r"(?i)https?://", s):
        raise OndeviceError(f"{s[:80]}: images by http(s) URL are not fetched; download the image and pass the file "
                            "or a data: URL")
    if isinstance(src, str) and s[:7].lower() == "file://":
        s = s[7:]
    path = Path(s).expanduser()
    label = name or str(path)
    try:
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)
            if len(data) > max_bytes:  # the read stops past the limit: name the file's own size
                n = os.fstat(f.fileno()).st_size
                raise OndeviceError(f"{label}: {n} bytes is over the {max_bytes}-byte image limit; send a smaller "
                                    "image")
    except FileNotFoundError:
        raise OndeviceError(f"{label}: no such image file; check the path") from None
    except IsADirectoryError:
        raise OndeviceError(f"{label}: is a folder, not an image file") from None
    except OSError as e:
        raise OndeviceError(f"{label}: cannot read this image ({e.strerror or e}); check the path and permissions") from None
    return data, label


def _data_url(url: str, label: str, max_bytes: int) -> bytes:
    m = _DATA_URL.match(url)
    if not m:
        raise OndeviceError(f"{label}: not a valid data URL; use data:image/png;base64,<base64 data>")
    mime = (m.group("mime") or "").lower()
    if not mime.startswith("image/"):
        raise OndeviceError(f"{label}: media type {mime or 'text/plain'!r} is not an image; send data:image/...")
    if not m.group("b64"):
        raise OndeviceError(f"{label}: only base64 data URLs are read; use data:{mime};base64,<base64 data>")
    body = url[m.end():]
    if len(body) > (max_bytes + 2) // 3 * 4 + 4:
        raise OndeviceError(f"{label}: over the {max_bytes}-byte image limit; send a smaller image")
    try:
        return base64.b64decode(re.sub(r"\s+", "", body), validate=True)
    except (binascii.Error, ValueError):
        raise OndeviceError(f"{label}: the base64 data is corrupt; re-encode the image") from None


def sniff(data: bytes, label: str = "image") -> tuple[str, int, int]:
    """(format, width, height) from the header; OndeviceError for anything not a supported image."""
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        if len(data) < 24 or data[12:16] != b"IHDR":
            raise OndeviceError(f"{label}: a truncated or corrupt PNG (no IHDR header); re-export the image")
        w, h = struct.unpack(">II", data[16:24])
        return "png", w, h
    if data[:3] == b"\xff\xd8\xff":
        return ("jpeg", *_jpeg_size(data, label))
    if data[:6] in (b"GIF87a", b"GIF89a"):
        if len(data) < 10:
            raise OndeviceError(f"{label}: a truncated GIF; re-export the image")
        w, h = struct.unpack("<HH", data[6:10])
        return "gif", w, h
    if data[:2] == b"BM":
        if len(data) < 26:
            raise OndeviceError(f"{label}: a truncated BMP; re-export the image")
        if struct.unpack("<I", data[14:18])[0] == 12:  # OS/2 header: 16-bit sizes
            w, h = struct.unpack("<HH", data[18:22])
        else:
            w, h = struct.unpack("<ii", data[18:26])
        return "bmp", w, abs(h)  # negative height: rows stored top-down
    kind = _known_other(data)
    hint = f"{kind} is not supported" if kind else "not a PNG, JPEG, GIF or BMP image (or the file is corrupt)"
    raise OndeviceError(f"{label}: {hint}; convert it to PNG or JPEG")


def _known_other(data: bytes) -> str | None:
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WebP"
    if data[4:12] in (b"ftypheic", b"ftypheix", b"ftypmif1", b"ftypavif"):
        return "HEIC/AVIF"
    if data[:4] in (b"II*\x00", b"MM\x00*"):
        return "TIFF"
    if data[:4] == b"RIFF" or data[:3] == b"ID3" or data[:4] == b"fLaC":
        return "audio"
    if data[:4] == b"%PDF":
        return "PDF"
    return None


def _jpeg_size(data: bytes, label: str) -> tuple[int, int]:
    """Walk the JPEG markers to the first SOF (frame header) and read its height and width."""
    i, n = 2, len(data)
    while i + 4 <= n:
        if data[i] != 0xFF:
            break
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker in (0x01, *range(0xD0, 0xD8)):  # standalone markers
            i += 2
            continue
        (seg,) = struct.unpack(">H", data[i + 2 : i + 4])
        if seg < 2:
            break
        if marker in _SOF:
            if i + 9 > n:
                break
            h, w = struct.unpack(">HH", data[i + 5 : i + 9])
            return w, h
        if marker in (0xDA, 0xD9):  # scan data or end before any frame header
            break
        i += 2 + seg
    raise OndeviceError(f"{label}: a truncated or corrupt JPEG (no frame header); re-export the image")


def _check_png_stream(data: bytes, w: int, h: int, label: str) -> None:
    """Inflate the IDAT stream (output discarded) and refuse one that grows past what the declared size
    can need (16-bit RGBA, interlacing's extra filter bytes): a decompression bomb."""
    limit = h * (1 + w * 8) + 7 * h + 1024
    d, total, i = zlib.decompressobj(), 0, 8
    try:
        while i + 8 <= len(data):
            (length,) = struct.unpack(">I", data[i : i + 4])
            kind = data[i + 4 : i + 8]
            chunk = data[i + 8 : i + 8 + length]
            i += 12 + length
            if kind == b"IDAT":
                while chunk:
                    total += len(d.decompress(chunk, 1 << 20))
                    chunk = d.unconsumed_tail
                    if total > limit:
                        raise OndeviceError(f"{label}: the PNG data inflates past what a {w}×{h} image needs "
                                            "(a decompression bomb?); refused")
            elif kind == b"IEND":
                break
    except zlib.error:
        raise OndeviceError(f"{label}: the PNG data is corrupt; re-export the image") from None
