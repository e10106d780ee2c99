"""Images in chat messages (#38 item 2): OpenAI ``image_url`` content parts become a libmtmd prompt for a llama.cpp
target with its vision projector (the wiring of docs/vision.md), which ``Runtime.stream`` takes like token ids.

Each image part is rendered by the chat template as a per-request marker (``ondevice.images.new_marker``), the
text is split there and the checked images put back (``interleave``), then the projector tokenizes the parts.
Drafters see the prompt as text ids with ``MediaPrompt.fill`` at image positions (drafts are verified, so any
fill keeps decoding exact); the cache bookkeeping compares ``prompt.key``, which tells images apart.
"""

from __future__ import annotations

from collections.abc import Sequence

from ondevice.errors import OndeviceError
from ondevice.images import Image, interleave, load_image, new_marker


def _parts(message) -> list | None:
    content = message.get("content") if isinstance(message, dict) else None
    return content if isinstance(content, list) else None


def _is_image(part) -> bool:
    return isinstance(part, dict) and part.get("type") == "image_url"


def has_images(messages: Sequence) -> bool:
    """Whether any message has an ``image_url`` content part."""
    return any(_is_image(p) for m in messages for p in (_parts(m) or []))


def with_markers(messages: Sequence, marker: str) -> tuple[list, list[Image]]:
    """The messages with each ``image_url`` part replaced by a text part holding ``marker``, and the images
    (read and checked by ``load_image``: a data URL or a local path), in order.

    Raises:
        OndeviceError: a part without ``image_url.url``, or an image that is unreadable, too big or not supported.
    """
    out, images = [], []
    for i, m in enumerate(messages):
        parts = _parts(m)
        if parts is None:
            out.append(m)
            continue
        new = []
        for p in parts:
            if not _is_image(p):
                new.append(p)
                continue
            src = p.get("image_url")
            url = src.get("url") if isinstance(src, dict) else src
            if not isinstance(url, str) or not url:
                raise OndeviceError(f"messages[{i}]: an image_url part needs image_url.url (a data: URL or a local path)")
            images.append(load_image(url))
            new.append({"type": "text", "text": marker})
        out.append({**m, "content": new})
    return out, images


class MediaPrompt:
    """A chat prompt with images, for ``Runtime.stream`` / ``generate`` (one request: it is closed when that
    request ends).

    Attributes:
        projector: the ``Projector`` that tokenized it.
        prompt: the ``MultimodalPrompt`` (``key`` for prefix reuse, ``tail``: the text after the last image).
        fill: the id drafters see at image positions (the model's BOS, else 0).
    """

    def __init__(self, projector, prompt, fill: int) -> None:
        self.projector, self.prompt, self.fill = projector, prompt, fill

    def __len__(self) -> int:
        return self.prompt.n_pos

    def ids(self) -> list[int]:
        """The drafters' view: text ids, ``fill`` at image positions."""
        return self.prompt.ids(self.fill)

    def close(self) -> None:
        self.prompt.close()


def projector_of(rt):
    """``rt``'s vision projector, attached at the first image (``load(mmproj=)``, else the one found beside the
    model). Raises the one-line ``missing_projector`` error when the model has none."""
    from ondevice.backends.mmproj import missing_projector

    with rt._lock:
        rt._check_open()
        if rt.projector is None:
            if rt.mmproj is None:
                raise missing_projector(rt.target.path)
            from ondevice.backends.llama_mtmd import attach

            rt.projector = attach(rt.target, rt.mmproj)
        return rt.projector


def render_media(rt, messages: Sequence[dict], *, tools: Sequence[dict] | None = None, variables: dict | None = None,
                 add_generation_prompt: bool = True) -> tuple[str, MediaPrompt]:
    """(prompt text with a marker where each image goes, ``MediaPrompt``) of ``messages`` that have images: as
    ``ondevice.chat.render_prompt`` renders text-only messages (template ``variables``, e.g. enable_thinking).

    Raises:
        OndeviceError: as ``render_prompt``; a bad image; a model without a projector.
    """
    projector = projector_of(rt)
    marker = new_marker()
    marked, images = with_markers(messages, marker)
    text, add_bos = rt.render_text(marked, add_generation_prompt, tools, variables)
    parts = interleave(text, marker, images)
    t = rt.target
    with rt._lock:
        rt._check_open()
        prompt = projector.tokenize(parts, add_special=add_bos)
    if not prompt.tail:
        prompt.close()
        raise OndeviceError("the prompt ends with an image; text must follow it (the chat template's generation "
                            "prompt)")
    return text, MediaPrompt(projector, prompt, t.bos_id if t.bos_id is not None else 0)


def chat_prompt(rt, messages: Sequence[dict], add_generation_prompt: bool = True,
                tools: Sequence[dict] | None = None):
    """``Runtime.chat_prompt``: token ids, or a ``MediaPrompt`` when a message has images."""
    if not has_images(messages):
        return rt.render_chat(messages, add_generation_prompt, tools)
    return render_media(rt, messages, tools=tools, add_generation_prompt=add_generation_prompt)[1]
