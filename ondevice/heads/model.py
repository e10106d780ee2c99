"""The heads: K residual MLP steps on the target's own post-norm hidden state, read out by its own LM head.

Notation: the target's cache holds x_0..x_t, the pending token x_{t+1} is known, and h_t is the target's
post-norm hidden state at position t (the row whose logits chose x_{t+1}). Head k (k = 1..K) maps

    ĥ_{t+k} = ĥ_{t+k-1} + W2_k · silu(W1_k · [ĥ_{t+k-1} · s_h ; e(x_{t+k}) · s_e] + b1_k),   ĥ_t = h_t

and drafts x_{t+k+1} from ``out · ĥ_{t+k}``, where ``out`` holds the target's own LM-head rows for a draft
vocabulary (the most frequent tokens) and e(·) its token embedding rows for a larger input vocabulary
(the draft vocabulary, then ``extra`` ids: a pending token the heads cannot draft is still seen; zero for
ids outside both). Head k is thus trained to predict the target's next hidden state from the previous one
and the token just drafted (Medusa heads fed the pending token, as Hydra / EAGLE do, without
attention). Each head has its own weights; the chain stops after K steps.

Pure numpy (float32; the BLAS under numpy does the matrix products).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SHORTLIST = 256  # draft rows scored exactly per drafted token when ``out`` has a low-rank shortlist
SHORTLIST_RANK = 256


def silu(a: np.ndarray) -> np.ndarray:
    """x · sigmoid(x), computed without overflow warnings."""
    return a / (1.0 + np.exp(-np.clip(a, -60.0, 60.0)))


def _silu_grad(a: np.ndarray) -> np.ndarray:
    s = 1.0 / (1.0 + np.exp(-np.clip(a, -60.0, 60.0)))
    return s * (1.0 + a * (1.0 - s))


@dataclass
class Heads:
    """The trained weights and the target rows they read.

    Attributes:
        vocab: [Vd] int64 target ids of the draft vocabulary (row i of ``out`` / ``emb`` is id vocab[i]).
        out: [Vd, d] float32 rows of the target's LM head for those ids.
        emb: [Vd + len(extra), d] float16 rows of the target's token embedding for ``vocab`` then ``extra``
            (the input vocabulary: row i < Vd is draft row i).
        w1, b1, w2: per head k: [r, 2d], [r], [d, r] float32.
        s_h, s_e: input scales (1 / RMS of hidden states and of embedding rows in the training data).
        short_a, short_b: [Vd, r'] and [r', d] float32, a rank-r' factorization of ``out`` (its top singular
            directions) that picks the shortlist ``draft_logits`` scores exactly; None: every row scored.
        extra: [Ve] int64 target ids embedded but never drafted (rows Vd.. of ``emb``).
    """

    vocab: np.ndarray
    out: np.ndarray
    emb: np.ndarray
    w1: list[np.ndarray]
    b1: list[np.ndarray]
    w2: list[np.ndarray]
    s_h: float
    s_e: float
    short_a: np.ndarray | None = None
    short_b: np.ndarray | None = None
    shortlist: int = SHORTLIST
    extra: np.ndarray | None = None

    def __post_init__(self) -> None:
        self.extra = np.zeros(0, np.int64) if self.extra is None else np.asarray(self.extra, np.int64)
        self.emb = np.ascontiguousarray(self.emb, np.float16)

    @property
    def K(self) -> int:
        return len(self.w1)

    @property
    def d(self) -> int:
        return int(self.out.shape[1])

    @property
    def rank(self) -> int:
        return int(self.w1[0].shape[0])

    @classmethod
    def init(cls, vocab, out, emb, K: int, rank: int, s_h: float, s_e: float, seed: int, extra=None) -> Heads:
        """Fresh heads: W1 small random, W2 zero (each head starts as the identity ĥ_{k} = ĥ_{k-1}).
        ``emb`` holds the rows of ``vocab`` then of ``extra`` (input-only ids)."""
        rng = np.random.default_rng(seed)
        d = out.shape[1]
        w1 = [(rng.standard_normal((rank, 2 * d)) / np.sqrt(2 * d)).astype(np.float32) for _ in range(K)]
        return cls(np.asarray(vocab, np.int64), np.ascontiguousarray(out, np.float32),
                   emb, w1, [np.zeros(rank, np.float32) for _ in range(K)],
                   [np.zeros((d, rank), np.float32) for _ in range(K)], float(s_h), float(s_e), extra=extra)

    @property
    def vocab_in(self) -> np.ndarray:
        """[Vd + Ve] target ids of the input vocabulary (the draft vocabulary first, then ``extra``)."""
        return np.concatenate([self.vocab, self.extra])

    def index(self, V: int) -> np.ndarray:
        """[V] int64: target id → input row (< Vd: also its draft row), −1 outside the input vocabulary."""
        ids = self.vocab_in
        inv = np.full(max(V, int(ids.max()) + 1), -1, np.int64)
        inv[ids] = np.arange(len(ids))
        return inv

    def embed(self, rows: np.ndarray) -> np.ndarray:
        """Embedding rows (float32) for input rows (−1 → zeros), [N, d]."""
        rows = np.asarray(rows, np.int64)
        e = self.emb[np.maximum(rows, 0)].astype(np.float32)
        e[rows < 0] = 0.0
        return e

    def step(self, k: int, h: np.ndarray, e: np.ndarray) -> tuple[np.ndarray, tuple]:
        """Head k (0-based) on a batch: (ĥ [N, d], what backward needs)."""
        u = np.concatenate([h * self.s_h, e * self.s_e], axis=-1)
        a = u @ self.w1[k].T + self.b1[k]
        s = silu(a)
        return h + s @ self.w2[k].T, (u, a, s)

    def logits(self, h: np.ndarray) -> np.ndarray:
        """Draft-vocabulary logits ``out · ĥ`` ([N, Vd] or [Vd])."""
        return h @ self.out.T

    def with_shortlist(self, rank: int = SHORTLIST_RANK, size: int = SHORTLIST) -> Heads:
        """Give ``draft_logits`` a shortlist: ``out``'s rank-``rank`` SVD scores every draft row cheaply, and
        only the ``size`` best are scored exactly. Skipped (every row exact) when that would not save most
        of the work: the factors cost (Vd + d)·rank against Vd·d, and a shortlist must be well below Vd."""
        Vd, d = self.out.shape
        if (Vd + d) * rank * 2 > Vd * d or size * 4 > Vd:
            self.short_a = self.short_b = None
            return self
        u, sv, vt = np.linalg.svd(self.out.astype(np.float64), full_matrices=False)
        self.short_a = np.ascontiguousarray((u[:, :rank] * sv[:rank]).astype(np.float32))
        self.short_b = np.ascontiguousarray(vt[:rank].astype(np.float32))
        self.shortlist = size
        return self

    def draft_logits(self, h: np.ndarray) -> np.ndarray:
        """The logits drafting uses ([N, Vd] or [Vd]): ``logits`` exactly on the shortlist of rows the low-rank
        factors rank highest, −inf on the rest (all rows exact without factors). The drafter's q is the
        processed softmax of these, so it is zero off the shortlist: the verifier still sees the q it
        sampled from (docs/heads.md has what the shortlist saves and costs in τ)."""
        if self.short_a is None:
            return self.logits(h)
        h2 = np.atleast_2d(h)
        approx = (h2 @ self.short_b.T) @ self.short_a.T
        top = np.argpartition(-approx, self.shortlist - 1, axis=1)[:, : self.shortlist]
        full = np.full(approx.shape, -np.inf, np.float32)
        step = max(1, (1 << 23) // (self.shortlist * self.d))  # rows per gather: its copy of out's rows ≤ 32 MB
        for s in range(0, len(h2), step):
            t = top[s : s + step]
            np.put_along_axis(full[s : s + step], t, np.einsum("nd,nmd->nm", h2[s : s + step], self.out[t]), 1)
        return full if h.ndim == 2 else full[0]

    def backward(self, k: int, cache: tuple, g_h: np.ndarray) -> dict[str, np.ndarray]:
        """Gradients of head k's weights given dL/dĥ (the previous ĥ is not trained through)."""
        u, a, s = cache
        g_s = g_h @ self.w2[k]
        g_a = g_s * _silu_grad(a)
        return {"w1": g_a.T @ u, "b1": g_a.sum(0), "w2": g_h.T @ s}


def soft_ce(logits: np.ndarray, t_ids: np.ndarray, t_pr: np.ndarray, mask: np.ndarray) -> tuple[float, np.ndarray, float]:
    """Cross-entropy against a sparse teacher (the target's own distribution over its top draft rows).

    Args:
        logits: [N, Vd] head logits.
        t_ids, t_pr: [N, T] teacher rows and probabilities (renormalised over those rows).
        mask: [N] bool, examples that count.
    Returns:
        (mean loss, dL/dlogits [N, Vd], top-1 agreement with the teacher's argmax).
    """
    n = max(int(mask.sum()), 1)
    m = logits.max(axis=1, keepdims=True)
    z = np.exp(logits - m)
    zs = z.sum(axis=1, keepdims=True)
    logp = logits - m - np.log(zs)
    rows = np.arange(len(logits))[:, None]
    loss = -(t_pr * logp[rows, t_ids]).sum(axis=1)
    g = z / zs
    g[rows, t_ids] -= t_pr  # the teacher's rows in a row are distinct
    g *= (mask / n)[:, None].astype(g.dtype)
    hit = logits.argmax(axis=1) == t_ids[:, 0]
    return float(loss[mask].sum() / n), g, float(hit[mask].mean()) if mask.any() else 0.0


class Adam:
    """Adam with decoupled weight decay over a dict of arrays (updated in place)."""

    def __init__(self, lr: float, wd: float = 0.0, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> None:
        self.lr, self.wd, self.b1, self.b2, self.eps = lr, wd, b1, b2, eps
        self.m: dict[str, np.ndarray] = {}
        self.v: dict[str, np.ndarray] = {}
        self.t = 0

    def update(self, params: dict[str, np.ndarray], grads: dict[str, np.ndarray], lr: float | None = None) -> None:
        self.t += 1
        lr = self.lr if lr is None else lr
        c1, c2 = 1 - self.b1 ** self.t, 1 - self.b2 ** self.t
        for name, g in grads.items():
            p = params[name]
            m = self.m.setdefault(name, np.zeros_like(p))
            v = self.v.setdefault(name, np.zeros_like(p))
            m *= self.b1
            m += (1 - self.b1) * g
            v *= self.b2
            v += (1 - self.b2) * g * g
            if self.wd and p.ndim > 1:
                p *= 1 - lr * self.wd
            p -= (lr / c1) * m / (np.sqrt(v / c2) + self.eps)
