"""Target/draft pair checks: a draft is usable only if every token id means the same text."""

from __future__ import annotations

from pathlib import Path

from ondevice.errors import OndeviceError, shown

MAX_PADDING_ROWS = 128


def _is_padding(token: str) -> bool:
    return token.startswith("[PAD") or token == ""


def check_vocabs(target: list[str], draft: list[str], target_name: str | Path, draft_name: str | Path) -> int:
    """Compare two vocabularies by text, id by id.

    Extra rows at the end of the longer one are allowed when they are at most ``MAX_PADDING_ROWS``
    padding tokens (or when the longer side has <= that many extra ids; the sampler masks them).
    Differing text at a shared id is never allowed.

    Returns:
        The shared vocabulary size (the sampler masks ids at or above it).
    Raises:
        OndeviceError: naming the first differing id and both texts.
    """
    n = min(len(target), len(draft))
    for i in range(n):
        if target[i] != draft[i]:
            raise OndeviceError(
                f"vocab mismatch between {shown(target_name)} and {shown(draft_name)}: id {i} is {target[i]!r} in the target "
                f"but {draft[i]!r} in the draft; use a draft trained with the target's tokenizer"
            )
    longer = target if len(target) > n else draft
    extra = longer[n:]
    if len(extra) > MAX_PADDING_ROWS and not all(_is_padding(t) for t in extra):
        raise OndeviceError(
            f"vocab mismatch between {shown(target_name)} ({len(target)} tokens) and {shown(draft_name)} ({len(draft)} tokens): "
            f"{len(extra)} extra ids beyond padding; use a draft trained with the target's tokenizer"
        )
    return n


def gguf_tokens(path: Path) -> list[str]:
    """The token texts of a GGUF file, in id order (the capped header walk: a corrupt file is one line naming it)."""
    from ondevice.formats.gguf import check_gguf_file, read_header

    check_gguf_file(Path(path))
    tokens = read_header(path)[1]
    if tokens is None:
        raise OndeviceError(f"{shown(path)}: GGUF has no tokenizer.ggml.tokens; it cannot be paired")
    return tokens


def model_tokens(path: Path) -> list[str]:
    """Token texts of a GGUF file, a directory holding model.gguf, or an HF/MLX directory.

    Raises:
        OndeviceError: a missing or malformed tokenizer.json, or token ids beyond its vocabulary (more than
            ``MAX_PADDING_ROWS`` ids without a token: each would become a padding row, and a crafted id such
            as 2**40 would make a list that large).
    """
    path = Path(path)
    if path.is_dir() and (path / "model.gguf").is_file():
        path = path / "model.gguf"
    if path.suffix == ".gguf":
        return gguf_tokens(path)
    tj = path / "tokenizer.json"
    if not tj.is_file():
        raise OndeviceError(f"{shown(tj)}: missing; cannot read this model's vocabulary")
    import json

    try:
        data = json.loads(tj.read_text(encoding="utf-8"))
        vocab = data["model"]["vocab"]
        pairs = list(vocab.items()) if isinstance(vocab, dict) else [(v[0], i) for i, v in enumerate(vocab)]
        pairs += [(a["content"], a["id"]) for a in data.get("added_tokens") or []]
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
        raise OndeviceError(f"{shown(tj)}: not a tokenizer.json this can read ({type(e).__name__}: {e}); "
                            "use the model's own tokenizer.json") from None
    by_id: dict[int, str] = {}
    for text, i in pairs:
        if type(i) is not int or i < 0 or not isinstance(text, str):
            raise OndeviceError(f"{shown(tj)}: token {str(text)[:40]!r} has id {str(i)[:40]}, not a non-negative integer; "
                                "use the model's own tokenizer.json")
        by_id[i] = text
    top = max(by_id, default=-1) + 1
    if top > len(by_id) + MAX_PADDING_ROWS:
        raise OndeviceError(f"{shown(tj)}: token id {top - 1} in a vocabulary of {len(by_id)} tokens ({top - len(by_id)} "
                            f"ids without a token, at most {MAX_PADDING_ROWS}); use the model's own tokenizer.json")
    return [by_id.get(i, f"[PAD{i}]") for i in range(top)]
