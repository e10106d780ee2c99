"""Two readings of one HF tokenizer, and exactly where they disagree.

An HF checkpoint's tokenizer files are read by two programs: ``transformers`` (``AutoTokenizer``: what
mlx-lm, and every HF user, runs) and the ``tokenizers`` library alone on ``tokenizer.json`` (what the
GGUF vocabulary is written from, and what llama.cpp reproduces). They can disagree on the same files:
transformers applies ``tokenizer_config.json`` on top of ``tokenizer.json`` (its added tokens, their
``lstrip`` / ``rstrip`` / ``normalized`` flags, special-token handling, a tokenizer class that rebuilds
the pipeline). The reference is transformers' reading when transformers is importable, else the
``tokenizers`` one; ``--tokenizer-check strict`` refuses a source whose readings disagree, ``warn``
converts and reports the strings that differ and which reading the output follows.
"""

from __future__ import annotations

import os
from pathlib import Path

from converters.probe import PROBE
from ondevice.errors import OndeviceError, shown

CHECKS = ("warn", "strict")


def _tokenizers_reading(src: Path, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    from tokenizers import Tokenizer

    enc = Tokenizer.from_file(str(src / "tokenizer.json")).encode(text, add_special_tokens=False)
    return list(enc.ids), [tuple(o) for o in enc.offsets]


def _transformers_reading(src: Path, text: str) -> tuple[list[int], list[tuple[int, int]], str] | str:
    """transformers' ids, offsets and tokenizer class for ``text`` (no specials), or why there is no such
    reading. The class matters: transformers 5 picks it from config.json's ``model_type`` (``qwen2`` →
    ``Qwen2Tokenizer``) even under ``tokenizer_class: PreTrainedTokenizerFast``, and such a class rebuilds
    the pipeline from the vocabulary and merges with its own pre-tokenizer, not tokenizer.json's."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # its import-time advice would be a second stderr line
    try:
        from transformers import AutoTokenizer
    except ImportError:
        return "transformers is not installed"
    import contextlib
    import io

    try:
        with contextlib.redirect_stderr(io.StringIO()):
            tok = AutoTokenizer.from_pretrained(str(src))
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    except Exception as e:  # a tokenizer transformers cannot load: no such reading (reported, not fatal)
        return f"transformers cannot load it ({type(e).__name__}: {str(e)[:120]})"
    return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]], type(tok).__name__


def _pre_tokenizer_note(src: Path, cls: str) -> str | None:
    """Why the readings differ, when transformers' class replaced tokenizer.json's pre-tokenizer."""
    import json

    from transformers import AutoTokenizer

    mine = json.loads((src / "tokenizer.json").read_text(encoding="utf-8")).get("pre_tokenizer")
    try:
        theirs = json.loads(AutoTokenizer.from_pretrained(str(src))._tokenizer.to_str()).get("pre_tokenizer")
    except Exception:  # noqa: BLE001 - a note only
        return None
    if json.dumps(mine, sort_keys=True) != json.dumps(theirs, sort_keys=True):
        a, b = _regexes(mine), _regexes(theirs)
        what = (f"split regex {_short(a)} → {_short(b)}" if a != b
                else f"{(mine or {}).get('type')} → {(theirs or {}).get('type')}")
        return (f"transformers loads {cls}, which builds its own pre-tokenizer instead of tokenizer.json's "
                f"({what}); mlx-lm and HF users get transformers' reading")
    return None


BYTELEVEL_REGEX = "ByteLevel's built-in GPT-2 regex"


def _regexes(node) -> list[str]:
    """Every split regex of a pre-tokenizer's JSON, in order (ByteLevel's built-in one by name)."""
    if isinstance(node, dict):
        if node.get("type") == "ByteLevel" and node.get("use_regex", True):
            return [BYTELEVEL_REGEX]
        return ([node["Regex"]] if isinstance(node.get("Regex"), str) else []) + [
            r for v in node.values() for r in _regexes(v)]
    return [r for v in node for r in _regexes(v)] if isinstance(node, list) else []


def _short(regexes: list[str], n: int = 40) -> str:
    """The regexes, each cut to ``n`` characters, for a one-line note."""
    return ", ".join(r if r == BYTELEVEL_REGEX else repr(r if len(r) <= n else r[:n] + "…")
                     for r in regexes) or "none"


def differences(text: str, a: tuple[list, list], b: tuple[list, list], limit: int = 8) -> list[dict]:
    """The substrings of ``text`` the two readings split differently: the text between consecutive places
    where both readings end a token, where their ids differ, with each reading's ids."""
    def ends(offsets):
        return {e for _, e in offsets}

    sync = sorted(ends(a[1]) & ends(b[1]) | {0})

    def segment(reading, lo, hi):
        return [i for i, (s, e) in zip(*reading, strict=True) if e > lo and e <= hi]

    out = []
    for lo, hi in zip(sync, sync[1:] + [len(text)], strict=True):
        sa, sb = segment(a, lo, hi), segment(b, lo, hi)
        if sa != sb:
            out.append({"text": text[lo:hi], "chars": [lo, hi], "transformers": sa, "tokenizers": sb})
            if len(out) >= limit:
                break
    return out


def hf_readings(src: Path, add_bos: bool, bos_id: int | None, text: str = PROBE) -> dict:
    """Both readings of ``src``'s tokenizer on ``text``.

    Returns:
        {"ids": {reading: ids}, "reference": the reading taken as the source's, "agree": bool,
         "differences": [{"text", "chars", "transformers", "tokenizers"}], "add_bos", "bos_id",
         "unavailable": why a reading is missing (absent when both exist)}.
    """
    if not (src / "tokenizer.json").is_file():  # SentencePiece tokenizer.model alone: sentencepiece reads it
        from converters.spm import encode

        return {"ids": {"sentencepiece": encode(src / "tokenizer.model", text)}, "reference": "sentencepiece",
                "agree": True, "differences": [], "add_bos": add_bos, "bos_id": bos_id}
    tk = _tokenizers_reading(src, text)
    tf = _transformers_reading(src, text)
    rec = {"add_bos": add_bos, "bos_id": bos_id}
    if isinstance(tf, str):
        return {**rec, "ids": {"tokenizers": tk[0]}, "reference": "tokenizers", "agree": True, "differences": [],
                "unavailable": {"transformers": tf}}
    agree = tf[0] == tk[0]
    rec.update(ids={"transformers": tf[0], "tokenizers": tk[0]}, reference="transformers", agree=agree,
               differences=[] if agree else differences(text, tf[:2], tk), transformers_class=tf[2])
    if not agree:
        rec["why"] = _pre_tokenizer_note(src, tf[2])
    return rec


def describe(readings: dict, visible_spaces: bool = False) -> str:
    """One line: the strings the readings split differently (for errors and the summary). ``visible_spaces``
    writes each space as ␣, so that a one-line error (whose whitespace runs collapse) still tells them apart."""
    diffs = readings.get("differences") or []

    def text(t: str) -> str:
        return repr(t).replace(" ", "␣") if visible_spaces else repr(t)

    shown = "; ".join(f"{text(d['text'])}: transformers {d['transformers']} vs tokenizers {d['tokenizers']}"
                      for d in diffs[:3])
    more = f" (+{len(diffs) - 3} more)" if len(diffs) > 3 else ""
    why = f" [{readings['why']}]" if readings.get("why") else ""
    return f"{len(diffs)} string(s) of the probe: {shown}{more}{why}"


def check_readings(src: Path, readings: dict, mode: str) -> dict | None:
    """Apply ``--tokenizer-check``: strict refuses disagreeing readings (one line, before anything is
    written); warn returns the disagreement for the summary (None when the readings agree)."""
    if mode not in CHECKS:
        raise OndeviceError(f"--tokenizer-check {mode}: choose one of {', '.join(CHECKS)}")
    if readings["agree"]:
        return None
    if mode == "strict":
        raise OndeviceError(
            f"{shown(src / 'tokenizer.json')}: transformers and the tokenizers library read this tokenizer differently on "
            f"{describe(readings, visible_spaces=True)}; nothing was written (--tokenizer-check warn converts and reports it)")
    return {"readings_agree": False, "reference": readings["reference"], "differences": readings["differences"],
            "transformers_class": readings.get("transformers_class"), "why": readings.get("why"),
            "summary": describe(readings),
            "choice": "warn: converted; the output follows the reading named in verify.tokenizer.follows "
                      "(MLX: transformers, as mlx-lm loads it; GGUF: tokenizers, as llama.cpp reproduces "
                      "tokenizer.json); --tokenizer-check strict refuses instead"}
