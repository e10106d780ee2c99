"""Exploration, not part of ondevice: does an attention readout over the answer's earlier hidden rows (EAGLE's
missing piece) or a feature-regression loss raise the heads' acceptance? Head k as in ondevice/heads/model.py
("base"), or with a 4-head attention over the previous W hidden rows and their tokens ("attn"); both trained
identically (full softmax over the draft vocabulary, AdamW, cosine) on the recorded answers, τ of a greedy
chain on the held-out ones. Needs JAX for autograd (not a dependency: ``pip install jax``).

    PYTHONPATH=$PWD python scripts/heads_attention_probe.py MODEL base|attn K EPOCHS [W] [FEATURE_LOSS_WEIGHT]
"""

import json
import re
import sys
import time

import numpy as np

try:
    import jax
    import jax.numpy as jnp
except ImportError:
    sys.exit("this exploration needs JAX: pip install jax")
from ondevice.heads import data, fit, store  # noqa: E402
from ondevice.store import catalog, lookup  # noqa: E402

model, variant = sys.argv[1], sys.argv[2]
K = int(sys.argv[3]) if len(sys.argv) > 3 else 1
EPOCHS = int(sys.argv[4]) if len(sys.argv) > 4 else 4
W = int(sys.argv[5]) if len(sys.argv) > 5 else 64
R, NH, DH, B = 256, 4, 32, 64
path = lookup.resolve(model)
work = catalog.home() / "heads" / "work" / store.target_sha256(path)[:16]
heads, meta = store.load(store.default_path(path), path)
inv = heads.index(int(meta["target_vocab_size"]))
files = sorted((work / "records").glob("rec-*.npz"), key=lambda p: int(re.findall(r"\d+", p.stem)[0]))
recs, n = [], 0
for p in files:
    if n >= 90000:
        break
    r = data.load_record(p)
    recs.append(r)
    n += len(r.hidden)
rng = np.random.default_rng(0)
order = rng.permutation(len(recs))
nv = len(recs) // 10
tr = [recs[i] for i in sorted(order[nv:])]
va = [recs[i] for i in sorted(order[:nv])]
ho = [data.load_record(p) for p in sorted((work / "heldout").glob("rec-*.npz"))]
print(len(tr), len(va), len(ho), sum(len(r.hidden) for r in tr), flush=True)
d = heads.d
OUT = jnp.asarray(heads.out)
EMBN = np.concatenate([heads.emb, np.zeros((1, d), np.float32)])
sh, se = heads.s_h, heads.s_e


def tensors(rs):
    f = fit.Flat.of(rs)
    pos = np.concatenate([np.arange(len(r.hidden)) for r in rs])
    t_ids, t_pr = fit.teacher(heads, f.H)
    tok = inv[f.tok]
    tok[tok < 0] = len(heads.emb)  # the zero row (after the input-only rows)
    nx = inv[f.nxt]
    tp = t_pr[:, :8] / t_pr[:, :8].sum(1, keepdims=True)
    return dict(f=f, H=f.H, E=EMBN[tok], nxt=nx, left=f.left, pos=pos, tid=t_ids[:, :8], tpr=tp, N=len(f.H))


Ttr, Tva, Tho = tensors(tr), tensors(va), tensors(ho)


def init(key, attn):
    ks = jax.random.split(key, 4)
    p = {
        "w1": jax.random.normal(ks[0], (2 * d + (NH * DH if attn else 0), R)) / np.sqrt(2 * d),
        "b1": jnp.zeros(R),
        "w2": jnp.zeros((R, d)),
    }
    if attn:
        p["q"] = jax.random.normal(ks[1], (2 * d, NH * DH)) / np.sqrt(2 * d)
        p["kv"] = jax.random.normal(ks[2], (2 * d, 2 * NH * DH)) / np.sqrt(2 * d)
        p["bias"] = jnp.zeros((NH, W))
    return p


def ctx_batch(T, a):
    """[B, W, 2d] context rows a, a-1, .. a-W+1 of the same answer, and their mask."""
    off = np.arange(W)
    j = a[:, None] - off[None, :]
    ok = off[None, :] <= T["pos"][a][:, None]
    jj = np.maximum(j, 0)
    return np.concatenate([T["H"][jj] * sh, T["E"][jj] * se], 2), ok


def fwd(p, h, e, kin, ok, kv_p):
    u = jnp.concatenate([h * sh, e * se], 1)
    if "q" in p:
        kv = (kin @ kv_p).reshape(kin.shape[0], W, 2, NH, DH)
        q = (u @ p["q"]).reshape(-1, NH, DH)
        sc = jnp.einsum("bhd,bwhd->bhw", q, kv[:, :, 0]) / DH**0.5 + p["bias"][None]
        sc = jnp.where(ok[:, None, :], sc, -1e9)
        c = jnp.einsum("bhw,bwhd->bhd", jax.nn.softmax(sc, -1), kv[:, :, 1]).reshape(kin.shape[0], -1)
        u = jnp.concatenate([u, c], 1)
    return h + jax.nn.silu(u @ p["w1"] + p["b1"]) @ p["w2"]


FEAT = float(sys.argv[6]) if len(sys.argv) > 6 else 0.0


def loss_fn(p, h, e, kin, ok, tid, tpr, kv_p, htrue):
    hk = fwd(p, h, e, kin, ok, kv_p if kv_p is not None else p.get("kv"))
    lg = hk @ OUT.T
    lp = jax.nn.log_softmax(lg, -1)
    ce = -(tpr * jnp.take_along_axis(lp, tid, 1)).sum(1).mean()
    reg = jnp.abs((hk - htrue) * sh).mean()
    return ce + FEAT * reg, (lg.argmax(1) == tid[:, 0]).mean()


grad_fn = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))
eval_fn = jax.jit(loss_fn)
fwd_j = jax.jit(fwd)


def batch_in(T, a, k, src):
    kin, ok = (
        ctx_batch(T, a) if variant == "attn" else (np.zeros((len(a), W, 1), np.float32), np.zeros((len(a), W), bool))
    )
    return src[a], T["E"][a + k + 1], kin, ok


heads_p, kv_shared = [], None
src_tr, src_va = Ttr["H"].copy(), Tva["H"].copy()
for k in range(K):
    p = init(jax.random.PRNGKey(k), variant == "attn")
    if kv_shared is not None:
        del p["kv"]
    m_ = jax.tree.map(jnp.zeros_like, p)
    v_ = jax.tree.map(jnp.zeros_like, p)
    t = 0
    rows_tr = np.flatnonzero(Ttr["left"] >= k + 1)
    rows_va = np.flatnonzero(Tva["left"] >= k + 1)
    steps = EPOCHS * (len(rows_tr) // B)
    best, best_p = 1e9, None

    @jax.jit
    def adam(p, g, m_, v_, t, lr):
        m_ = jax.tree.map(lambda m, g: 0.9 * m + 0.1 * g, m_, g)
        v_ = jax.tree.map(lambda v, g: 0.999 * v + 0.001 * g * g, v_, g)
        p = jax.tree.map(
            lambda p, m, v: (
                p * (1 - lr * 0.01 * (p.ndim > 1)) - lr * (m / (1 - 0.9**t)) / (jnp.sqrt(v / (1 - 0.999**t)) + 1e-8)
            ),
            p,
            m_,
            v_,
        )
        return p, m_, v_

    for ep in range(EPOCHS):
        t0 = time.time()
        perm = np.random.default_rng(ep).permutation(rows_tr)
        for s in range(0, len(perm) - B + 1, B):
            a = perm[s : s + B]
            h, e, kin, ok = batch_in(Ttr, a, k, src_tr)
            (_loss, _), g = grad_fn(
                p, h, e, kin, ok, Ttr["tid"][a + k + 1], Ttr["tpr"][a + k + 1], kv_shared, Ttr["H"][a + k + 1]
            )
            t += 1
            p, m_, v_ = adam(p, g, m_, v_, t, 2e-3 * 0.5 * (1 + np.cos(np.pi * min(1, t / steps))))
        vl = vh = 0
        for s in range(0, len(rows_va), 512):
            a = rows_va[s : s + 512]
            h, e, kin, ok = batch_in(Tva, a, k, src_va)
            loss, h_ = eval_fn(
                p, h, e, kin, ok, Tva["tid"][a + k + 1], Tva["tpr"][a + k + 1], kv_shared, Tva["H"][a + k + 1]
            )
            vl += float(loss) * len(a)
            vh += float(h_) * len(a)
        vl, vh = vl / len(rows_va), vh / len(rows_va)
        print(f"head {k + 1} ep {ep + 1} val_loss {vl:.4f} val_top1 {vh:.4f} {time.time() - t0:.0f}s", flush=True)
        if vl < best:
            best, best_p = vl, p
    p = best_p
    heads_p.append(p)
    if variant == "attn" and kv_shared is None:
        kv_shared = p["kv"]
    for T, src in ((Ttr, src_tr), (Tva, src_va)):
        rows = np.flatnonzero(T["left"] >= k + 1)
        new = np.zeros_like(src)
        for s in range(0, len(rows), 512):
            a = rows[s : s + 512]
            h, e, kin, ok = batch_in(T, a, k, src)
            new[a] = np.asarray(fwd_j(p, h, e, kin, ok, kv_shared))
        src[...] = new

N = Tho["N"]
hits = np.zeros(N, np.int64)
nxt_c = np.where(Tho["nxt"] < 0, len(heads.emb), Tho["nxt"])
for s in range(0, N, 512):
    a = np.arange(s, min(s + 512, N))
    h = Tho["H"][a]
    x = nxt_c[a]
    alive = np.ones(len(a), bool)
    kin, ok = (
        ctx_batch(Tho, a) if variant == "attn" else (np.zeros((len(a), W, 1), np.float32), np.zeros((len(a), W), bool))
    )
    for k, p in enumerate(heads_p):
        h = np.asarray(fwd_j(p, h, EMBN[x], kin, ok, kv_shared))
        row = np.asarray((h @ heads.out.T).argmax(1))
        want = Tho["nxt"][np.minimum(a + k + 1, N - 1)]
        alive &= (Tho["left"][a] >= k + 1) & (row == want)
        hits[a] += alive
        x = row
res = {}
for cls in sorted({r.cls for r in ho}) + ["all"]:
    ri = np.array([i for i, r in enumerate(ho) if cls in ("all", r.cls)])
    res[cls] = round(fit.offline_tau(hits, Tho["f"], ri)["tau"], 3)
    res[cls + "_acc"] = [round(float(np.mean(hits[np.isin(Tho["f"].rec, ri)] >= j)), 3) for j in range(1, K + 1)]
print(variant, K, W, FEAT, EPOCHS, json.dumps(res), flush=True)
