"""``train_heads``: self-distilled heads for one target, from prompts to a stored heads file.

Steps: record the target's greedy answers to the shipped prompts with their hidden states
(``data.collect``; resumable) → choose the draft vocabulary (the answers' most frequent ids, then the
lowest ids, which BPE gives to its earliest, most frequent merges) → read the target's own LM-head and
embedding rows for it (from the GGUF, or from an MLX model's layers) → fit heads 1..K (``fit``; checkpointed after every epoch) →
measure τ of a greedy chain on held-out answers → write the heads file (``store``).
Everything random comes from ``seed``; a rerun with the same arguments resumes where it stopped.
An MLX model directory records on the loaded target itself, one answer at a time (``data.OneSequence``).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from collections.abc import Iterable
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from ondevice import atomic
from ondevice.backends.llama import LlamaBackend
from ondevice.errors import OndeviceError
from ondevice.heads import batch, data, fit, selfprompts, store
from ondevice.heads.model import Heads
from ondevice.heads.texts import SKIPPED, digest

DEFAULTS = dict(K=3, rank=256, vocab=4096, vocab_in=32768, epochs=8, max_new=192)
DEFAULT_TOKENS = 150_000  # answer tokens: Qwen 1.5B held-out chat chain 1.53 at 150k against 1.45 at 90k (docs/heads.md)
MAX_ROUNDS = 16  # sets of self-written prompts at most (each: every topic of prompts.json, twice or once per style)


def target_rows(gguf_path: Path, ids: np.ndarray, emb_ids: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, str]:
    """(LM-head rows for ``ids``, token-embedding rows for ``emb_ids`` (default ``ids``), architecture) of the
    target, float32 [n, d].

    Only the rows asked for are dequantized (``gguf.quants``); a tied model reads both from token_embd.
    """
    import gguf

    from ondevice.formats.gguf_rows import TableRows

    r = gguf.GGUFReader(str(gguf_path))
    tensors = {t.name: t for t in r.tensors}
    arch = str(r.fields["general.architecture"].contents())

    def rows(name: str, which: np.ndarray) -> np.ndarray:
        return TableRows(tensors[name])[which]

    emb = rows("token_embd.weight", ids if emb_ids is None else emb_ids)
    if "output.weight" in tensors:
        out = rows("output.weight", ids)
    else:
        out = emb if emb_ids is None else rows("token_embd.weight", ids)
    return out, emb, arch


def choose_vocab(records: list[data.Record], V: int, size: int) -> np.ndarray:
    """The draft vocabulary: ids of the answers by frequency, then the lowest ids, ``size`` in all (sorted)."""
    size = min(size, V)
    counts = np.bincount(np.concatenate([r.tokens[1:] for r in records]), minlength=V)[:V]
    seen = np.flatnonzero(counts)
    seen = seen[np.argsort(-counts[seen], kind="stable")][:size]
    rest = np.setdiff1d(np.arange(V), seen)[: size - len(seen)]
    return np.sort(np.concatenate([seen, rest]))


def _ckpt_save(path: Path, arrays: dict, info: dict) -> None:
    with atomic.replacing(path) as tmp, open(tmp, "wb") as f:
        np.savez(f, __info__=np.array(json.dumps(info)), **arrays)


def _progress(quiet: bool):
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TextColumn("ETA"), TimeRemainingColumn(), disable=quiet, transient=False)


def _dest(path: Path, out: str | os.PathLike | None) -> Path:
    """Where the heads file will go (``out`` or the default), refused in one line before any work when
    that folder is a file or cannot be written."""
    dest = Path(out) / store.default_path(path).name if out is not None else store.default_path(path)
    folder = dest.parent
    up = next((p for p in (folder, *folder.parents) if p.exists()), None)
    if up is not None and not up.is_dir():
        raise OndeviceError(f"{up}: is a file, not a folder; pass --out FOLDER (a folder for the heads file, created if missing)")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as e:
        raise OndeviceError(f"{folder}: cannot write the heads file there ({e.strerror or e}); "
                            "pass --out FOLDER, a folder you can write in") from None
    return dest


@contextmanager
def _exclusive(work: Path, model: Path):
    """One ``train-heads`` per model at a time (an advisory lock on ``work/.lock``, released when the run or
    its process ends): a second one refuses in one line instead of recording and fitting the same files."""
    new = not work.exists()
    work.mkdir(parents=True, exist_ok=True)
    try:
        with open(work / ".lock", "w") as f:
            try:
                import fcntl
            except ImportError:  # no fcntl (Windows): no lock
                yield
                return
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                new = False
                raise OndeviceError(f"{model.name}: another `ondevice train-heads` is training heads for this model right now "
                                    f"(lock {work / '.lock'}); wait for it to finish, or stop it and rerun (it resumes)") from None
            yield
    finally:
        if new and [p.name for p in work.iterdir()] == [".lock"]:  # failed before recording anything: leave nothing
            (work / ".lock").unlink()
            work.rmdir()


def _self_prompts(rt, backend, cache: Path, seed: int, bar, round: int = 0,
                  avoid: list[str] | None = None) -> list[tuple[str, str]]:
    """The target's own prompts (``selfprompts``), written once per seed and round and kept in ``cache``; each
    request answered is appended to ``<cache>.partial`` (JSON lines) as it finishes, so a run stopped while
    the target writes resumes with the requests left."""
    if cache.is_file():
        return [tuple(x) for x in json.loads(cache.read_text("utf-8"))]
    partial = cache.with_name(cache.name + ".partial")
    known: dict[int, str | None] = {}
    if partial.is_file():
        for line in partial.read_text("utf-8").splitlines():
            try:
                i, text = json.loads(line)
                known[int(i)] = text
            except (ValueError, TypeError):
                pass  # a line cut by a kill
    task = bar.add_task("writing prompts" + (f" (round {round + 1})" if round else ""), total=None)
    cache.parent.mkdir(parents=True, exist_ok=True)
    with open(partial, "a", encoding="utf-8") as log:
        def on_answer(i: int, text: str | None) -> None:
            log.write(json.dumps([i, text], ensure_ascii=False) + "\n")
            log.flush()

        got = selfprompts.write_prompts(rt, backend, seed=seed, known=known, on_answer=on_answer, round=round, avoid=avoid,
                                        on_progress=lambda done, total: bar.update(task, completed=done, total=total))
    atomic.write_text(cache, json.dumps(got, ensure_ascii=False, indent=0))
    partial.unlink()
    return got


def record_answers(rt, path: Path, work: Path, *, tokens: int, seed: int, max_new: int, slots: int,
                   threads: int | None, bar, mlx: bool) -> list[data.Record]:
    """The target's greedy answers to the shipped prompts, then to rounds of its own prompts, until ``tokens``
    answer tokens are recorded (each answer a file under ``work / "records"``: a rerun resumes).

    Args:
        rt: the loaded target's runtime (renders chats; an MLX target records on it, one answer at a time).
        path: the target's GGUF (a llama.cpp target records ``slots`` answers at once on a context of its own).
        bar: a ``rich`` progress (``_progress``).
    """
    prompts = data.train_prompts()
    rendered = [(c, rt.render_chat([{"role": "user", "content": t}])) for c, t in prompts]
    if mlx:  # one model in memory: record on the runtime's own target, one answer at a time
        batch_be, slots = data.OneSequence(rt.target), 1
    else:  # one KV buffer per sequence, each as long as the longest shipped prompt's answer needs
        seq_ctx = max(256, *(len(ids) for _, ids in rendered)) + max_new
        batch_be = LlamaBackend(path, n_ctx=slots * seq_ctx, threads=threads, n_seq_max=slots, kv_unified=False)
    try:
        batch_be.enable_hidden()
        task = bar.add_task("recording answers (tokens)", total=tokens)
        own: list[str] = []
        for rnd in range(MAX_ROUNDS + 1):
            # the shipped prompts first; then, while the budget is not reached, rounds of the target's own
            if rnd or tokens > len(prompts) * max_new // 2:
                # rounds after the first ask other styles (``selfprompts.ASK``): named apart from the
                # resampled rounds earlier versions wrote, so those are not read as these
                name = f"selfprompts-{seed}.json" if rnd == 0 else f"selfprompts-{seed}-style{rnd}.json"
                more = _self_prompts(rt, batch_be, work / name, seed, bar, round=rnd, avoid=own)
                if rnd and not more:  # a round kept none of its requests: later ones would not either
                    break
                own += [t for _, t in more]
                rendered += [(c, rt.render_chat([{"role": "user", "content": t}])) for c, t in more]
            records = []  # the last round's records go first: this round reads them all again
            records = batch.collect_many(batch_be, rendered, work / "records", budget=tokens, max_new=max_new,
                                         slots=slots, on_record=lambda total, new: bar.update(task, completed=min(total, tokens)))
            if sum(len(r.hidden) for r in records) >= tokens:
                break
    finally:
        if mlx:
            rt.reset()  # the runtime's cache was used behind its back
        else:
            batch_be.close()
    return records


def train_heads(
    model: str | os.PathLike,
    *,
    tokens: int = DEFAULT_TOKENS,
    out: str | os.PathLike | None = None,
    seed: int = 0,
    K: int = DEFAULTS["K"],
    rank: int = DEFAULTS["rank"],
    vocab: int = DEFAULTS["vocab"],
    vocab_in: int = DEFAULTS["vocab_in"],
    epochs: int = DEFAULTS["epochs"],
    max_new: int = DEFAULTS["max_new"],
    threads: int | None = None,
    n_ctx: int = 1024,
    slots: int = 32,
    texts: Iterable[str] | None = None,
    text_tokens: int = 0,
    quiet: bool = False,
) -> dict:
    """Train heads for ``model`` and store them.

    Args:
        model: a GGUF path, an MLX model directory or a catalog name (the target).
        tokens: answer tokens to record for training and held-out measurement (self-distillation).
        out: folder for the heads file (default: beside the model in the store, see ``store.default_path``).
        seed: seeds the split, the initial weights and the batch order.
        K, rank, vocab: heads (chain length), hidden width of each head, draft vocabulary size.
        vocab_in: input vocabulary size (≥ vocab): ids whose embedding the heads read when they are the
            pending token, though never drafted (chosen like the draft vocabulary; each costs d float16s).
        epochs: passes over the data per head (the best epoch on held-out answers is kept).
        max_new: most tokens per recorded answer.
        threads, n_ctx: for the target while recording.
        slots: answers recorded together (batched decoding: one llama.cpp sequence each; an MLX target
            records one at a time).
        texts, text_tokens: optional extra training data: up to ``text_tokens`` tokens of these texts,
            teacher-forced (the target's hidden states and distributions on text it did not write).
        quiet: no progress bars.
    Returns:
        A summary: path, wall seconds (recording / fitting), tokens, τ on held-out answers, the fit log.
    """
    from ondevice.backends import detect_format
    from ondevice.loader import load
    from ondevice.store import catalog, lookup

    if tokens < 1:
        raise OndeviceError(f"tokens={tokens}: train-heads needs a positive number of answer tokens to record (--tokens N, N >= 100)")
    t0 = time.perf_counter()
    path = lookup.resolve(model)
    fmt = detect_format(path)
    if fmt not in ("gguf", "mlx"):
        raise OndeviceError(f"{path}: heads train on a GGUF file or an MLX model directory, not a {fmt} model; "
                            "run train-heads on the GGUF or MLX form of this model")
    mlx = fmt == "mlx"
    if path.is_dir() and not mlx:
        path = path / "model.gguf"
    sha = store.target_sha256(path)
    work = catalog.home() / "heads" / "work" / sha[:16]
    dest = _dest(path, out)  # checked before any work: a folder we can write in
    with _exclusive(work, path):
        with load(path, drafter="none", n_ctx=n_ctx, threads=threads) as rt, _progress(quiet) as bar:
            V = rt.target.vocab_size
            records = record_answers(rt, path, work, tokens=tokens, seed=seed, max_new=max_new, slots=slots,
                                     threads=threads, bar=bar, mlx=mlx)
            extra = []
            if texts and text_tokens:
                task = bar.add_task("teacher-forced text (tokens)", total=text_tokens)
                extra = data.collect_text(rt, texts, work / "text", budget=text_tokens,
                                          on_record=lambda total, new: bar.update(task, completed=min(total, text_tokens)))
                if not extra:  # --text named only files that are skipped: say so instead of training without them
                    raise OndeviceError(f"--text: no text of 17 tokens or more to train on ({SKIPPED})")
            if not records:
                raise OndeviceError(f"{path.name}: no prompt left room for an answer in n_ctx={n_ctx}; raise n_ctx")
            t_rec = time.perf_counter() - t0
            n_tok = int(sum(len(r.hidden) for r in records))
            rng = np.random.default_rng(seed)
            order = rng.permutation(len(records))
            n_val = max(1, len(records) // 10) if len(records) > 1 else 0
            val_set = set(order[:n_val].tolist())
            train_recs = [r for i, r in enumerate(records) if i not in val_set]
            val_recs = [r for i, r in enumerate(records) if i in val_set]
            train_recs += extra  # extra text trains, never judges (held-out answers are the target's own)
            vocab_ids = choose_vocab(train_recs, V, vocab)
            in_only = np.setdiff1d(choose_vocab(train_recs, V, vocab_in), vocab_ids) if vocab_in > vocab else np.zeros(0, np.int64)
            ids = np.concatenate([vocab_ids, in_only])
            out_rows, emb_rows, arch = rt.target.output_rows(ids) if mlx else target_rows(path, ids)
            out_rows = out_rows[: len(vocab_ids)].copy()  # not a view: it would keep all Vd + Ve rows alive (tied: emb's)
        flat_tr, flat_va = fit.Flat.of(train_recs), fit.Flat.of(val_recs or train_recs[:1])
        s_h = float(1.0 / np.sqrt(np.mean(flat_tr.H.astype(np.float64) ** 2)))
        s_e = float(1.0 / np.sqrt(np.mean(emb_rows[: len(vocab_ids)].astype(np.float64) ** 2)))
        heads = Heads.init(vocab_ids, out_rows, emb_rows, K, rank, s_h, s_e, seed, extra=in_only)
        del emb_rows
        inv = heads.index(V)
        cfg = fit.FitConfig(epochs=epochs, seed=seed)
        # one flat table: training rows first, then held-out rows (anchors never cross records)
        flat = fit.Flat(np.concatenate([flat_tr.H, flat_va.H]), np.concatenate([flat_tr.tok, flat_va.tok]),
                        np.concatenate([flat_tr.nxt, flat_va.nxt]), np.concatenate([flat_tr.left, flat_va.left]),
                        np.concatenate([flat_tr.rec, flat_va.rec + len(train_recs)]))
        n_tr = len(flat_tr.H)
        t_ids, t_pr = fit.teacher(heads, flat.H)
        n_text = int(sum(len(r.hidden) for r in extra))
        key = hashlib.sha256(json.dumps([sha, n_tok, n_text, seed, K, rank, vocab, epochs, max_new]
                                        + ([vocab_in] if len(in_only) else [])
                                        + ([digest(r.tokens for r in extra)] if extra else [])  # which text
                                        ).encode()).hexdigest()[:12]
        ckpt = work / f"fit-{key}.npz"
        done, state = 0, None
        if ckpt.is_file():  # resume: finished heads' weights, and the running head's optimiser state
            with np.load(ckpt) as z:
                info = json.loads(str(z["__info__"]))
                done = info["done"]
                for k in range(K):
                    heads.w1[k][...], heads.b1[k][...], heads.w2[k][...] = z[f"w1.{k}"], z[f"b1.{k}"], z[f"w2.{k}"]
                if info.get("state"):
                    s = info["state"]
                    state = {"epoch": s["epoch"], "best": s["best"], "log": s["log"], "t": s["t"],
                             **{g: {n: z[f"{g}.{n}"] for n in ("w1", "b1", "w2")} for g in ("w", "m", "v", "best_w")}}
        log: list[dict] = list(info.get("log", [])) if ckpt.is_file() else []
        src = flat.H
        t1 = time.perf_counter()
        with _progress(quiet) as bar:
            task = bar.add_task("fitting heads (epochs)", total=K * epochs, completed=done * epochs + (state or {}).get("epoch", 0))
            for k in range(K):
                rows = np.flatnonzero(flat.left >= k + 1)
                tr, va = rows[rows < n_tr], rows[rows >= n_tr]
                if k >= done:
                    def on_epoch(st, k=k):
                        arrays = {f"{g}.{n}": st[g][n] for g in ("w", "m", "v", "best_w") for n in ("w1", "b1", "w2")}
                        arrays.update({f"{n}.{j}": getattr(heads, n)[j] for j in range(K) for n in ("w1", "b1", "w2")})
                        _ckpt_save(ckpt, arrays, {"done": k, "log": log, "state": {
                            "epoch": st["epoch"], "best": float(st["best"]), "log": st["log"], "t": st["t"]}})
                        bar.update(task, advance=1)

                    st = fit.fit_head(heads, k, src, flat, t_ids, t_pr, inv, tr, va if len(va) else tr[:256], cfg,
                                      state=state, on_epoch=on_epoch)
                    state = None
                    log.extend(st["log"])
                    _ckpt_save(ckpt, {f"{n}.{j}": getattr(heads, n)[j] for j in range(K) for n in ("w1", "b1", "w2")},
                               {"done": k + 1, "log": log, "state": None})
                src = fit.advance(heads, k, src, flat, inv, rows)
        t_fit = time.perf_counter() - t1
        heads.with_shortlist()  # drafting scores a shortlist exactly (measured below as drafting runs)
        hits = fit.chain_hits(heads, flat, inv)
        tau_val = fit.offline_tau(hits, flat, np.unique(flat.rec[n_tr:])) if val_recs else None
        tau_train = fit.offline_tau(hits, flat, np.unique(flat.rec[:n_tr]))
        meta = {"target_sha256": sha, "target_file": path.name, "architecture": arch, "target_vocab_size": V,
                "training_tokens": int(len(flat_tr.H)), "teacher_forced_text_tokens": n_text, "heldout_tokens": int(len(flat.H) - n_tr) if val_recs else 0, "seed": seed,
                "epochs": epochs, "record_seconds": round(t_rec, 1), "fit_seconds": round(t_fit, 1),
                "tau_heldout_greedy_chain": tau_val, "tau_train_greedy_chain": tau_train, "log": log}
        store.save(dest, heads, meta)
        return {"path": str(dest), "wall_seconds": round(time.perf_counter() - t0, 1), **{k: v for k, v in meta.items() if k != "log"},
                "log": log}
