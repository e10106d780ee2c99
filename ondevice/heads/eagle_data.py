"""Training data of the EAGLE-style drafter: for each recorded answer (prompt + the target's greedy answer), one
teacher-forced prefill of the target that keeps, per position, the inputs of the drafter's 3 target layers (the
same ``Backend.features`` "layer_inputs" rows the drafter reads while drafting) and the target's top-k next-token
probabilities. One file per answer (temp file, then rename): an interrupted run resumes at the next answer.
``collect_text`` does the same for pieces of text already on the machine (``train-heads --text``).

``windows`` cuts the sequences into fixed-length training windows; ``batch_arrays`` builds what
``ondevice.heads.eagle.loss_fn`` reads; ``chain_tau`` replays greedy chains from the unrolled hits.
"""

from __future__ import annotations

import zipfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ondevice import atomic

TOP = 8  # teacher probabilities kept per row
# what reading a damaged .npz raises (RuntimeError / NotImplementedError: a zip member's flags or method damaged)
DAMAGED = (OSError, ValueError, KeyError, EOFError, RuntimeError, zipfile.BadZipFile)
PER_TEXT = 2  # pieces taken from one text (``collect_text``)


@dataclass
class Seq:
    """One answer's features: ``tokens`` [n] (prompt then answer), ``feats`` [n, 3·h] float16 (layer inputs after
    each token), ``t_ids`` / ``t_pr`` [n, TOP] the target's top-k after each token, ``n_prompt``."""

    tokens: np.ndarray
    feats: np.ndarray
    t_ids: np.ndarray
    t_pr: np.ndarray
    n_prompt: int


def features_of(backend, tokens: list[int], top: int = TOP) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One prefill of ``tokens`` from an empty cache: (layer-input rows [n, w] float16, top-k ids [n, top] int32,
    probabilities [n, top] float16). ``backend``: a ``LlamaBackend`` after ``enable_layer_inputs``."""
    backend.rollback(0)
    logits = backend.eval(tokens, logits="all")
    n = len(tokens)
    feats = np.stack([backend.feature("layer_inputs", i) for i in range(n)]).astype(np.float16)
    backend.release_features(n)
    ids = np.argpartition(-logits, top, axis=-1)[:, :top]
    sel = np.take_along_axis(logits, ids, axis=-1)
    order = np.argsort(-sel, axis=-1, kind="stable")
    ids, sel = np.take_along_axis(ids, order, -1), np.take_along_axis(sel, order, -1)
    m = logits.max(-1, keepdims=True)
    pr = np.exp(sel - m) / np.exp(logits - m).sum(-1, keepdims=True)
    backend.rollback(0)
    return feats, ids.astype(np.int32), pr.astype(np.float16)


def collect(backend, records, work: Path, *, on_seq: Callable[[int], None] | None = None) -> list[Seq]:
    """The features of every record (``ondevice.heads.data.Record``: prompt + answer), cached in ``work``."""
    work.mkdir(parents=True, exist_ok=True)
    out = []
    for i, rec in enumerate(records):
        tokens = np.concatenate([rec.prompt, rec.tokens[1:]]).astype(np.int64)
        out.append(_cached(backend, work / f"seq-{i:05d}.npz", tokens, len(rec.prompt)))
        if on_seq is not None:
            on_seq(len(out[-1].tokens))
    return out


def collect_text(backend, texts: Iterable[str], work: Path, *, budget: int, chunk: int,
                 on_seq: Callable[[int], None] | None = None) -> list[Seq]:
    """Teacher-forced features of ``texts`` (``ondevice.heads.texts.read_texts``) cut into pieces of ``chunk``
    tokens, until ``budget`` tokens; cached in ``work`` (a piece whose tokens changed is computed again).

    At most ``PER_TEXT`` pieces come from one text, so a budget spans many files. Pieces have no prompt: every
    position trains (the target's own distribution after each token is the label)."""
    work.mkdir(parents=True, exist_ok=True)
    out: list[Seq] = []
    total = 0
    for text in texts:
        ids = backend.tokenize(text, add_bos=False)
        for s in range(0, min(len(ids), PER_TEXT * chunk), chunk):
            piece = np.asarray(ids[s:s + min(chunk, budget - total)], np.int64)
            if len(piece) < 16:  # a tail too short to unroll the depths over
                break
            out.append(_cached(backend, work / f"txt-{len(out):05d}.npz", piece, 0))
            total += len(out[-1].tokens)
            if on_seq is not None:
                on_seq(len(out[-1].tokens))
            if total >= budget - 16:
                return out
    return out


def _cached(backend, path: Path, tokens: np.ndarray, n_prompt: int) -> Seq:
    """The features of ``tokens`` from ``path``, or one prefill written there (temp file, then rename)."""
    toks = tokens[: backend.n_ctx]  # what one prefill holds (``load`` returns the tokens its rows cover)
    seq = load(path) if path.is_file() else None
    if seq is None or not np.array_equal(seq.tokens, toks):
        feats, ids, pr = features_of(backend, [int(t) for t in toks])
        seq = Seq(toks, feats, ids, pr, n_prompt)
        with atomic.replacing(path) as tmp, open(tmp, "wb") as f:
            np.savez(f, tokens=tokens, feats=feats, t_ids=ids, t_pr=pr, n_prompt=np.int64(n_prompt))
    return seq


def load(path: Path) -> Seq | None:
    """One answer's features written by ``collect`` (None when the file is damaged: it is computed again)."""
    try:
        with np.load(path) as z:
            n = len(z["feats"])
            return Seq(z["tokens"][:n].astype(np.int64), z["feats"], z["t_ids"], z["t_pr"], int(z["n_prompt"]))
    except DAMAGED:
        return None  # damaged: recorded again


def windows(seqs: list[Seq], T: int, overlap: int = 32) -> list[tuple[int, int]]:
    """(sequence, start) of every training window of ≤ T rows (a long sequence in overlapping pieces)."""
    out = []
    for i, s in enumerate(seqs):
        n, start = len(s.tokens), 0
        while True:
            out.append((i, start))
            if start + T >= n:
                break
            start += T - overlap
    return out


def bucket(n: int, step: int = 128) -> int:
    """A window's padded length: ``n`` rounded up to a multiple of ``step`` (few distinct shapes to compile)."""
    return max(step, -(-n // step) * step)


def batches(seqs: list[Seq], wins: list[tuple[int, int]], T: int, batch_tokens: int,
            rng: np.random.Generator) -> list[tuple[int, int, list[tuple[int, int]]]]:
    """(padded length, rows, windows) of every batch of one epoch: windows grouped by padded length (up to ``T``),
    about ``batch_tokens`` rows each, in random order. Every epoch has the same number of batches."""
    by: dict[int, list] = {}
    for w in wins:
        by.setdefault(bucket(min(T, len(seqs[w[0]].tokens) - w[1])), []).append(w)
    out = []
    for L in sorted(by):
        ws = [by[L][i] for i in rng.permutation(len(by[L]))]
        B = max(1, batch_tokens // L)
        out += [(L, B, ws[i:i + B]) for i in range(0, len(ws), B)]
    return [out[i] for i in rng.permutation(len(out))]


def hidden_rows(rec) -> tuple[int, np.ndarray]:
    """(first position, rows) of a record's post-norm hidden states in its ``Seq``'s positions (prompt + answer):
    ``rec.hidden[j]`` follows ``rec.tokens[j]``, and ``tokens[0]`` is the prompt's last token."""
    return len(rec.prompt) - 1, rec.hidden


def batch_arrays(seqs: list[Seq], wins: list[tuple[int, int]], T: int, inv: np.ndarray, table: np.ndarray,
                 rng: np.random.Generator | None = None, noise: float = 0.0, rows: int | None = None,
                 hidden: list[tuple[int, np.ndarray]] | None = None) -> dict[str, np.ndarray]:
    """The arrays of ``eagle.loss_fn`` for these windows, padded to T positions and ``rows`` windows (empty ones
    count nowhere).

    Args:
        inv: target id → draft-vocabulary index (−1 outside).
        table: the target's token embeddings [V, h] (float32).
        noise: Gaussian noise on the features, relative to each row's RMS (training only).
        hidden: per sequence, ``hidden_rows`` of its record: adds hid / hid_ok (the feature loss's targets at row
            p + 1, known on the answer's rows).
    """
    B, w = max(len(wins), rows or 0), seqs[0].feats.shape[1]
    feats = np.zeros((B, T, w), np.float32)
    emb = np.zeros((B, T, table.shape[1]), np.float32)
    t_idx = np.full((B, T, TOP), -1, np.int32)
    t_pr = np.zeros((B, T, TOP), np.float32)
    for b, (i, s0) in enumerate(wins):
        s = seqs[i]
        n = min(T, len(s.tokens) - s0)
        feats[b, :n] = s.feats[s0:s0 + n]
        m = n - 1  # rows p with a next token (and a teacher row p + 1)
        emb[b, :m] = table[s.tokens[s0 + 1:s0 + n]]
        t_idx[b, :m] = inv[s.t_ids[s0 + 1:s0 + n]]
        t_pr[b, :m] = s.t_pr[s0 + 1:s0 + n]
    if noise and rng is not None:
        rms = np.sqrt(np.mean(feats * feats, axis=-1, keepdims=True))
        feats += noise * rms * rng.standard_normal(feats.shape, dtype=np.float32)
    out = {"feats": feats, "emb": emb, "t_idx": t_idx, "t_pr": t_pr, "valid": t_pr[..., 0] > 0}
    if hidden is not None:
        hid = np.zeros((B, T, table.shape[1]), np.float32)
        ok = np.zeros((B, T), bool)
        for b, (i, s0) in enumerate(wins):
            first, H = hidden[i]
            n = min(T, len(seqs[i].tokens) - s0)
            # row p's target: the hidden state after position s0 + p + 1, i.e. H[s0 + p + 1 − first] where it exists
            lo, hi = max(0, first - s0 - 1), min(n - 1, len(H) + first - s0 - 1)
            if hi > lo:
                hid[b, lo:hi] = H[s0 + 1 + lo - first:s0 + 1 + hi - first]
                ok[b, lo:hi] = True
        out.update(hid=hid, hid_ok=ok)
    return out


def chain_tau(hits: np.ndarray, n_prompt: int, n: int, gamma: int) -> tuple[int, int]:
    """Replay greedy chains of ``gamma`` over one answer: (tokens emitted, target passes).

    ``hits[j, p]``: depth j of base p − j drafts the target's token (``eagle.make_eval``). From base b (the target
    has processed up to b; its token b + 1 is pending) a pass emits the accepted drafts and one token of its own;
    the first answer token comes from the prompt's pass."""
    b, emitted, passes = n_prompt - 1, 0, 0
    while b + 1 < n - 1:  # the pending token b + 1 is not the answer's last
        a = 0
        while a < min(gamma, len(hits)) and b + a + 1 < n - 1 and hits[a, b + a]:
            a += 1
        emitted += min(a + 1, n - 2 - b)  # all the rest accepted: no token of the answer left for the bonus
        passes += 1
        b += a + 1
    return emitted, passes
