"""``train_eagle`` (``ondevice train-heads MODEL``, the default kind): an EAGLE-style drafter for one GGUF or MLX
target, from the target's own answers to a GGUF that llama.cpp's eagle3 graph runs (and ``mlx_eagle3`` on an MLX
target: ``eagle_mlx`` reads what the GGUF path reads from the file, and the converter checks the written file in MLX).

Steps: record the target's greedy answers (``train.record_answers``, shared with the Medusa heads; resumable)
→ one teacher-forced prefill per answer keeping the inputs of target layers [2, L/2, L − 3] and the target's top-k
(``eagle_data``; and of ``--text`` files, teacher-forced) → draft vocabulary (the answers' most frequent ids) with the target's LM-head rows and final norm
→ fit the drafter in JAX, unrolled over ``depths`` drafting steps on its own outputs (``eagle``; checkpointed
every epoch and every ``SAVE_SECONDS`` within one, the best epoch on held-out answers kept) → τ of greedy chains on held-out answers, per depth → a
SpecForge checkpoint converted and verified in llama.cpp (``eagle_store``). Everything random comes from ``seed``.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path

import numpy as np

from ondevice.errors import OndeviceError
from ondevice.heads import eagle, eagle_data, eagle_mlx, eagle_store, store, texts, train

DEFAULTS = dict(vocab=8192, depths=5, epochs=12, max_new=192, window=384, batch_tokens=512, lr=2e-3, noise=0.05,
                feat_w=0.0, fix_head=False, wd=0.0, fc_top=True)  # the Qwen runs' (SmolLM2's: 1,024-row steps)
# the stored drafter's matrices (llama.cpp's quantizer): q4_0 drafts a token for ~.03 of a Qwen2.5-Coder-1.5B decode
# against ~.07 (q8_0) and ~.06-.15 (f16), τ unchanged (docs/eagle.md, session 18); an MLX target's drafter stays f16
DRAFT_DTYPES = ("q4_0", "q8_0", "f16")
DEFAULT_HOURS = 1.5  # the whole run's wall-time budget when no epochs are given (the issue's: a 1.5B target, 2 cores)
SAVE_SECONDS = 600.0  # the fit's checkpoint is also saved mid-epoch this often (an epoch of a 1.5B target's fit is hours)


def _norm_row(path: Path) -> np.ndarray:
    import gguf

    for t in gguf.GGUFReader(str(path)).tensors:
        if t.name == "output_norm.weight":
            return np.asarray(gguf.quants.dequantize(np.asarray(t.data), t.tensor_type), np.float32).reshape(-1)
    raise OndeviceError(f"{path.name}: no output_norm.weight; not a decoder-only GGUF the drafter can read")


def shape_for(cfg: dict, draft_vocab: int) -> eagle.Shape:
    """The drafter's sizes for a target config (``GGUFFile.config``): the target's width, heads and RoPE; its MLP
    at most 3× the width (the draft's cost); ``draft_vocab`` rows of LM head."""
    h, nh = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    return eagle.Shape(hidden=h, n_heads=nh, n_kv_heads=int(cfg.get("num_key_value_heads") or nh), head_dim=h // nh,
                       ffn=min(int(cfg["intermediate_size"]), 3 * h), draft_vocab=int(draft_vocab),
                       eps=float(cfg.get("rms_norm_eps", 1e-5)), rope_theta=float(cfg.get("rope_theta", 10000.0)))


def heldout_tau(run, params, seqs: list[eagle_data.Seq], inv, table, T: int, depths: int, gammas=(3, 5)) -> dict:
    """Greedy chains replayed on held-out answers (``chain_tau``): τ per γ, and per depth the acceptance given the
    earlier depths accepted (the draft's token = the target's next one). ``run``: ``eagle.make_eval``."""
    emitted = {g: 0 for g in gammas}
    passes = {g: 0 for g in gammas}
    acc = np.zeros((depths, 2))
    for s in seqs:
        n = min(len(s.tokens), T)
        hits = np.asarray(run(params, eagle_data.batch_arrays([s], [(0, 0)], eagle_data.bucket(n), inv, table)))[:, 0, :n]
        for g in gammas:
            e, p = eagle_data.chain_tau(hits, s.n_prompt, n, g)
            emitted[g] += e
            passes[g] += p
        for b in range(s.n_prompt - 1, n - 2):  # per depth, conditional on the chain so far
            for j in range(depths):
                if b + j + 1 >= n - 1:
                    break
                acc[j, 1] += 1
                if not hits[j, b + j]:
                    break
                acc[j, 0] += 1
    return {**{f"tau_chain{g}": round(emitted[g] / max(1, passes[g]), 3) for g in gammas},
            "accept_by_depth": [round(a / max(1, c), 3) for a, c in acc]}


def _budget_epochs(path: Path, step, params, tr, plan, inv, table, *, seconds_left: float, hidden=None) -> dict:
    """How many epochs fit in ``seconds_left``: the step's seconds per (padded) row, timed on a batch of each
    window length of an epoch's ``plan`` (``eagle_data.batches``) after a first call compiles it (the fit reuses those compiles: a few lengths), times
    the epoch's rows of that length. Saved at ``path`` and read back, so a resumed run keeps its schedule.

    Returns:
        {"epochs", "seconds_per_row" (by window length), "epoch_seconds", "seconds_left"}.
    """
    from ondevice import atomic

    try:
        got = json.loads(path.read_text("utf-8"))
        if isinstance(got.get("epochs"), int) and got["epochs"] >= 1:
            return got
    except (OSError, ValueError, AttributeError):
        pass  # none yet, or damaged: measure again
    opt, per_row = eagle.zeros_like(params), {}
    for L in sorted({b[0] for b in plan}):
        _, B, ws = max((b for b in plan if b[0] == L), key=lambda b: len(b[2]))
        batch = eagle_data.batch_arrays(tr, ws, L, inv, table, rows=B, hidden=hidden)
        for _ in range(2):  # the first compiles
            t = time.perf_counter()
            np.asarray(step(params, opt, batch, 0)[2])  # waits for the step (its outputs are dropped)
            took = time.perf_counter() - t
        per_row[L] = took / (B * L)
    epoch_s = sum(per_row[L] * L * B for L, B, _ in plan)
    got = {"epochs": int(min(DEFAULTS["epochs"], max(1, seconds_left // max(epoch_s, 1e-9)))),
           "seconds_per_row": {str(k): v for k, v in per_row.items()}, "epoch_seconds": round(epoch_s, 2), "seconds_left": round(seconds_left, 1)}
    atomic.write_text(path, json.dumps(got))
    return got


def _soften(params, shape: eagle.Shape, seqs, inv, table, target_std: float = 2.0) -> float:
    """The factor on the final norm's weight that gives the initial draft logits a spread of ``target_std``: the
    target's own norm and LM head are sharp for its hidden states, and the untrained layer's output points
    anywhere, so unscaled they start the loss at ~25 nats and Adam needs thousands of steps to undo it."""
    n = min(len(seqs), 4)
    L = eagle_data.bucket(min(len(s.tokens) for s in seqs[:n]))
    batch = eagle_data.batch_arrays(seqs[:n], [(i, 0) for i in range(n)], L, inv, table)
    cos, sin = eagle.rope_tables(shape, L)
    logits, _ = eagle.unrolled(params, shape, batch["feats"], batch["emb"], cos, sin, 1)
    std = float(np.std(np.asarray(logits[0])[batch["valid"]], axis=-1).mean())
    return target_std / std if std > 0 else 1.0


def _save_state(path: Path, params, opt, info: dict) -> None:
    from ondevice import atomic

    arrays = {f"p.{k}": np.asarray(v) for k, v in params.items()}
    arrays.update({f"{g}.{k}": np.asarray(v) for g in ("m", "v") for k, v in opt[g].items()})
    with atomic.replacing(path) as tmp, open(tmp, "wb") as f:
        np.savez(f, __info__=np.array(json.dumps(info)), **arrays)


def _load_state(path: Path, params: dict) -> tuple[dict, dict, dict] | None:
    """(params, optimiser moments, info) saved by ``_save_state``; None when missing or damaged (started over)."""
    try:
        with np.load(path) as z:
            info = json.loads(str(z["__info__"]))
            p = {k: z[f"p.{k}"] for k in params}
            opt = {g: {k: z[f"{g}.{k}"] for k in params} for g in ("m", "v")}
    except eagle_data.DAMAGED:
        return None
    return p, opt, info


def _check_args(**kw) -> None:
    """Refuse, in one line naming the argument, settings that would train nothing or fail after the recording."""
    for name in ("epochs", "vocab", "depths", "batch_tokens", "max_new"):
        if name == "epochs" and kw[name] is None:
            continue  # sized to the time budget
        if not isinstance(kw[name], (int, np.integer)) or kw[name] < 1:
            raise OndeviceError(f"{name}={kw[name]!r}: must be a positive integer")
    if not np.isfinite(kw["hours"]) or kw["hours"] <= 0:
        raise OndeviceError(f"hours={kw['hours']!r}: the time budget must be a positive number of hours "
                            f"(default {DEFAULT_HOURS})")
    if not np.isfinite(kw["lr"]) or kw["lr"] <= 0:
        raise OndeviceError(f"lr={kw['lr']!r}: the learning rate must be a positive number (default {DEFAULTS['lr']})")
    if not np.isfinite(kw["noise"]) or kw["noise"] < 0:
        raise OndeviceError(f"noise={kw['noise']!r}: the features' input noise must be >= 0 (default {DEFAULTS['noise']})")
    for name in ("feat_w", "wd"):
        if not np.isfinite(kw[name]) or kw[name] < 0:
            raise OndeviceError(f"{name}={kw[name]!r}: must be a number >= 0 (default {DEFAULTS[name]})")
    if kw["draft_dtype"] not in (None, *DRAFT_DTYPES):
        raise OndeviceError(f"draft_dtype={kw['draft_dtype']!r}: choose {' | '.join(DRAFT_DTYPES)} (default {DRAFT_DTYPES[0]})")


def train_eagle(model: str | os.PathLike, *, tokens: int = train.DEFAULT_TOKENS, out: str | os.PathLike | None = None,
                seed: int = 0, threads: int | None = None, quiet: bool = False, vocab: int = DEFAULTS["vocab"],
                depths: int = DEFAULTS["depths"], epochs: int | None = None, max_new: int = DEFAULTS["max_new"],
                n_ctx: int = 1024, slots: int = 32, lr: float = DEFAULTS["lr"], noise: float = DEFAULTS["noise"],
                batch_tokens: int = DEFAULTS["batch_tokens"], feat_w: float = DEFAULTS["feat_w"],
                fix_head: bool = DEFAULTS["fix_head"], wd: float = DEFAULTS["wd"], fc_top: bool = DEFAULTS["fc_top"],
                text: Sequence[str | os.PathLike] = (), text_tokens: int | None = None,
                convert: Callable | None = None, target_info: Callable | None = None,
                hours: float = DEFAULT_HOURS, draft_dtype: str | None = None,
                layers: Sequence[int] | None = None) -> dict:
    """Train the EAGLE-style drafter for ``model`` (a GGUF or catalog name) and store it (``eagle_store``).

    Args:
        convert: ``converters.eagle3.convert_eagle3``, which writes the trained checkpoint as an eagle3 GGUF and
            checks it in llama.cpp (converters sit above the runtime, so the caller hands it in; ``ondevice
            train-heads`` does).
        target_info: the converter's reading of the target (``converters.eagle3.target_info``: its vocabulary, hidden
            size and layers), called before any work, so that a target the converter would refuse after hours of
            recording and fitting is refused first.
        tokens: answer tokens to record (self-distillation; a tenth of the answers is held out to measure τ).
        out: folder for the drafter file (default: beside the model in the store).
        vocab: draft vocabulary size; depths: drafting steps trained (the longest chain it is trained for).
        epochs: passes over the data (the best on held-out answers is kept); None: as many as fit in what is left
            of ``hours`` (the whole run's budget, recording included) when the fit starts, from the fit step's own
            measured time, between 1 and DEFAULTS["epochs"] (``_budget_epochs``; kept for a resumed run); lr, noise: AdamW peak rate and
            the features' relative input noise; batch_tokens: rows per optimiser step.
        feat_w: weight of the feature loss (regression onto the target's hidden state, ``eagle.loss_fn``);
            fix_head: keep the LM head as the target's rows (its norm trains: it starts softened); wd: AdamW weight decay;
            fc_top: fc starts as the identity on the highest fused layer (``eagle.init``).
        text: files or folders of text already on the machine (``texts.read_texts``), read teacher-forced as
            extra training data (never held out: τ is measured on the target's own answers); text_tokens: how
            many tokens of it (default: as many as ``tokens``).
        n_ctx, slots, threads, max_new: recording (as ``train.train_heads``).
        draft_dtype: the drafter file's matrices, one of ``DRAFT_DTYPES`` (default q4_0; f16 for an MLX target, the
            only one it takes). A run already fitted only converts again.
        layers: the 3 target layers whose inputs are fused (ids 1 .. L−1, ascending, distinct; ``eagle.fused_layers``);
            default EAGLE-3's (2, L/2, L−3).
    Returns:
        A summary: path, wall seconds, tokens, τ of greedy chains (γ 3 / 5) on held-out answers, per-depth
        acceptance, the fit log and the conversion check.
    """
    from ondevice.backends import detect_format
    from ondevice.backends.llama import LlamaBackend
    from ondevice.formats.gguf import GGUFFile
    from ondevice.loader import load
    from ondevice.store import catalog, lookup

    if convert is None:
        raise OndeviceError("train_eagle needs the EAGLE-3 converter: pass convert=converters.eagle3.convert_eagle3")
    if tokens < 1:
        raise OndeviceError(f"tokens={tokens}: train-heads needs a positive number of answer tokens (--tokens N, N >= 100)")
    if isinstance(draft_dtype, str):
        draft_dtype = draft_dtype.lower()  # Q4_0 as llama.cpp and file names spell it
    _check_args(epochs=epochs, hours=hours, vocab=vocab, depths=depths, batch_tokens=batch_tokens, max_new=max_new, lr=lr, noise=noise,
                feat_w=feat_w, wd=wd, draft_dtype=draft_dtype)
    text_budget = (tokens if text_tokens is None else int(text_tokens)) if text else 0
    text_paths: list[Path] = []
    if text:
        if text_budget < 16:  # a piece has 16 tokens or more: fewer read every file and found none
            raise OndeviceError(f"text_tokens={text_tokens}: must be 16 tokens or more (or drop --text)")
        text_paths = texts.text_files(text)  # a missing path is refused before any work; the folders walked once
    t0 = time.perf_counter()
    path = lookup.resolve(model)
    fmt = detect_format(path)
    if fmt not in ("gguf", "mlx"):
        raise OndeviceError(f"{path.name}: the EAGLE drafter trains for a GGUF file or an MLX model directory, not a "
                            f"{fmt} model; run train-heads on the GGUF or MLX form of this model")
    mlx = fmt == "mlx"  # one model in memory: the runtime's target records, reads the features, checks the file
    if draft_dtype is None:
        draft_dtype = "f16" if mlx else DRAFT_DTYPES[0]
    if mlx and draft_dtype != "f16":
        raise OndeviceError(f"draft_dtype={draft_dtype!r}: an MLX target runs its drafter from an f16 GGUF; "
                            "use f16 (--draft-dtype f16, or leave it out)")
    if path.is_dir() and not mlx:
        path = path / "model.gguf"
    if target_info is not None:
        target_info(path)  # raises the converter's own one-line refusal
    sha = store.target_sha256(path)
    work = catalog.home() / "heads" / "work" / sha[:16]
    dest = train._dest(path, out)
    dest = dest.with_name(eagle_store.default_path(path).name)
    cfg = eagle_mlx.config(path) if mlx else GGUFFile(path).config()
    L = int(cfg["num_hidden_layers"])
    layer_ids = eagle.fused_layers(layers, L, path.name)
    # the features' context first: a target whose graph cannot hand out layer inputs is refused before any work
    fb = None if mlx else LlamaBackend(path, n_ctx=n_ctx, threads=threads, n_batch=512)  # MLX: after the load
    try:
        if fb is not None:
            fb.enable_layer_inputs(layer_ids)
    except OndeviceError as e:
        fb.close()
        raise OndeviceError(f"{e}; {eagle_mlx.MEDUSA}") from None
    except BaseException:
        fb.close()
        raise
    with ExitStack() as stack:
        if fb is not None:
            stack.callback(fb.close)
        stack.enter_context(train._exclusive(work, path))
        bar = stack.enter_context(train._progress(quiet))
        rt = load(path, drafter="none", n_ctx=n_ctx, threads=threads)
        stack.callback(rt.close)
        V = rt.target.vocab_size
        if mlx:
            fb = eagle_mlx.prepare(rt.target, layer_ids)
        records = train.record_answers(rt, path, work, tokens=tokens, seed=seed, max_new=max_new, slots=slots,
                                       threads=threads, bar=bar, mlx=mlx)
        if mlx:
            fb.enable_layer_inputs(layer_ids)
        else:
            rt.close()  # llama.cpp: the features' own context is the one model in memory from here
        if not records:
            raise OndeviceError(f"{path.name}: no prompt left room for an answer in n_ctx={n_ctx}; raise n_ctx")
        if len(records) < 2:  # else τ "held out" would be measured on the training answer
            raise OndeviceError(f"tokens={tokens}: 1 answer recorded; at least 2 are needed (one is held out to measure "
                                "τ): raise --tokens (the answers recorded are kept)")
        t_rec = time.perf_counter() - t0
        task = bar.add_task("target features (tokens)", total=sum(len(r.prompt) + len(r.tokens) - 1 for r in records))
        seqs = eagle_data.collect(fb, records, work / f"eagle-feats-{'-'.join(map(str, layer_ids))}",
                                  on_seq=lambda n: bar.update(task, advance=n))
        text_seqs = []
        if text_budget:
            task = bar.add_task("teacher-forced text (tokens)", total=text_budget)
            text_seqs = eagle_data.collect_text(fb, texts.read_texts(text_paths, seed), work / f"eagle-text-{'-'.join(map(str, layer_ids))}",
                                                budget=text_budget, chunk=min(DEFAULTS["window"], n_ctx),
                                                on_seq=lambda n: bar.update(task, advance=n))
            if not text_seqs:
                raise OndeviceError(f"{', '.join(map(str, text))}: no UTF-8 text of 16 tokens or more to train on "
                                   f"({texts.SKIPPED})")
        t_feat = time.perf_counter() - t0 - t_rec
        order = np.random.default_rng(seed).permutation(len(seqs))
        n_val = max(1, len(seqs) // 10) if len(seqs) > 1 else 0
        val = [seqs[i] for i in order[:n_val]]
        tr = ([seqs[i] for i in order[n_val:]] or val) + text_seqs  # text trains, never judges
        tr_recs = [records[i] for i in order[n_val:]] or records
        vocab_ids = train.choose_vocab(tr_recs, V, vocab)
        inv = np.full(V, -1, np.int32)
        inv[vocab_ids] = np.arange(len(vocab_ids), dtype=np.int32)
        # the LM-head rows of the draft vocabulary, and every token's embedding (the draft's input), in one read
        out_rows, table, arch = eagle_mlx.rows(fb, vocab_ids) if mlx else \
            train.target_rows(path, vocab_ids, emb_ids=np.arange(V))
        shape = shape_for(cfg, len(vocab_ids))
        # the target's final-norm weight: the draft's starts as it, the feature loss reads it
        norm_t = fb.final_norm() if mlx else _norm_row(path)
        params = eagle.init(shape, out_rows, norm_t, seed, fc_top=fc_top)
        params["norm.weight"] *= _soften(params, shape, tr, inv, table)
        T = int(min(DEFAULTS["window"], eagle_data.bucket(max(len(s.tokens) for s in seqs + text_seqs))))
        wins = eagle_data.windows(tr, T)
        plan0 = eagle_data.batches(tr, wins, T, batch_tokens, np.random.default_rng(0))  # every epoch as many steps
        steps_per_epoch = len(plan0)
        n_tr = int(sum(len(s.tokens) for s in tr))
        n_text = int(sum(len(s.tokens) for s in text_seqs))
        hid = [eagle_data.hidden_rows(r) for r in tr_recs] + [(0, table[:0])] * len(text_seqs) \
            if feat_w else None  # aligned with tr (text has no recorded hidden states: no feature loss there)
        extra = [feat_w, "lm_head" if fix_head else "", wd, *(["fc_top"] if fc_top else []), *(["text", n_text, texts.digest(s.tokens for s in text_seqs)] if n_text else [])] \
            if (feat_w or fix_head or wd or fc_top or n_text) else []  # earlier keys unchanged
        step = eagle.make_step(shape, depths, T, lr=lr, warmup=min(200, steps_per_epoch), total=(epochs or 1) * steps_per_epoch,
                               feat_w=feat_w, norm_t=norm_t, frozen=("lm_head.weight",) if fix_head else (),
                               wd=wd)

        def fit_key(passes) -> str:  # the fit's identity; ``passes``: its epochs, or the budget that sizes them
            return hashlib.sha256(json.dumps(["soft-init", sha, n_tr, len(seqs), seed, vocab, depths, passes, T,
                                              batch_tokens, lr, noise, layer_ids, *extra]).encode()).hexdigest()[:12]

        sized = None
        if epochs is None:
            sized = _budget_epochs(work / f"eagle-epochs-{fit_key(['hours', hours])}.json", step, params, tr, plan0,
                                   inv, table, seconds_left=hours * 3600 - (time.perf_counter() - t0), hidden=hid)
            epochs = sized["epochs"]
            step.total = epochs * steps_per_epoch  # the schedule's length, now known (no new compile)
        key = fit_key(epochs)
        ckpt = work / f"eagle-fit-{key}.npz"
        opt, log, start, best, info = eagle.zeros_like(params), [], 0, None, {}
        if (state := _load_state(ckpt, params)) is not None:
            params, opt, info = state
            log, start, best = info["log"], info["epoch"], info.get("best")
        best_params = _load_state(work / f"eagle-best-{key}.npz", params) if best is not None else None
        best_params = best_params[0] if best_params else None
        run = eagle.make_eval(shape, depths, T)
        t1 = time.perf_counter()
        done = info.get("step", 0)  # steps of epoch `start` already taken (a checkpoint saved mid-epoch)
        before = info.get("seconds", log[-1]["seconds"] if log else 0.0)  # the log's fit clock goes on from there
        task = bar.add_task("fitting the drafter (steps)", total=epochs * steps_per_epoch,
                            completed=start * steps_per_epoch + done)
        for ep in range(start, epochs):
            rng = np.random.default_rng([seed, ep])
            loss_sum, hits = 0.0, np.zeros((depths, 2))
            plan = eagle_data.batches(tr, wins, T, batch_tokens, rng)
            if done:  # resume exactly: the epoch's plan again, then the noise stream where it stopped
                rng.bit_generator.state, loss_sum, hits = info["rng"], info["loss_sum"], np.asarray(info["hits"])
            saved = time.perf_counter()
            for s, (L, B, ws) in enumerate(plan[done:], start=done):
                batch = eagle_data.batch_arrays(tr, ws, L, inv, table, rng, noise, rows=B, hidden=hid)
                params, opt, loss, h = step(params, opt, batch, ep * steps_per_epoch + s)
                loss_sum += float(loss)
                hits += np.asarray(h)
                bar.update(task, advance=1)
                if time.perf_counter() - saved >= SAVE_SECONDS and s + 1 < steps_per_epoch:
                    _save_state(ckpt, params, opt, {"epoch": ep, "step": s + 1, "log": log, "best": best,
                                                    "rng": rng.bit_generator.state, "loss_sum": loss_sum,
                                                    "hits": hits.tolist(),
                                                    "seconds": round(before + time.perf_counter() - t1, 1)})
                    saved = time.perf_counter()
            done = 0
            ev = heldout_tau(run, params, val or tr[:8], inv, table, T, depths)
            log.append({"epoch": ep + 1, "loss": round(loss_sum / steps_per_epoch, 4),
                        "train_top1_by_depth": [round(a / max(1, c), 3) for a, c in hits], **ev,
                        "seconds": round(before + time.perf_counter() - t1, 1)})
            if best is None or ev["tau_chain5"] > best:
                best, best_params = ev["tau_chain5"], {k: np.asarray(v) for k, v in params.items()}
                _save_state(work / f"eagle-best-{key}.npz", best_params, eagle.zeros_like(best_params), {"best": best})
            _save_state(ckpt, params, opt, {"epoch": ep + 1, "log": log, "best": best})
        t_fit = time.perf_counter() - t1
        params = best_params or {k: np.asarray(v) for k, v in params.items()}
        final = heldout_tau(run, params, val or tr[:8], inv, table, T, depths)
        meta = {"target_sha256": sha, "target_file": path.name, "architecture": arch, "target_vocab_size": V,
                "draft_vocab_size": int(len(vocab_ids)), "target_layers": layer_ids, "depths": depths,
                "training_tokens": n_tr, "text_tokens": n_text, "heldout_answers": len(val), "seed": seed, "epochs": epochs,
                **({"epochs_sized": sized} if sized else {}),
                "feat_w": feat_w, "fix_head": bool(fix_head), "wd": wd, "fc_top": bool(fc_top), "dtype": draft_dtype,
                "record_seconds": round(t_rec, 1), "feature_seconds": round(t_feat, 1), "fit_seconds": round(t_fit, 1),
                "tau_heldout": final}
        with tempfile.TemporaryDirectory(dir=work, prefix="eagle-ckpt-") as tmp:
            ckpt_dir = eagle_store.save_checkpoint(Path(tmp), params, shape.config(V, layer_ids), vocab_ids)
            conv = eagle_store.write_gguf(ckpt_dir, path, dest, meta, convert, dtype=draft_dtype,
                                          **({"mlx_target": fb} if mlx else {}))
    return {"path": str(dest), "kind": "eagle", "wall_seconds": round(time.perf_counter() - t0, 1), **meta,
            "verify": conv.get("verify"), "log": log}
