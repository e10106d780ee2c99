"""``draft="auto"``: find a draft among the models on this machine, or fall back to n-gram drafting.

A candidate must (1) have the target's vocabulary: the same fingerprint, or a prefix the pair rules
accept (``check_vocabs``: same text at every shared id, only padding beyond); (2) be much smaller
(at most ``MAX_SIZE_RATIO`` of the target's bytes); (3) run here (MLX needs mlx; Core ML macOS).
Of the candidates, the smallest ``MAX_MEASURED`` are timed against the target (``costs.cached_measure``:
measured on first use, cached in ``$ONDEVICE_HOME/costs.json``) and the one with the best expected
speedup at an assumed acceptance rate wins — if that speedup is above 1; otherwise n-gram drafting.
Heads stored for the target (``ondevice train-heads``) compete too, judged by the held-out τ recorded in
their file and their measured cost per drafted token. A model that carries its own MTP heads (``mtp_row``) is
drafted by them first: they were trained with the model and cost a fraction of a target pass.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

from ondevice.errors import OndeviceError
from ondevice.store import discovery

MAX_SIZE_RATIO = 0.5  # a draft at most half the target's size
MAX_MEASURED = 3  # candidates timed against the target (smallest first)
ASSUMED_ACCEPTANCE = 0.7  # the adaptive policy's prior for model drafts, before any step is seen
MAX_GAMMA = 8


def _runnable(fmt: str) -> str | None:
    """Why a format cannot run here, or None."""
    if fmt == "mlx" and importlib.util.find_spec("mlx") is None:
        return "MLX is not installed (pip install 'ondevice[mlx]')"
    if fmt == "coreml" and sys.platform != "darwin":
        return "Core ML runs on macOS only"
    return None


def _same_file(a: str | Path, b: str | Path) -> bool:
    try:
        return Path(a).resolve() == Path(b).resolve()
    except OSError:
        return False


def candidates(target: str | Path, models: list[dict] | None = None) -> tuple[dict, list[dict]]:
    """Judge every local model as a draft for ``target`` (no weights loaded, nothing timed).

    Args:
        target: a resolved model path.
        models: ``discovery.local_models()`` (read when None).
    Returns:
        (the target's facts, one dict per other local model: name, path, format, size, size_ratio,
        ``ok`` and ``reason``), candidates first, smallest first.
    """
    target = Path(target)
    tf = discovery.facts(target)
    rows = []
    target_tokens = None
    for m in models if models is not None else discovery.local_models():
        if _same_file(m["path"], target):
            continue
        row = {k: m.get(k) for k in ("name", "path", "format", "arch", "quant", "size", "fingerprint")}
        row["size_ratio"] = round(m["size"] / tf["size"], 4) if m.get("size") and tf["size"] else None
        reason = m.get("error")
        if reason is None and m["fingerprint"] != tf["fingerprint"]:
            if m["vocab_size"] == tf["vocab_size"]:
                reason = f"vocabulary differs ({m['vocab_size']} tokens, same count, other texts)"
            else:
                target_tokens = target_tokens or discovery.tokens(target)
                try:
                    discovery.pair_rules().check_vocabs(target_tokens, discovery.tokens(Path(m["path"])), target,
                                                        m["name"])
                except OndeviceError:
                    reason = f"vocabulary differs ({m['vocab_size']} vs {tf['vocab_size']} tokens)"
        if reason is None and row["size_ratio"] is not None and row["size_ratio"] > MAX_SIZE_RATIO:
            reason = f"not much smaller ({row['size_ratio']:.2f} of the target's size; at most {MAX_SIZE_RATIO})"
        reason = reason or _runnable(m["format"])
        row.update(ok=reason is None, reason=reason or "same vocabulary, much smaller")
        rows.append(row)
    rows.sort(key=lambda r: (not r["ok"], r["size"] or 0))
    return tf, rows


def expected_speedup(costs, alpha: float = ASSUMED_ACCEPTANCE, max_gamma: int = MAX_GAMMA) -> tuple[float, int]:
    """(best expected speedup over plain decoding, its γ) for a draft with acceptance ``alpha``."""
    from ondevice.policy import expected_rate

    c = costs.draft_cost_ratio
    best = max((expected_rate([alpha] * g, g, c, costs), g) for g in range(1, max_gamma + 1))
    return best


def alpha_from_tau(tau: float, K: int) -> float:
    """The per-draft acceptance α whose chain of K has E[tokens per pass] = (1 − α^(K+1)) / (1 − α) = τ (bisection)."""
    lo, hi = 0.0, 1.0
    for _ in range(50):
        a = (lo + hi) / 2
        if sum(a**i for i in range(K + 1)) < tau:
            lo = a
        else:
            hi = a
    return lo


def heads_row(target) -> dict | None:
    """The heads stored for ``target`` judged as a drafter: their held-out τ (as α), their measured cost per
    drafted token and the expected speedup on this machine's verify curve; None when none are stored."""
    from ondevice.costs import cached_measure
    from ondevice.drafters.heads import seconds_per_token
    from ondevice.heads import eagle_store, store

    eagle = None
    if "layer_inputs" in target.features and (path := eagle_store.find(target.path)) is not None:
        eagle = _eagle_row(target, path)  # the default kind; the Medusa heads where it cannot be used
        if eagle["ok"] or store.find(target.path) is None:
            return eagle
    path = store.find(target.path)
    if path is None:
        return None
    row = {"name": "heads", "path": str(path), "format": "heads", "ok": False}
    try:
        meta = store.read_meta(path, target.path)
        tau = (meta.get("tau_heldout_greedy_chain") or {}).get("tau")
        if not tau:
            row["reason"] = "no held-out τ recorded in the heads file"
            return row
        alpha = alpha_from_tau(float(tau), int(meta["K"]))
        costs = cached_measure(target)
        spt = seconds_per_token(store.load(path, target.path, target.vocab_size)[0])  # checked, the target untouched
    except OndeviceError as e:
        row["reason"] = str(e).splitlines()[0]
        return row
    import dataclasses

    costs = dataclasses.replace(costs, draft_seconds=spt)
    speedup, gamma = expected_speedup(costs, alpha, max_gamma=int(meta["K"]))
    row.update(ok=True, reason=f"trained heads: held-out τ {tau:.2f} (α {alpha:.2f})", draft_cost_ratio=round(costs.draft_cost_ratio, 4),
               expected_speedup=round(speedup, 3), best_gamma=gamma, assumed_acceptance=round(alpha, 3))
    return row


def _eagle_row(target, path) -> dict:
    """``heads_row`` for the EAGLE-style drafter ``train-heads`` stored: its held-out τ at γ 5 and its cost per
    drafted token timed in llama.cpp's graph (a draft context of its own on the target, closed after), or in
    MLX on an MLX target (``eagle3_draft``)."""
    import dataclasses

    from ondevice.backends.eagle3 import seconds_per_token
    from ondevice.costs import cached_measure
    from ondevice.heads import eagle_store

    row = {"name": "heads", "path": str(path), "format": "eagle", "ok": False}
    try:
        meta = eagle_store.check_for(path, target.path)
        try:  # the file is untrusted: odd values make it unusable, not a traceback
            depth = int(meta.get("depths") or 5)
            if depth < 1:
                raise ValueError(depth)
            # tau_chainG was replayed with at most `depth` drafts per pass: the τ of a chain of min(G, depth)
            taus = {min(int(k[len("tau_chain"):]), depth): float(v) for k, v in
                    sorted((meta.get("tau_heldout") or {}).items(), reverse=True)
                    if k.startswith("tau_chain") and k[len("tau_chain"):].isdigit() and v}
        except (ValueError, TypeError, AttributeError) as e:
            raise OndeviceError(f"{Path(path).name}: unreadable metadata in the drafter file ({type(e).__name__}); "
                                "retrain it with `ondevice train-heads`") from None
        if not taus:
            row["reason"] = "no held-out τ recorded in the drafter file"
            return row
        chain = max(taus, key=lambda g: (g <= 5, g if g <= 5 else -g))  # the longest chain of at most 5
        tau = taus[chain]
        alpha = alpha_from_tau(tau, chain)
        costs = cached_measure(target)
        # the target's own runner (llama.cpp's graph, or Eagle3MLX on an MLX target) on a small cache of its own,
        # timed without switching the target's layer inputs on: a drafted token's cost does not depend on them
        graph = target.eagle3_draft(path, lambda ids: None, threads=target.threads, n_ctx=64)
        try:
            spt = seconds_per_token(graph)
        finally:
            graph.close()
    except OndeviceError as e:
        row["reason"] = str(e).splitlines()[0]
        return row
    costs = dataclasses.replace(costs, draft_seconds=spt)
    speedup, gamma = expected_speedup(costs, alpha, max_gamma=depth)
    row.update(ok=True, reason=f"trained EAGLE drafter: held-out τ {tau:.2f} at γ {chain} (α {alpha:.2f})",
               draft_cost_ratio=round(costs.draft_cost_ratio, 4), expected_speedup=round(speedup, 3), best_gamma=gamma,
               assumed_acceptance=round(alpha, 3))
    return row


def mtp_row(target) -> dict | None:
    """The target's own MTP heads as a choice, when its GGUF carries MTP layers this llama.cpp runs (else None)."""
    from ondevice.backends.llama_mtp import file_mtp_layers

    path = Path(target.path)
    if "nextn" not in target.features or path.suffix != ".gguf" or not path.is_file():
        return None
    n = file_mtp_layers(path)
    if not n:
        return None
    return {"drafter": "mtp", "draft": "mtp", "path": str(path),
            "reason": f"{path.name} carries its own MTP heads ({n} layer{'s' * (n != 1)}): drafting with them"}


def choose_draft(target, *, n_ctx: int, threads: int | None = None, device: str | None = None,
                 mmap: bool = True, models: list[dict] | None = None):
    """Open the local draft the cost model expects to be fastest beside the open ``target`` backend.

    Args:
        target: the opened target ``Backend``.
        n_ctx, threads, device, mmap: as for ``open_backend`` (the draft runs with the same settings).
        models: ``discovery.local_models()`` (read when None).
    Returns:
        (the draft backend, or None for n-gram drafting; ``draft_choice``: a dict saying what was
        chosen and why, with every candidate's verdict).
    """
    from ondevice.backends import open_backend
    from ondevice.costs import cached_measure

    t0 = time.perf_counter()
    own = mtp_row(target)
    if own is not None:  # trained with the model, a fraction of a target pass: preferred to any local draft
        return None, {**own, "assumed_acceptance": ASSUMED_ACCEPTANCE, "candidates": [],
                      "seconds": round(time.perf_counter() - t0, 3)}
    _, rows = candidates(target.path, models)
    choice: dict = {"drafter": "ngram", "draft": None, "assumed_acceptance": ASSUMED_ACCEPTANCE, "candidates": rows}
    best, best_speedup = None, 1.0
    target_tokens = None
    eligible = [r for r in rows if r["ok"]]
    for row in eligible[MAX_MEASURED:]:
        row["reason"] += f" (not timed: only the {MAX_MEASURED} smallest are)"
    try:
        for row in eligible[:MAX_MEASURED]:
            try:
                backend = open_backend(row["path"], n_ctx=n_ctx, threads=threads, device=device, mmap=mmap)
            except Exception as e:  # noqa: BLE001 - one candidate failing to open is a verdict, not a crash
                row.update(ok=False, reason=f"could not open: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
                continue
            try:
                target_tokens = target_tokens or target.vocab_tokens()
                discovery.pair_rules().check_vocabs(target_tokens, backend.vocab_tokens(), target.path, row["name"])
                costs = cached_measure(target, backend)
            except BaseException as e:
                backend.close()
                if not isinstance(e, OndeviceError):
                    raise
                row.update(ok=False, reason=str(e).splitlines()[0])
                continue
            speedup, gamma = expected_speedup(costs)
            row.update(draft_cost_ratio=round(costs.draft_cost_ratio, 4), expected_speedup=round(speedup, 3),
                       best_gamma=gamma)
            if speedup > best_speedup:
                if best is not None:
                    best[0].close()
                best, best_speedup = (backend, row), speedup
            else:
                backend.close()
    except BaseException:
        if best is not None:
            best[0].close()
        raise
    heads = heads_row(target)
    if heads is not None:
        rows.insert(0, heads)
        if heads["ok"] and heads["expected_speedup"] > best_speedup:  # heads beat every draft model (and plain)
            if best is not None:
                best[0].close()
            best = None
            choice.update(drafter="heads", draft="heads", path=heads["path"], source=heads["path"], expected_speedup=heads["expected_speedup"],
                          seconds=round(time.perf_counter() - t0, 3),
                          reason=f"heads stored for this model: {heads['reason']}, cost {heads['draft_cost_ratio']:.2f} "
                                 f"of a target pass; expected {heads['expected_speedup']:.2f}× plain")
            return None, choice
    measured = [r for r in rows if "expected_speedup" in r]
    choice["seconds"] = round(time.perf_counter() - t0, 3)  # judging + timing (cached after the first time)
    # stored heads that could not be used (a corrupt file, one for another model) are named, not passed over silently
    unusable = f"; the heads stored for this model were not used: {heads['reason']}" if heads and not heads["ok"] else ""
    if best is not None:
        backend, row = best
        choice.update(drafter="model", draft=row["name"], path=row["path"], expected_speedup=row["expected_speedup"],
                      reason=f"{row['name']}: same vocabulary, {row['size_ratio']:.2f} of the target's size, draft "
                             f"cost {row['draft_cost_ratio']:.2f} of a target pass; expected {best_speedup:.2f}× "
                             f"plain at acceptance {ASSUMED_ACCEPTANCE} (best of {len(measured)} measured){unusable}")
        return backend, choice
    if measured:
        top = max(measured, key=lambda r: r["expected_speedup"])
        choice["reason"] = (f"no local draft would pay: the best, {top['name']}, is expected at "
                            f"{top['expected_speedup']:.2f}× plain (acceptance {ASSUMED_ACCEPTANCE}); n-gram drafting")
    elif eligible:
        choice["reason"] = (f"{len(eligible)} candidate draft{'s' * (len(eligible) != 1)} could not be used "
                            f"({eligible[0]['name']}: {eligible[0]['reason']}); n-gram drafting")
    else:
        n = len(rows)
        choice["reason"] = (f"no compatible, much smaller model among the {n} other local model{'s' * (n != 1)} "
                            "(HF cache, LM Studio, Ollama); n-gram drafting")
    choice["reason"] += unusable
    return None, choice
