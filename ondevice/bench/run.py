"""``ondevice bench``: tokens/sec, acceptance, costs and bounds, side by side, interleaved, as JSON.

Every mode runs on the same prompts, interleaved (for each prompt and repeat, every mode in turn),
so that the noise of a shared machine falls on all modes alike; results are compared as ratios.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from ondevice.bench.oracle import oracle_speedup
from ondevice.bench.ties import explain
from ondevice.costs import Costs, cached_measure, speedup_bound
from ondevice.errors import OndeviceError
from ondevice.params import GenerateRequest, gamma_value
from ondevice.threads import default_threads

CLASSES = ("code", "edit", "summary", "chat")
PROMPTS_DIR = Path(__file__).resolve().parents[2] / "scripts" / "prompts"
SCHEMA_VERSION = 1
# ``ondevice bench MODEL`` without --per-class / --repeats: a quick run (4 classes × 2 prompts × 2 repeats per
# mode; the whole suite, 28 prompts × 3 repeats, took over 5 minutes for plain + n-gram on a loaded 2-core machine)
QUICK_PER_CLASS, QUICK_REPEATS = 2, 2


def load_prompts(classes, prompts_dir: Path = PROMPTS_DIR, per_class: int | None = None) -> list[dict]:
    """Prompts of the suite ({id, class, prompt}) for the given classes."""
    out = []
    for cls in classes:
        f = Path(prompts_dir) / f"{cls}.jsonl"
        if not f.is_file():
            raise OndeviceError(f"{f}: no prompts for class {cls!r}; classes: {', '.join(CLASSES)}")
        rows = [json.loads(line) for line in f.read_text(encoding="utf-8").splitlines() if line.strip()]
        out += rows[:per_class] if per_class else rows
    return out


def peak_rss_mb() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r / (1024 * 1024) if platform.system() == "Darwin" else r / 1024


def machine() -> dict:
    info = {"platform": platform.platform(), "machine": platform.machine(), "processor": platform.processor(),
            "cpus": os.cpu_count(), "python": platform.python_version()}
    for mod in ("llama_cpp", "mlx", "ondevice"):
        try:
            info[f"{mod}_version"] = __import__(mod).__version__
        except (ImportError, AttributeError):
            pass
    return info


def _render(rt, text: str) -> list[int]:
    """A suite prompt as the model's chat template renders it (raw text when it has none)."""
    if rt.target.chat_template:
        return rt.render_chat([{"role": "user", "content": text}])
    return rt.tokenize(text)


def _record(mode, p, rep, gamma, stats) -> dict:
    return {"mode": mode, "class": p["class"], "prompt_id": p["id"], "repeat": rep, "gamma": gamma,
            "tokens": stats.tokens, "tokens_per_second": stats.tokens_per_second,
            "decode_tokens_per_second": stats.decode_tokens_per_second,
            "time_to_first_token": stats.time_to_first_token, "acceptance_rate": stats.acceptance_rate,
            "mean_accepted_per_forward": stats.mean_accepted_per_forward, "target_forwards": stats.target_forwards,
            "plain_steps": stats.plain_steps, "peak_rss_mb": peak_rss_mb(), "accept_counts": list(stats.accept_counts),
            **stats.bench_fields()}  # a sharded target's collectives


def _timed(tokens) -> dict:
    """Drain a token stream: count, end-to-end tok/s, time to first token, decode tok/s after it."""
    t0 = time.perf_counter()
    first, n = None, 0
    for _ in tokens:
        n += 1
        first = first or time.perf_counter()
    end = time.perf_counter()
    return {"tokens": n, "tokens_per_second": n / (end - t0), "time_to_first_token": (first or t0) - t0,
            "decode_tokens_per_second": (n - 1) / (end - first) if first and n > 1 else 0.0}


SAMPLING = {"top_k": 40, "top_p": 0.95, "min_p": 0.05}  # the anchors' sampling settings (used when T > 0)


def _anchor_runs(model_path: Path, threads: int, n_ctx: int) -> dict[str, Callable]:
    """Raw llama-cpp-python: create_completion, and with its LlamaPromptLookupDecoding."""
    import llama_cpp
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    from ondevice.backends.llama_ext import guard_amx

    guard_amx()  # the anchors run as a user's llama-cpp-python would, short of a crash on AMX (llama_ext.amx_off)

    kw = dict(n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, n_batch=512, verbose=False)
    raw = llama_cpp.Llama(str(model_path), **kw)
    lookup = llama_cpp.Llama(str(model_path), draft_model=LlamaPromptLookupDecoding(num_pred_tokens=10), **kw)

    def run(llm):
        def go(ids: list[int], max_tokens: int, temperature: float) -> dict:
            llm.reset()
            return _timed(llm.create_completion(ids, max_tokens=max_tokens, temperature=temperature, repeat_penalty=1.0,
                                                seed=0, stream=True, **SAMPLING))

        return go

    return {"llama_cpp_create_completion": run(raw), "llama_cpp_prompt_lookup": run(lookup)}


def _mlx_anchor_runs(model_path: Path, draft_path: Path | None, num_draft: int) -> dict[str, Callable]:
    """mlx-lm's own ``stream_generate`` on the same MLX directories, without and with ``draft_model``."""
    from mlx_lm import load as mlx_load
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    from ondevice.backends.mlx import pick_device

    pick_device(None)
    no_code = {"trust_remote_code": False}  # never run a model folder's auto_map code (#41)
    model, tokenizer = mlx_load(str(model_path), tokenizer_config=no_code)
    draft = mlx_load(str(draft_path), tokenizer_config=no_code)[0] if draft_path else None

    def run(draft_model):
        def go(ids: list[int], max_tokens: int, temperature: float) -> dict:
            kw = {"draft_model": draft_model, "num_draft_tokens": num_draft} if draft_model is not None else {}
            sampler = make_sampler(temp=temperature, **SAMPLING)
            return _timed(stream_generate(model, tokenizer, ids, max_tokens=max_tokens, sampler=sampler, **kw))

        return go

    runs = {"mlx_lm_stream_generate": run(None)}
    if draft is not None:
        runs[f"mlx_lm_stream_generate_draft_g{num_draft}"] = run(draft)
    return runs


def run_bench(
    model: str,
    draft: str | None = None,
    *,
    ngram: bool = False,
    classes=CLASSES,
    max_tokens: int = 64,
    repeats: int = 3,
    gamma: str = "4",
    anchors: bool = False,
    per_class: int | None = None,
    temperature: float = 0.0,
    threads: int | None = None,
    n_ctx: int = 4096,
    prompts_dir: Path = PROMPTS_DIR,
    progress: Callable[[dict], None] | None = None,
) -> dict:
    """Benchmark plain decoding against speculative modes (and anchors) on the prompt suite.

    Args:
        model, draft: target and optional draft (paths or catalog names).
        ngram: add n-gram drafting modes.
        gamma: "N" (one fixed γ), "sweep" (1, 2, 4, 8) or "auto" (the adaptive policy).
        anchors: also run the libraries themselves on the same prompts: raw llama-cpp-python (plain and
            prompt lookup) for a GGUF target, mlx-lm's ``stream_generate`` (plain, and with ``draft_model``
            at the first fixed γ, else mlx-lm's default 2) for an MLX target.
        per_class: use only the first N prompts of each class.
    Returns:
        The JSON document described in the README (machine, runs, costs, summary).
    """
    from ondevice.loader import load

    threads = threads or default_threads()
    gammas = _gammas(gamma)
    prompts = load_prompts(classes, prompts_dir, per_class)
    runtimes = {"plain": load(model, drafter="none", threads=threads, n_ctx=n_ctx)}
    for d in [x.strip() for x in str(draft or "").split(",") if x.strip()]:  # e.g. "heads,qwen2.5-coder-0.5b-instruct"
        rt = load(model, d, threads=threads, n_ctx=n_ctx)
        is_model = rt.drafter is not None and rt.drafter.traits.model  # a draft model; else the kind's name (heads)
        kind = rt.drafter.name if not is_model else "draft" if "draft" not in runtimes else f"draft{len(runtimes)}"
        runtimes[kind] = rt
    if ngram:
        runtimes["ngram"] = load(model, drafter="ngram", threads=threads, n_ctx=n_ctx)
    plain = runtimes["plain"]
    drafted = runtimes.get("draft")
    # the curve the runtimes' cost-aware policy uses (one probe, cached per model files, threads and device:
    # read back when an earlier run measured it); probed once, not again while a loaded machine makes it noisy
    costs = cached_measure(plain.target, drafted.drafter.backend if drafted else None, attempts=1)
    # each drafter kind without a draft model (heads, mtp, eagle3, dflash): its measured seconds per drafted
    # token ÷ one target decode, charged in its bound (a draft model's ratio is in ``costs``)
    kind_costs = {}
    for kind, rt in runtimes.items():
        if kind != "plain" and not kind.startswith("draft") and rt.drafter is not None:
            spt = rt.drafter.seconds_per_token()
            if spt is not None:
                kind_costs[kind] = spt / costs.target_seconds[1]
    for rt in runtimes.values():
        rt.reset()
    modes: list[tuple[str, object, object]] = [("plain", plain, 0)]
    for kind in runtimes:
        if kind != "plain":
            modes += [(f"{kind}_{'auto' if g == 'auto' else f'g{g}'}", runtimes[kind], g) for g in gammas]
    anchor_fns = {}
    if anchors:
        from ondevice.backends import detect_format

        fmt = detect_format(plain.target.path)
        if fmt == "gguf":
            anchor_fns = _anchor_runs(plain.target.path, threads, n_ctx)
        elif fmt == "mlx":
            mlx_draft = drafted.drafter.backend.path if drafted and detect_format(drafted.drafter.backend.path) == "mlx" else None
            anchor_fns = _mlx_anchor_runs(plain.target.path, mlx_draft, next((g for g in gammas if g != "auto"), 2))
        else:
            raise OndeviceError(f"{model}: --anchors needs a GGUF (llama-cpp-python) or MLX (mlx-lm) target")
    runs = []
    t_start = time.perf_counter()
    for p in prompts:
        ids = _render(plain, p["prompt"])
        for rep in range(repeats):
            for name, rt, g in modes:
                rt.reset()
                res = rt.generate(ids, GenerateRequest.of(max_tokens=max_tokens, temperature=temperature, seed=rep, gamma=g))
                runs.append(_record(name, p, rep, g, res.stats))
                if name == "plain":
                    plain_tokens = res.tokens
                elif temperature == 0:
                    runs[-1]["same_as_plain"] = res.tokens == plain_tokens  # greedy: token for token
                    if res.tokens != plain_tokens:  # a near tie flipped by batch rounding, or a bug
                        runs[-1]["divergence"] = explain(rt.target, ids, plain_tokens, res.tokens)
                if name != "plain" and temperature == 0:  # the answer is a fact: replayable offline
                    runs[-1].update(oracle_speedup(ids, res.tokens, costs), prompt_ids=ids, answer_ids=res.tokens)
                if progress:
                    progress(runs[-1])
            for name, fn in anchor_fns.items():
                r = fn(ids, max_tokens, temperature)
                runs.append({"mode": name, "class": p["class"], "prompt_id": p["id"], "repeat": rep, "gamma": None,
                             "acceptance_rate": None, "mean_accepted_per_forward": None, "peak_rss_mb": peak_rss_mb(), **r})
                if progress:
                    progress(runs[-1])
    for rt in runtimes.values():
        rt.close()
    return {
        "schema_version": SCHEMA_VERSION,
        "machine": machine(),
        "config": {"model": str(model), "draft": draft, "ngram": ngram, "classes": list(classes), "max_tokens": max_tokens,
                   "repeats": repeats, "gamma": gamma, "temperature": temperature, "threads": threads,
                   "seconds": time.perf_counter() - t_start},
        "runs": runs,
        "costs": {**costs.to_json(), "heads_cost_ratio": kind_costs.get("heads"), "drafter_cost_ratios": kind_costs},
        "summary": summarize(runs, costs, kind_costs),
    }


def _gammas(gamma: str) -> list:
    """'sweep' → 1, 2, 4, 8 and auto; otherwise a comma list of numbers and/or 'auto'."""
    if gamma == "sweep":
        return [1, 2, 4, 8, "auto"]
    out = []
    for part in str(gamma).split(","):
        g = gamma_value(part.strip())
        if g == 0:
            raise OndeviceError(f"--gamma {gamma}: speculative modes need gamma >= 1 (plain runs anyway)")
        out.append(g)
    return out


def summarize(runs: list[dict], costs: Costs, kind_costs: dict[str, float] | None = None) -> list[dict]:
    """Median tok/s per (mode, class), speedup vs plain on the same prompts, and the cost-model bound.

    ``kind_costs``: a drafter kind's seconds per drafted token ÷ one target decode, by kind; a draft model's ratio comes from ``costs``, a kind without one (n-gram) drafts for free.

    ``speedup_vs_plain`` is end to end (prompt included); ``decode_speedup_vs_plain`` counts only the
    tokens after the first, which is what the bound (a decode-phase model) predicts. ``tau`` is tokens per
    target pass (hardware-free), ``acceptance_by_position[i]`` the share of drafting passes that kept
    at least i + 1 drafts; ``oracle_speedup`` (greedy) is a perfect drafter's bound on the same answers.
    """
    kind_costs = kind_costs or {}
    out = []
    classes = list(dict.fromkeys(r["class"] for r in runs))
    modes = list(dict.fromkeys(r["mode"] for r in runs))
    for cls in classes:
        plain = {(r["prompt_id"], r["repeat"]): r["tokens_per_second"] for r in runs if r["mode"] == "plain" and r["class"] == cls}
        plain_dec = {(r["prompt_id"], r["repeat"]): r["decode_tokens_per_second"] for r in runs
                     if r["mode"] == "plain" and r["class"] == cls}
        for mode in modes:
            rs = [r for r in runs if r["mode"] == mode and r["class"] == cls]
            if not rs:
                continue
            kind = mode.rsplit("_", 1)[0]  # "eagle3_g4" → "eagle3"
            tps = [r["tokens_per_second"] for r in rs]
            ratios = [r["tokens_per_second"] / plain[(r["prompt_id"], r["repeat"])] for r in rs
                      if plain.get((r["prompt_id"], r["repeat"]))]
            dec = [r["decode_tokens_per_second"] / plain_dec[(r["prompt_id"], r["repeat"])] for r in rs
                   if plain_dec.get((r["prompt_id"], r["repeat"])) and r.get("decode_tokens_per_second")]
            row = {"mode": mode, "class": cls, "median_tokens_per_second": statistics.median(tps),
                   "min_tokens_per_second": min(tps), "max_tokens_per_second": max(tps),
                   "speedup_vs_plain": statistics.median(ratios) if ratios else None,
                   "decode_speedup_vs_plain": statistics.median(dec) if dec else None, "bound": None,
                   "acceptance_rate": None}
            fw = sum(r.get("target_forwards") or 0 for r in rs)
            row["tau"] = sum(r["tokens"] for r in rs) / fw if fw else None
            counts = [sum(x) for x in zip(*[r["accept_counts"] + [0] * (64 - len(r["accept_counts"])) for r in rs
                                            if r.get("accept_counts")], strict=False)]
            if counts:
                counts[0] -= sum(r.get("plain_steps") or 0 for r in rs)  # accept_counts[0] holds plain steps too
            drafting = sum(counts)
            if drafting > 0:
                row["acceptance_by_position"] = [round(sum(counts[i:]) / drafting, 4) for i in range(1, len(counts))
                                                 if sum(counts[i:])][:8]
            oracle = [r["oracle_speedup"] for r in rs if r.get("oracle_speedup")]
            if oracle:
                row["oracle_speedup"] = statistics.median(oracle)
                row["realized_over_oracle"] = row["decode_speedup_vs_plain"] / row["oracle_speedup"] if dec else None
            if any("same_as_plain" in r for r in rs):
                row["same_as_plain"] = all(r.get("same_as_plain", True) for r in rs)
                row["unexplained_divergences"] = sum(not r["divergence"]["explained"] for r in rs if "divergence" in r)
            forwards = sum(r.get("target_forwards") or 0 for r in rs)
            if forwards:
                row["plain_steps_share"] = sum(r["plain_steps"] for r in rs) / forwards
            g = rs[0].get("gamma")
            if isinstance(g, int) and g > 0:
                alpha = statistics.fmean(r["acceptance_rate"] for r in rs)
                c = costs.draft_cost_ratio if mode.startswith("draft") else kind_costs.get(kind, 0.0)
                row["acceptance_rate"] = alpha
                row["draft_cost_ratio"] = c
                row["bound"] = speedup_bound(alpha, g, c, costs.verify_cost(g + 1))
            elif mode.endswith("auto"):
                row["acceptance_rate"] = statistics.fmean(r["acceptance_rate"] for r in rs)
            out.append(row)
    return out


# The documented JSON schema (checked by the test suite).
SCHEMA = {
    "type": "object",
    "required": ["machine", "runs", "costs", "summary"],
    "properties": {
        "machine": {"type": "object", "required": ["platform", "cpus"]},
        "runs": {"type": "array", "items": {"type": "object", "required": [
            "mode", "class", "prompt_id", "repeat", "tokens", "tokens_per_second", "decode_tokens_per_second",
            "time_to_first_token", "acceptance_rate", "mean_accepted_per_forward", "peak_rss_mb"],
            "properties": {"tokens": {"type": "integer", "minimum": 0}, "tokens_per_second": {"type": "number", "minimum": 0},
                           "acceptance_rate": {"type": ["number", "null"], "minimum": 0, "maximum": 1}}}},
        "costs": {"type": "object", "required": ["draft_cost_ratio", "verify_cost"],
                  "properties": {"verify_cost": {"type": "object", "additionalProperties": {"type": "number"}}}},
        "summary": {"type": "array", "items": {"type": "object", "required": [
            "mode", "class", "median_tokens_per_second", "speedup_vs_plain", "bound"]}},
    },
}
