"""What a quantization costs: teacher-forced agreement of two GGUF files of one model on held-back text
(top-1 agreement and KL(reference ‖ candidate) of the next-token distributions), and its one-line report."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ondevice.errors import OndeviceError, shown

# The held-back text for quality checks: not in the benchmark prompts; prose, code and a list.
HELD_OUT_TEXT = """\
The lighthouse keeper kept a ledger of every ship that passed, the hour, the wind and the state of the sea.
In winter the entries grew short: fog, no ships, fog again. In spring they grew long and careful, because the
fishing fleet came back and every boat had to be counted home before the lamp could be trimmed for the night.

def merge_intervals(intervals):
    \"\"\"Merge overlapping [start, end] intervals; returns a new sorted list.\"\"\"
    out = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return out

Steps to re-pot a plant: water it the day before; loosen the root ball with your fingers; choose a pot one size
larger with a drainage hole; add fresh soil to the bottom, set the plant at the same depth as before, fill the
sides, press gently and water until it drains. Keep it out of direct sun for a week while the roots settle.
"""


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x -= x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def _logits_on(path: Path, ids: list[int] | None, text: str, n_tokens: int, threads: int | None):
    from ondevice.backends import open_backend

    b = open_backend(path, n_ctx=n_tokens + 16, threads=threads)
    try:
        if ids is None:
            ids = b.tokenize(text)[:n_tokens]
        return ids, b.eval(ids), b.vocab_size
    finally:
        b.close()


def quality(candidate: Path, reference: Path, *, text: str = HELD_OUT_TEXT, n_tokens: int = 256,
            threads: int | None = None) -> dict:
    """Teacher-forced agreement of ``candidate`` with ``reference`` on ``text``.

    Args:
        candidate, reference: GGUF files of one model (same tokenizer).
        text: the held-back text both read (tokenized by the reference).
        n_tokens: at most this many tokens of it.
    Returns:
        {"top1_agreement", "mean_kl", "max_kl", "tokens", "reference"}: KL(reference ‖ candidate) in nats
        per position, averaged over every position of the text.
    """
    ids, ref, v_ref = _logits_on(Path(reference), None, text, n_tokens, threads)
    if len(ids) < 2:
        raise OndeviceError("quality text is too short: it needs at least 2 tokens")
    _, cand, v_cand = _logits_on(Path(candidate), ids, text, n_tokens, threads)
    if v_ref != v_cand:
        raise OndeviceError(f"{shown(candidate)} and {shown(reference)} have different vocabularies ({v_cand} vs {v_ref} tokens)")
    agree, kls = 0, []
    for s in range(0, len(ids), 32):  # rows [32, V] at a time: float64 over a 150k vocabulary is large
        lp, lq = _log_softmax(ref[s : s + 32]), _log_softmax(cand[s : s + 32])
        kls.extend((np.exp(lp) * (lp - lq)).sum(axis=-1).tolist())
        agree += int((lp.argmax(-1) == lq.argmax(-1)).sum())
    return {"top1_agreement": round(agree / len(ids), 4), "mean_kl": round(float(np.mean(kls)), 5),
            "max_kl": round(float(np.max(kls)), 4), "tokens": len(ids), "reference": str(reference)}


def report(summary: dict) -> None:
    """Print the warning (if any) and the quality cost of a requantization on stderr."""
    from rich.console import Console
    from rich.markup import escape

    # soft_wrap: one line per message whatever the width (a pipe is 80 columns); escape: a "[" in a path is text
    con = Console(stderr=True, highlight=False, soft_wrap=True)
    if summary.get("warning"):
        con.print(f"[yellow]warning:[/yellow] {escape(summary['warning'])}")
    q = summary.get("quality")
    if q:
        con.print(escape(f"quality vs {Path(q['reference']).name} on {q['tokens']} held-back tokens: top-1 agreement "
                         f"{q['top1_agreement']:.1%}, mean KL {q['mean_kl']:.4f} nats (max {q['max_kl']:.2f}); "
                         f"{summary['source_bits_per_weight']:.2f} → {summary['bits_per_weight']:.2f} bits per weight"))
