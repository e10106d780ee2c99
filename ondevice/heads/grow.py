"""Candidate trees from the heads (EAGLE-2's dynamic tree), grown level by level in batches.

A node's score is the product of the heads' softmax probabilities along its path: the heads' guess of
the chance a greedy target accepts the whole path. Depth 1 is the ``branch`` most probable tokens after
the pending one; at each next depth the ``width`` best-scoring nodes of the depth before are expanded
together (one head step and one draft-vocabulary GEMM for all of them, and for many rows at once
offline), each into its ``branch`` most probable children. Of every candidate made, the ``max_nodes``
best-scoring are kept, ordered by score (a parent scores at least as much as its child, and ties keep
shallower nodes first): every prefix of the result is then a tree, the best of its size among the
candidates, with siblings in probability order. The cost is K batched steps, about a chain's.
"""

from __future__ import annotations

import numpy as np

from ondevice.heads.model import Heads


def grow_trees(heads: Heads, H: np.ndarray, x: np.ndarray, max_nodes: int, branch: int = 4,
               width: int = 4) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Trees for a batch of rows.

    Args:
        H: [B, d] the target's hidden state at the last cached position of each row.
        x: [B] the pending token's input row (``Heads.index``: may be ≥ Vd, only embedded; −1 outside).
        max_nodes: drafted nodes per tree (at most).
    Returns:
        (draft rows [B, n], parents [B, n] (0 = the root, node j + 1 is column j), scores [B, n]), n =
        min(max_nodes, candidates), columns in score order.
    """
    B, d = H.shape
    K = heads.K
    fh, ftok = H[:, None, :], np.asarray(x, np.int64)[:, None]  # the frontier: states to expand, tokens fed
    fscore, fid = np.ones((B, 1)), np.zeros((B, 1), np.int64)  # their scores and node ids (0 = the root)
    toks, pars, scs, deps = [], [], [], []
    next_id = 1
    for k in range(K):
        w = fh.shape[1]
        hn = heads.step(k, fh.reshape(B * w, d), heads.embed(ftok.reshape(-1)))[0]  # [B·w, d]
        lg = heads.draft_logits(hn)
        b = min(branch, lg.shape[1])
        top = np.argpartition(-lg, b - 1, axis=1)[:, :b]
        m = lg.max(axis=1, keepdims=True)
        p = np.exp(np.take_along_axis(lg, top, 1) - m) / np.exp(lg - m).sum(axis=1, keepdims=True)
        score = (fscore.reshape(B * w, 1) * p).reshape(B, w * b)
        ids = next_id + np.arange(w * b)
        next_id += w * b
        toks.append(top.reshape(B, w * b))
        pars.append(np.repeat(fid, b, axis=1))
        scs.append(score)
        deps.append(np.full((B, w * b), k + 1))
        if k + 1 < K:
            sel = np.argsort(-score, axis=1, kind="stable")[:, :width]
            fh = np.take_along_axis(np.repeat(hn.reshape(B, w, d), b, axis=1), sel[:, :, None], 1)
            ftok = np.take_along_axis(toks[-1], sel, 1)
            fscore = np.take_along_axis(score, sel, 1)
            fid = np.broadcast_to(ids, (B, w * b))
            fid = np.take_along_axis(fid, sel, 1)
    tok, par, sc, dep = (np.concatenate(a, axis=1) for a in (toks, pars, scs, deps))
    n = min(max_nodes, tok.shape[1])
    order = np.lexsort((dep, -sc), axis=1)[:, :n]  # score descending, then shallower first
    tok, par, sc = (np.take_along_axis(a, order, 1) for a in (tok, par, sc))
    # node ids → positions in the kept order (a kept node's parent is kept and earlier)
    pos = np.zeros((B, next_id), np.int64)
    np.put_along_axis(pos, 1 + order, np.arange(1, n + 1)[None, :].repeat(B, 0), 1)
    parents = np.take_along_axis(pos, par, 1)
    return tok, parents, sc


def best_first(heads: Heads, h: np.ndarray, x: int, max_nodes: int, branch: int = 4,
               width: int = 4) -> tuple[list[int], list[int], list[float]]:
    """``grow_trees`` for one row: (draft rows, parents (0 = the root, node i + 1 is row i), scores)."""
    if max_nodes <= 0:
        return [], [], []
    tok, par, sc = grow_trees(heads, h[None, :], np.array([x]), max_nodes, branch, width)
    return tok[0].tolist(), par[0].tolist(), sc[0].tolist()
