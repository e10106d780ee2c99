"""Images into a llama.cpp text model through libmtmd (llama-cpp-python's ``mtmd_cpp`` bindings).

A ``Projector`` loads the model's vision projector (the ``mmproj`` GGUF) beside a loaded ``LlamaBackend``,
turns a prompt made of text and images into libmtmd chunks (``tokenize``), and puts them into the
backend's KV cache (``eval_prefix``): image chunks are encoded and decoded by libmtmd
(``mtmd_helper_eval_chunk_single``, which also handles non-causal image attention), text chunks go through
the backend's own ``eval``, so the cache position, hidden states and the Ctrl-C rules stay the backend's.
The text after the last image is handed back unevaluated: the caller evaluates it as an ordinary prompt
tail (its logits, then plain or speculative decoding from there — drafters see text only).

Images are untrusted: ``ondevice.images.load_image`` checks format and size before libmtmd's decoder
(stb_image, ``mtmd_helper_bitmap_init_from_buf``) sees the bytes; a decode failure is one OndeviceError.
M-RoPE models (the Qwen2-VL family) are refused: their image positions are not the KV cache's
``pos_max + 1`` that ``LlamaBackend.n_past`` reads.
"""

from __future__ import annotations

import ctypes
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ondevice.backends.base import check_room
from ondevice.backends.llama import LlamaBackend, _ctrl_c_deferred, init_llama
from ondevice.backends.mmproj import find_mmproj, missing_projector
from ondevice.errors import OndeviceError
from ondevice.formats.gguf import check_tensor_data, read_header
from ondevice.images import Image
from ondevice.inputs import check_text

_LOG_CB = None
_DEBUG = False
_ERRORS: list[str] = []  # libmtmd's error lines since last cleared, quoted in our one-line errors
_VIDEO_PROBE = re.compile(r"ffprobe|video", re.I)


def _init_log(debug: bool) -> None:
    """Route libmtmd's log like llama.cpp's: to stderr only when debugging; keep its error lines."""
    global _LOG_CB, _DEBUG
    import llama_cpp
    import llama_cpp.mtmd_cpp as mtmd

    _DEBUG = _DEBUG or debug
    if _LOG_CB is None:

        @llama_cpp.llama_log_callback
        def _log(level, text, user_data):  # pragma: no cover - C callback
            msg = text.decode("utf-8", "replace")
            if level == 4 or (level == 5 and _ERRORS):  # GGML_LOG_LEVEL_ERROR, or its continuation
                _ERRORS.append(msg.strip())
                del _ERRORS[:-8]
            if _DEBUG:
                print(msg, end="", flush=True)

        _LOG_CB = _log
        mtmd.mtmd_helper_log_set(_LOG_CB, ctypes.c_void_p(0))


def _why() -> str:
    # libmtmd's helper tries video (ffprobe) and audio after an image fails to decode; those lines only
    # mislead here, where load_image admits images alone
    text = " ".join(e for e in _ERRORS if e and not _VIDEO_PROBE.search(e))
    _ERRORS.clear()
    return f" (libmtmd: {text[-300:]})" if text else ""


@dataclass(frozen=True)
class PromptChunk:
    """One piece of a tokenized prompt.

    Attributes:
        kind: "text" or "image".
        tokens: the text chunk's token ids (empty for an image).
        n_tokens: embeddings the chunk puts in the KV cache.
        n_pos: positions it advances (``n_tokens`` here: M-RoPE models are refused).
        image_id: the image's SHA-256 (hex), libmtmd's bitmap id; None for text.
    """

    kind: str
    tokens: tuple[int, ...]
    n_tokens: int
    n_pos: int
    image_id: str | None = None


class MultimodalPrompt:
    """A prompt tokenized by libmtmd: ``chunks`` (Python view) over libmtmd's chunk list (``close()`` frees it)."""

    def __init__(self, handle, chunks: list[PromptChunk]) -> None:
        self._handle = handle
        self.chunks = tuple(chunks)
        self.n_pos = sum(c.n_pos for c in chunks)
        last = max((i for i, c in enumerate(chunks) if c.kind == "image"), default=-1)
        self.n_prefix_chunks = last + 1  # chunks eval_prefix evaluates; the rest is the text tail
        self.tail = [t for c in chunks[last + 1 :] for t in c.tokens]

    @property
    def key(self) -> tuple:
        """Position by position: a token id for text, ("image", sha256) for each image position; two prompts
        agree on a cached prefix exactly as far as their keys agree (for prefix reuse)."""
        out: list = []
        for c in self.chunks:
            out.extend(c.tokens if c.kind == "text" else [("image", c.image_id)] * c.n_pos)
        return tuple(out)

    def ids(self, fill: int) -> list[int]:
        """Position by position: text ids, ``fill`` at image positions — a context for drafters, which see
        text only (drafts are verified, so any ``fill`` keeps decoding exact). Never for prefix reuse: two
        images would compare equal; use ``key``."""
        return [t for c in self.chunks for t in (c.tokens if c.kind == "text" else [fill] * c.n_pos)]

    def close(self) -> None:
        if self._handle is not None:
            import llama_cpp.mtmd_cpp as mtmd

            mtmd.mtmd_input_chunks_free(self._handle)
            self._handle = None

    def __enter__(self) -> MultimodalPrompt:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:
            pass


class Projector:
    """A vision projector (mmproj GGUF) loaded beside a ``LlamaBackend``'s model, through libmtmd.

    Args:
        backend: the loaded text model; its context receives the image embeddings.
        path: the mmproj .gguf file.
        debug: libmtmd's log on stderr (also ``ONDEVICE_DEBUG``).
    Raises:
        OndeviceError: not a projector GGUF, no vision encoder, made for another model (output width), an
            M-RoPE model, or a file libmtmd cannot load.
    """

    def __init__(self, backend: LlamaBackend, path: str | Path, *, debug: bool = False) -> None:
        import llama_cpp.mtmd_cpp as mtmd

        self._mtmd = mtmd
        self._ctx = None
        self.backend = backend
        self.path = Path(path)
        if self.path.is_dir():
            raise OndeviceError(f"{self.path}: --mmproj wants the projector .gguf file, not a folder")
        if not self.path.is_file():
            raise OndeviceError(f"{self.path}: no such projector file; check --mmproj")
        meta, _ = read_header(self.path)
        check_tensor_data(self.path)
        if meta.get("general.architecture") != "clip":
            raise OndeviceError(f"{self.path.name}: not a vision projector (architecture "
                                f"{meta.get('general.architecture')!r}, not 'clip'); --mmproj wants the mmproj GGUF")
        if not meta.get("clip.has_vision_encoder"):
            raise OndeviceError(f"{self.path.name}: this projector has no vision encoder (audio only?); it cannot read images")
        backend._check_open()
        init_llama(debug)
        _init_log(debug or bool(os.environ.get("ONDEVICE_DEBUG")))
        p = mtmd.mtmd_context_params_default()
        p.use_gpu = backend.device == "gpu"
        p.n_threads = backend.threads
        p.print_timings = False
        _ERRORS.clear()
        with _ctrl_c_deferred():
            self._ctx = mtmd.mtmd_init_from_file(str(self.path).encode(), backend._model, p)
        if not self._ctx:
            raise OndeviceError(f"{self.path.name}: libmtmd could not load this projector for {backend.path.name} "
                                f"(corrupt, or made for another model){_why()}; pass the model's own mmproj")
        if not mtmd.mtmd_support_vision(self._ctx):
            self.close()
            raise OndeviceError(f"{self.path.name}: this projector has no vision encoder; it cannot read images")
        if mtmd.mtmd_decode_use_mrope(self._ctx):
            self.close()
            raise OndeviceError(f"{backend.path.name}: M-RoPE vision models (the Qwen2-VL family) are not supported "
                                "yet; use a LLaVA, Gemma 3, SmolVLM, Pixtral or similar model")

    def _check_open(self) -> None:
        if not self._ctx:
            raise OndeviceError(f"{self.path.name}: this projector was closed; load it again")
        self.backend._check_open()  # libmtmd reads the text model's vocabulary: never after the model is freed

    # -- input -----------------------------------------------------------------------------------
    def tokenize(self, parts: Sequence[str | Image], *, add_special: bool = True) -> MultimodalPrompt:
        """Tokenize text and images in order (no markers: text is text, even one containing "<__media__>").

        Args:
            parts: strings (special tokens parsed, as the chat template renders them) and checked images
                (``ondevice.images.load_image``); several of each in any order.
            add_special: BOS as the model wants it (as ``LlamaBackend.tokenize(add_bos=True)``).
        Returns:
            The ``MultimodalPrompt`` (close it, or use it as a context manager, when done).
        Raises:
            OndeviceError: an image libmtmd cannot decode, or no parts.
        """
        self._check_open()
        mtmd = self._mtmd
        if not parts:
            raise OndeviceError("an empty prompt: pass text and/or images")
        keep, ptrs, bitmaps = [], [], []
        handle = mtmd.mtmd_input_chunks_init()
        _ERRORS.clear()
        try:
            for i, part in enumerate(parts):
                if isinstance(part, Image):
                    bm = self._bitmap(part)
                    bitmaps.append(bm)
                    p = mtmd.mtmd_input_part(None, bm)
                elif isinstance(part, str):
                    check_text(part, f"prompt part {i}")
                    data = part.encode("utf-8")
                    txt = mtmd.mtmd_input_text(data, len(data), add_special, True)
                    keep.append(txt)
                    p = mtmd.mtmd_input_part(ctypes.pointer(txt), None)
                else:
                    raise OndeviceError(f"prompt part {i} is a {type(part).__name__}; pass str or a checked Image")
                keep.append(p)
                ptrs.append(ctypes.pointer(p))
            arr = (ctypes.POINTER(mtmd.mtmd_input_part) * len(ptrs))(*ptrs)
            with _ctrl_c_deferred():
                rc = mtmd.mtmd_tokenize_from_parts(self._ctx, handle, arr, len(ptrs), add_special)
            if rc != 0:
                raise OndeviceError(f"{self.path.name}: libmtmd could not prepare the images (code {rc}){_why()}; "
                                    "check the images")
            prompt = MultimodalPrompt(handle, self._chunks(handle))
            handle = None
            return prompt
        finally:
            for bm in bitmaps:
                mtmd.mtmd_bitmap_free(bm)
            if handle is not None:
                mtmd.mtmd_input_chunks_free(handle)

    def _bitmap(self, image: Image):
        data = image.data
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        _ERRORS.clear()  # quote only this decode's lines
        with _ctrl_c_deferred():
            bm = self._mtmd.mtmd_helper_bitmap_init_from_buf(self._ctx, buf, len(data), False)
        if not bm:
            raise OndeviceError(f"{image.name}: the {image.format.upper()} image cannot be decoded (corrupt or "
                                f"truncated){_why()}; re-export it as PNG or JPEG")
        if self._mtmd.mtmd_bitmap_is_audio(bm):  # load_image admits images only; never reached
            self._mtmd.mtmd_bitmap_free(bm)
            raise OndeviceError(f"{image.name}: decoded as audio, not an image")
        return bm

    def _chunks(self, handle) -> list[PromptChunk]:
        mtmd, out = self._mtmd, []
        for i in range(mtmd.mtmd_input_chunks_size(handle)):
            c = mtmd.mtmd_input_chunks_get(handle, i)
            kind = mtmd.mtmd_input_chunk_get_type(c)
            n_tok, n_pos = int(mtmd.mtmd_input_chunk_get_n_tokens(c)), int(mtmd.mtmd_input_chunk_get_n_pos(c))
            if kind == mtmd.MTMD_INPUT_CHUNK_TYPE_TEXT:
                n = ctypes.c_size_t(0)
                ptr = mtmd.mtmd_input_chunk_get_tokens_text(c, ctypes.byref(n))
                out.append(PromptChunk("text", tuple(ptr[: n.value]) if n.value else (), n.value, n.value))
            elif kind == mtmd.MTMD_INPUT_CHUNK_TYPE_IMAGE:
                cid = mtmd.mtmd_input_chunk_get_id(c)
                out.append(PromptChunk("image", (), n_tok, n_pos, cid.decode() if cid else None))
            else:
                raise OndeviceError(f"{self.path.name}: libmtmd made a non-image media chunk; send images only")
        return out

    # -- evaluation ------------------------------------------------------------------------------
    def eval_prefix(self, prompt: MultimodalPrompt, n_past: int = 0) -> tuple[int, list[int]]:
        """Put the prompt up to and including its last image into the backend's cache (sequence 0).

        Args:
            prompt: from ``tokenize`` (of this projector).
            n_past: positions the cache keeps (its first ``n_past`` positions already hold this prompt's,
                e.g. a chat's earlier turn: compare ``prompt.key``); the cache is rolled back to there, or to
                the start of an image that ``n_past`` cuts, and everything after is evaluated.
        Returns:
            (the cache's new position count, the tail: the text tokens after the last image that the cache
            does not hold yet — at least one when the prompt ends with text; evaluate them with
            ``backend.eval(tail, "last")`` for the next token's logits).
        Raises:
            OndeviceError: the context is too small, or llama.cpp / libmtmd fails to decode (the cache then
                holds at most the positions before the failing chunk).
        """
        self._check_open()
        b, mtmd = self.backend, self._mtmd
        if prompt._handle is None:
            raise OndeviceError("this prompt was closed; tokenize it again")
        if not 0 <= n_past <= min(b.n_past, prompt.n_pos):
            raise ValueError(f"n_past={n_past} is outside the cache (0..{min(b.n_past, prompt.n_pos)})")
        # The tail is the caller's, so the context must hold it as well as the prefix.
        check_room(0, prompt.n_pos, b.n_ctx, b.path)
        pos, start = 0, []
        for c in prompt.chunks:
            start.append(pos)
            pos += c.n_pos
        tail_start = prompt.n_pos - len(prompt.tail)
        # An image is evaluated whole; a cached tail still gives back its last token (the caller's logits).
        keep = min(n_past, prompt.n_pos - 1) if prompt.tail else n_past
        for c, s in zip(prompt.chunks, start, strict=True):
            if c.kind == "image" and s < keep < s + c.n_pos:
                keep = s
        b.rollback(keep)
        for i in range(prompt.n_prefix_chunks):
            c, s = prompt.chunks[i], start[i]
            if s + c.n_pos <= keep:
                continue
            if c.kind == "text":
                b.eval(list(c.tokens[max(0, keep - s) :]), "last")
                continue
            new = ctypes.c_int32(0)
            _ERRORS.clear()
            with _ctrl_c_deferred():
                rc = mtmd.mtmd_helper_eval_chunk_single(self._ctx, b._ctx, mtmd.mtmd_input_chunks_get(prompt._handle, i),
                                                        s, 0, b.n_batch, False, ctypes.byref(new))
            if rc != 0 or b.n_past != s + c.n_pos:
                why = _why()
                b.rollback(min(s, b.n_past))  # no half image left in the cache
                raise OndeviceError(f"{b.path.name}: encoding or decoding image {c.image_id[:12] if c.image_id else ''} "
                                    f"failed (code {rc}){why}")
        return b.n_past, list(prompt.tail[max(0, keep - tail_start) :])

    def eval(self, prompt: MultimodalPrompt, n_past: int = 0) -> np.ndarray:
        """``eval_prefix`` and then the tail: the logits row of the prompt's last position.

        Raises:
            OndeviceError: the prompt ends with an image (text, e.g. the generation prompt, must follow).
        """
        if not prompt.tail:
            raise OndeviceError("the prompt ends with an image; text must follow it (the chat template's "
                                "generation prompt)")
        _, tail = self.eval_prefix(prompt, n_past)
        return self.backend.eval(tail, "last")[-1]

    def close(self) -> None:
        if self._ctx:
            self._mtmd.mtmd_free(self._ctx)
            self._ctx = None

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:
            pass


def attach(backend: LlamaBackend, mmproj: str | Path | None = None, *, debug: bool = False) -> Projector:
    """The projector for ``backend``'s model: ``mmproj`` if given (``--mmproj``), else the one beside the model.

    Raises:
        OndeviceError: none given and none found (``missing_projector``), or one that does not load.
    """
    path = Path(mmproj).expanduser() if mmproj is not None else find_mmproj(backend.path)
    if path is None:
        raise missing_projector(backend.path)
    return Projector(backend, path, debug=debug)

