"""Fitting heads on recorded answers (numpy + BLAS, hand-written backprop, Adam), and offline τ.

Head k is fitted after heads 1..k−1, on the features they produce (ĥ_{t+k−1}), with the true tokens
fed in (teacher forcing: in a greedy chain head k only matters when every earlier draft was right, so
its input token is then exactly the true one). The loss is the cross-entropy against the target's
own distribution at t+k over the draft vocabulary (its top ``TEACHER_TOP`` rows, renormalised), so a
head learns the whole law, not just the argmax. Each head keeps the weights of its best epoch on
held-out answers (early stopping).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ondevice.heads.data import Record
from ondevice.heads.model import Adam, Heads, soft_ce

TEACHER_TOP = 32


@dataclass
class Flat:
    """Records concatenated: row a is one position of one answer."""

    H: np.ndarray  # [N, d] hidden state after tok[a]
    tok: np.ndarray  # [N] the token evaluated at row a
    nxt: np.ndarray  # [N] the target's greedy token after row a
    left: np.ndarray  # [N] rows after a in the same answer
    rec: np.ndarray  # [N] record index

    @classmethod
    def of(cls, records: list[Record]) -> Flat:
        H = np.concatenate([r.hidden for r in records]).astype(np.float32)
        tok = np.concatenate([r.tokens[: len(r.hidden)] for r in records])
        nxt = np.concatenate([r.tokens[1 : len(r.hidden) + 1] for r in records])
        left = np.concatenate([np.arange(len(r.hidden))[::-1] for r in records])
        rec = np.concatenate([np.full(len(r.hidden), i) for i, r in enumerate(records)])
        return cls(H, tok.astype(np.int64), nxt.astype(np.int64), left, rec)


def teacher(heads: Heads, H: np.ndarray, top: int = TEACHER_TOP, batch: int = 1024) -> tuple[np.ndarray, np.ndarray]:
    """The target's distribution over the draft vocabulary at each row: top ``top`` rows and their
    renormalised probabilities (rows [N, top] sorted by probability, descending)."""
    ids = np.zeros((len(H), top), np.int64)
    pr = np.zeros((len(H), top), np.float32)
    for s in range(0, len(H), batch):
        lg = heads.logits(H[s : s + batch])
        part = np.argpartition(-lg, top - 1, axis=1)[:, :top]
        v = np.take_along_axis(lg, part, 1)
        order = np.argsort(-v, axis=1)
        part, v = np.take_along_axis(part, order, 1), np.take_along_axis(v, order, 1)
        e = np.exp(v - v[:, :1])
        ids[s : s + batch], pr[s : s + batch] = part, e / e.sum(1, keepdims=True)
    return ids, pr


@dataclass
class FitConfig:
    epochs: int = 8
    batch: int = 64
    lr: float = 2e-3
    wd: float = 0.01
    seed: int = 0
    teacher_top: int = 8  # teacher rows per example in the loss
    negatives: int = 512  # shared random draft rows per training batch (sampled softmax)


def _params(heads: Heads, k: int) -> dict[str, np.ndarray]:
    return {"w1": heads.w1[k], "b1": heads.b1[k], "w2": heads.w2[k]}


def fit_head(
    heads: Heads, k: int, src: np.ndarray, flat: Flat, t_ids, t_pr, inv: np.ndarray,
    train_rows: np.ndarray, val_rows: np.ndarray, cfg: FitConfig,
    state: dict | None = None, on_epoch: Callable[[dict], None] | None = None,
) -> dict:
    """Train head k (0-based) in place.

    Args:
        src: [N, d] ĥ_{t+k} inputs per anchor row (the true H for k = 0).
        t_ids, t_pr: the teacher at every row; the target of anchor a is row a + k + 1.
        inv: target id → input row (``Heads.index``; −1 outside the input vocabulary).
        train_rows, val_rows: anchors (each has at least k + 1 rows after it).
        state: a checkpoint of this head's fit to resume (from ``on_epoch``).
        on_epoch: called with the state after every epoch (checkpoint, progress).
    Returns:
        The final state: {"epoch", "best", "best_w", "log"}.
    """
    p = _params(heads, k)
    opt = Adam(cfg.lr, cfg.wd)
    st = {"epoch": 0, "best": np.inf, "best_w": {n: v.copy() for n, v in p.items()}, "log": []}
    if state is not None:
        st = state
        for n in p:
            p[n][...] = st["w"][n]
        opt.m, opt.v, opt.t = st["m"], st["v"], st["t"]
    steps_total = cfg.epochs * max(1, len(train_rows) // cfg.batch)

    def run(rows: np.ndarray, train: bool) -> tuple[float, float]:
        tot_l = tot_h = 0.0
        for s in range(0, len(rows), cfg.batch):
            a = rows[s : s + cfg.batch]
            e = heads.embed(inv[flat.tok[a + k + 1]])
            hk, cache = heads.step(k, src[a], e)
            ids, pr = t_ids[a + k + 1, : cfg.teacher_top], t_pr[a + k + 1, : cfg.teacher_top]
            pr = pr / pr.sum(1, keepdims=True)
            if train:  # sampled softmax: the batch's teacher rows and shared random rows, not all Vd
                cols = np.unique(np.concatenate([ids.ravel(), rng.integers(0, len(heads.vocab), cfg.negatives)]))
                out = heads.out[cols]
                loss, g, hit = soft_ce(hk @ out.T, np.searchsorted(cols, ids), pr, np.ones(len(a), bool))
                grads = heads.backward(k, cache, g @ out)
                frac = min(1.0, opt.t / max(steps_total, 1))
                opt.update(p, grads, lr=cfg.lr * 0.5 * (1 + np.cos(np.pi * frac)))
            else:  # held-out: the full draft vocabulary
                loss, _, hit = soft_ce(heads.logits(hk), ids, pr, np.ones(len(a), bool))
            tot_l += loss * len(a)
            tot_h += hit * len(a)
        return tot_l / max(len(rows), 1), tot_h / max(len(rows), 1)

    while st["epoch"] < cfg.epochs:
        rng = np.random.default_rng([cfg.seed * 1000 + k, st["epoch"]])  # per epoch: a resumed fit draws the same
        order = rng.permutation(train_rows)
        tl, th = run(order, True)
        vl, vh = run(val_rows, False)
        st["epoch"] += 1
        st["log"].append({"head": k + 1, "epoch": st["epoch"], "train_loss": round(tl, 4), "train_top1": round(th, 4),
                          "val_loss": round(vl, 4), "val_top1": round(vh, 4)})
        if vl < st["best"]:
            st["best"] = vl
            st["best_w"] = {n: v.copy() for n, v in p.items()}
        st.update(w={n: v.copy() for n, v in p.items()}, m=opt.m, v=opt.v, t=opt.t)
        if on_epoch is not None:
            on_epoch(st)
    for n in p:
        p[n][...] = st["best_w"][n]
    return st


def advance(heads: Heads, k: int, src: np.ndarray, flat: Flat, inv: np.ndarray, rows: np.ndarray, batch: int = 2048) -> np.ndarray:
    """ĥ after head k for the given anchor rows (the next head's inputs); other rows are left zero."""
    out = np.zeros_like(src)
    for s in range(0, len(rows), batch):
        a = rows[s : s + batch]
        out[a] = heads.step(k, src[a], heads.embed(inv[flat.tok[a + k + 1]]))[0]
    return out


def chain_hits(heads: Heads, flat: Flat, inv: np.ndarray, K: int | None = None, batch: int = 2048) -> np.ndarray:
    """[N] for every row a (cache up to tok[a], pending nxt[a]): how many consecutive drafts of a greedy
    chain from (H[a], nxt[a]) equal the target's next tokens (at most K, and only tokens of the answer)."""
    K = heads.K if K is None else min(K, heads.K)
    N = len(flat.H)
    hits = np.zeros(N, np.int64)
    for s in range(0, N, batch):
        a = np.arange(s, min(s + batch, N))
        h = flat.H[a]
        alive = np.ones(len(a), bool)
        x = inv[flat.nxt[a]]
        for k in range(K):
            h = heads.step(k, h, heads.embed(x))[0]
            row = heads.draft_logits(h).argmax(1)
            want = flat.nxt[np.minimum(a + k + 1, N - 1)]  # draft k guesses the token after row a + k + 1
            alive &= (flat.left[a] >= k + 1) & (heads.vocab[row] == want)
            hits[a] += alive
            x = row
    return hits


def tree_hits(heads: Heads, flat: Flat, inv: np.ndarray, max_nodes: int, branch: int = 4, batch: int = 512) -> np.ndarray:
    """``chain_hits`` for the heads' trees (``grow.grow_trees``) of up to ``max_nodes`` drafted nodes: per row,
    the depth of the longest tree path equal to the target's next tokens (greedy: a tree pass accepts
    exactly that path)."""
    from ondevice.heads.grow import grow_trees

    N = len(flat.H)
    hits = np.zeros(N, np.int64)
    for s in range(0, N, batch):
        a = np.arange(s, min(s + batch, N))
        tok, par, _ = grow_trees(heads, flat.H[a], inv[flat.nxt[a]], max_nodes, branch)
        tok = heads.vocab[tok]
        node = np.zeros(len(a), np.int64)  # the deepest accepted node so far (0 = the root)
        alive = np.ones(len(a), bool)
        for depth in range(heads.K):
            want = flat.nxt[np.minimum(a + depth + 1, N - 1)]
            match = (par == node[:, None]) & (tok == want[:, None])  # a child of the node carrying the next token
            ok = alive & (flat.left[a] >= depth + 1) & match.any(axis=1)
            node = np.where(ok, match.argmax(axis=1) + 1, node)
            alive &= ok
            hits[a] += ok
    return hits


def offline_tau(hits: np.ndarray, flat: Flat, recs: np.ndarray | None = None) -> dict:
    """τ (tokens per target pass) of a greedy chain walked over each answer, exact for greedy decoding:
    a verify pass accepts exactly the drafts equal to the target's tokens, then adds the target's own.

    The first pass (the prompt's) emits the first answer token; from then on, with e tokens emitted
    the cache ends at row e − 1 and a pass emits min(hits, tokens left − 1) + 1 tokens.
    """
    passes = tokens = 0
    for r in np.unique(flat.rec) if recs is None else recs:
        idx = np.flatnonzero(flat.rec == r)
        m = len(idx)
        e, passes = 1, passes + 1
        while e < m:
            n = min(int(hits[idx[e - 1]]), m - e - 1)
            passes += 1
            e += n + 1
        tokens += m
    return {"tau": tokens / passes if passes else 0.0, "tokens": int(tokens), "passes": int(passes)}


def offline_tau_copy(hits: np.ndarray, flat: Flat, records: list[Record], gamma: int, copy_min: int) -> dict:
    """``offline_tau`` of the heads drafter as it runs (``ondevice.drafters.copies.copy_guess`` first): at every pass a
    prompt-lookup copy agreeing for at least ``copy_min`` tokens drafts the chain, else the heads'
    chain (``hits``). ``records`` are the ones ``flat`` was made of, in order; exact for greedy decoding."""
    from ondevice.drafters.copies import copy_guess
    from ondevice.drafters.ngram import NgramDrafter

    passes = tokens = 0
    for r, rec in enumerate(records):
        idx = np.flatnonzero(flat.rec == r)
        ans = [int(t) for t in rec.tokens[1 : len(idx) + 1]]
        m = len(ans)
        ngram, ctx = NgramDrafter(), [int(t) for t in rec.prompt] + ans[:1]
        e, passes = 1, passes + 1
        while e < m:
            guess = copy_guess(ngram, ctx, gamma, copy_min) if copy_min else []
            if guess:
                n = 0
                while n < len(guess) and e + n < m - 1 and guess[n] == ans[e + n]:
                    n += 1
            else:
                n = min(int(hits[idx[e - 1]]), gamma, m - e - 1)
            ctx.extend(ans[e : e + n + 1])
            e += n + 1
            passes += 1
        tokens += m
    return {"tau": tokens / passes if passes else 0.0, "tokens": int(tokens), "passes": int(passes)}
