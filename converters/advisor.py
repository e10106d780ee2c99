"""``ondevice bench MODEL --formats q4_k_m,q4_0,iq4_nl``: the quant advisor.

On a CPU the weight format decides whether verification is cheap: llama.cpp repacks Q4_0 and IQ4_NL
into interleaved layouts with batched GEMM kernels, while K-quants, Q4_1 and Q5_0 run the rows of a
batch through vec-dot. So the advisor requantizes the model into each format (into a temp dir, or
reusing a local ``pull --quant`` variant) and measures, side by side in one run. A format may name the
output projection's / token embedding's tensor type as ``pull`` does (``iq4_nl+out-iq4_nl``,
``variants.variant_tag``): llama.cpp gives the output Q6_K otherwise, a vec-dot type. It measures:
decode and prefill tok/s and the verify curve (interleaved rounds, medians), quality against the most
precise source available (teacher-forced top-1 agreement and mean KL on held-back text), and the
speculative speedup each yields on grounded edits (n-gram ``auto``; with a draft, the pair) next to
the n-gram oracle, and the pass rate on the task set of ``ondevice.quality`` (does it still answer right).
It recommends the format with the most effective tok/s on grounded edits (decode
tok/s × n-gram speedup) among those within the quality budget, and says why.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from ondevice.errors import OndeviceError

# Quality budget: within this much top-1 agreement, and this much mean KL (nats), of the most faithful format.
TOP1_SLACK = 0.03
KL_SLACK = 0.1
FORMATS = ("q8_0", "q4_0", "iq4_nl", "q4_k_m", "q4_1", "q5_0")  # what --formats takes (types: quantize.MAIN_TYPE)


def parse_formats(formats: list[str]) -> dict[str, tuple[str, str | None, str | None]]:
    """``--formats`` items → (format, output type, embedding type), keyed by the variant name as ``pull``
    spells it (``iq4_nl+out-iq4_nl``). Raises one line on an unknown format or tensor type."""
    from converters.quant_types import FTYPES, check_tensor_types
    from ondevice.store import variants

    if not formats:
        raise OndeviceError(f"--formats: choose from {', '.join(FORMATS)} (a type for the output tensor: FMT+out-TYPE)")
    out = {}
    for item in formats:
        fmt, otype, etype = variants.parse_variant_tag(item)
        if fmt not in FORMATS:
            raise OndeviceError(f"--formats {item}: choose from {', '.join(FORMATS)} (a type for the output tensor: "
                                "FMT+out-TYPE)")
        if (otype or etype) and fmt not in FTYPES:
            raise OndeviceError(f"--formats {item}: {fmt} is only read as published; llama.cpp's quantizer writes "
                                f"{', '.join(q for q in FTYPES if q != 'f16')}")
        otype, etype = check_tensor_types(fmt, otype, etype)
        out[variants.variant_tag(fmt, otype, etype)] = (fmt, otype, etype)
    return out


def recommend(rows: list[dict]) -> tuple[str, str]:
    """The format to use and why: most effective tok/s on grounded edits within the quality budget.

    Args:
        rows: one per format with ``format``, ``decode_tokens_per_second``, ``edit_speedup`` (n-gram auto
            on grounded edits, × plain decode), ``top1_agreement`` and ``mean_kl``; ``is_reference`` marks
            the file quality was measured against (it is within budget, but does not set it).
    Returns:
        (format, one-paragraph reason).
    """
    # The reference itself scores a trivial 100 % / 0 nats: when it is one of the candidates (no more precise
    # file was given), the budget is set by the best *measured* format, or requantizing could never win.
    judged = [r for r in rows if not r.get("is_reference")] or rows
    best_top1 = max(r["top1_agreement"] for r in judged)
    best_kl = min(r["mean_kl"] for r in judged)
    ok = [r for r in rows if r["top1_agreement"] >= best_top1 - TOP1_SLACK and r["mean_kl"] <= best_kl + KL_SLACK]
    out = [r for r in rows if r not in ok]

    def effective(r: dict) -> float:
        return r["decode_tokens_per_second"] * (r.get("edit_speedup") or 1.0)

    pick = max(ok, key=effective)
    why = (f"{pick['format']}: {effective(pick):.1f} effective tok/s on grounded edits "
           f"({pick['decode_tokens_per_second']:.1f} plain decode tok/s × {pick.get('edit_speedup') or 1.0:.2f} n-gram "
           f"speedup), quality within budget (top-1 agreement {pick['top1_agreement']:.1%}, mean KL "
           f"{pick['mean_kl']:.3f}; the best format has {best_top1:.1%} / {best_kl:.3f})")
    others = [r for r in ok if r is not pick]
    if others:
        why += "; others within budget: " + ", ".join(f"{r['format']} {effective(r):.1f}" for r in others)
    if out:
        why += "; outside the quality budget: " + ", ".join(
            f"{r['format']} (top-1 {r['top1_agreement']:.1%}, KL {r['mean_kl']:.3f})" for r in out)
    return pick["format"], why


def _prefill_seconds(backend, n: int = 128) -> float:
    ids = [(i * 7919) % max(backend.vocab_size - 1, 1) + 1 for i in range(n)]
    backend.rollback(0)
    t0 = time.perf_counter()
    backend.eval(ids, logits="last")
    dt = time.perf_counter() - t0
    backend.rollback(0)
    return dt


def _files(src: Path, name: str | None, formats: dict[str, tuple], tmp: Path, progress: Callable[[str], None]) -> dict:
    """variant name → (GGUF path, how it was made): the source itself, a cached local variant, or a fresh
    requantization (``formats``: ``parse_formats``)."""
    from converters.quant_types import MAIN_TYPE, precision
    from converters.quantize import requantize_file
    from ondevice.store import catalog, variants

    prec = precision(src)
    main = max(prec["types"], key=prec["types"].get)
    out = {}
    for tag, (fmt, otype, etype) in formats.items():
        if MAIN_TYPE[fmt] == main and not (otype or etype):
            out[tag] = (src, "source")
            continue
        if name is not None:
            entry = catalog.get(name)
            if variants.variant_record(entry, tag) is not None:
                out[tag] = (variants.variant_path(entry, tag), "cached local variant")
                continue
        progress(f"requantizing {src.name} → {tag}")
        dst = tmp / f"{tag}.gguf"
        requantize_file(src, dst, fmt, allow_requantize=True, measure=False, output_type=otype, embedding_type=etype)
        out[tag] = (dst, "requantized into a temp dir")
    return out


def advise(model: str, formats: list[str], *, draft: str | None = None, reference: str | None = None,
           classes=("edit",), per_class: int | None = 2, repeats: int = 1, max_tokens: int = 96, rounds: int = 3,
           threads: int | None = None, progress: Callable[[str], None] | None = None,
           tasks_per_class: int | None = None, unsafe_no_sandbox: bool = False) -> dict:
    """Measure ``model`` requantized into each of ``formats``, side by side; recommend one.

    Args:
        model: a GGUF path or catalog name (the source of every requantization).
        formats: e.g. ["q4_k_m", "q4_0", "iq4_nl", "iq4_nl+out-iq4_nl"]; the source's own format is measured
            as published; ``+out-TYPE`` / ``+emb-TYPE`` set the output / token embedding tensor type.
        draft: also measure the model-draft pair with this draft (as given).
        reference: judge quality against this GGUF (default: the source). Judge 4-bit formats against a
            clearly more precise file where one exists; against the source, the numbers are the cost of
            requantizing, not the distance from the float model.
        classes, per_class, repeats, max_tokens: the speculative runs (``run_bench``).
        rounds: interleaved rounds of the cost measurement (medians are reported).
        tasks_per_class: the task eval (``ondevice.quality``: pass rate next to top-1 / KL): at most this many
            tasks of each class (None: all; 0: skip it).
        unsafe_no_sandbox: run the task eval's code answers without an OS sandbox where none is available (with
            a warning); by default ``advise`` refuses before any requantization (``sandbox.require``).
    Returns:
        JSON document: per-format rows, the recommendation and why, the settings.
    Raises:
        OndeviceError: bad formats, or no OS sandbox for the task eval (checked first: the eval is the last step,
            after every requantization and measurement).
    """
    from ondevice.backends import open_backend
    from ondevice.bench.run import machine, run_bench
    from ondevice.costs import Costs, measure
    from ondevice.store import catalog, lookup

    say = progress or (lambda s: None)
    parsed = parse_formats(formats)
    if tasks_per_class != 0:
        from ondevice.quality.sandbox import require

        require(unsafe_no_sandbox)
    formats = list(parsed)  # one spelling per variant, as pull names it
    src = lookup.resolve(model)
    name = model if str(model) in catalog.catalog()[0] else None
    ref = lookup.resolve(reference) if reference else src
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ondevice-formats-", dir=catalog.home() if catalog.home().is_dir() else None) as d:
        files = _files(src, name, parsed, Path(d), say)
        timings: dict[str, list] = {f: [] for f in formats}
        for r in range(rounds):  # interleaved: the load of a shared machine falls on every format alike
            for fmt in formats:
                say(f"costs round {r + 1}/{rounds}: {fmt}")
                b = open_backend(files[fmt][0], n_ctx=512, threads=threads)
                try:
                    timings[fmt].append((measure(b, ks=(1, 2, 4, 8, 16), reps=3), _prefill_seconds(b)))
                finally:
                    b.close()
        rows = []
        from converters.quality import quality
        from converters.quant_types import precision

        for fmt in formats:
            path, how = files[fmt]
            costs = Costs({k: statistics.median(c.target_seconds[k] for c, _ in timings[fmt]) for k in (1, 2, 4, 8, 16)})
            prefill = statistics.median(p for _, p in timings[fmt])
            say(f"quality: {fmt} vs {Path(ref).name}")
            is_ref = Path(path).resolve() == Path(ref).resolve()
            q = ({"top1_agreement": 1.0, "mean_kl": 0.0, "max_kl": 0.0, "tokens": 0, "reference": str(ref)}
                 if is_ref else quality(path, ref, threads=threads))
            say(f"speculative runs: {fmt}")
            spec = run_bench(str(path), None, ngram=True, classes=classes, per_class=per_class, repeats=repeats,
                             max_tokens=max_tokens, gamma="auto", threads=threads, n_ctx=2048)
            row = {"format": fmt, "path": str(path), "made": how, "size_bytes": Path(path).stat().st_size,
                   "bits_per_weight": precision(Path(path))["bits_per_weight"],
                   "decode_tokens_per_second": 1.0 / costs.target_seconds[1], "prefill_tokens_per_second": 128 / prefill,
                   "verify_cost": {str(k): round(costs.verify_cost(k), 3) for k in (2, 4, 8, 16)},
                   "top1_agreement": q["top1_agreement"], "mean_kl": q["mean_kl"], "quality": q, "is_reference": is_ref}
            for s in spec["summary"]:
                if s["mode"] == "ngram_auto":
                    row.setdefault("ngram", {})[s["class"]] = {k: s.get(k) for k in (
                        "decode_speedup_vs_plain", "speedup_vs_plain", "oracle_speedup", "realized_over_oracle",
                        "same_as_plain", "plain_steps_share")}
            row["edit_speedup"] = (row.get("ngram", {}).get("edit") or {}).get("decode_speedup_vs_plain")
            if draft:
                say(f"pair runs: {fmt} + {draft}")
                pair = run_bench(str(path), draft, classes=classes, per_class=per_class, repeats=repeats,
                                 max_tokens=max_tokens, gamma="auto", threads=threads, n_ctx=2048)
                row["pair"] = {s["class"]: {k: s.get(k) for k in ("decode_speedup_vs_plain", "speedup_vs_plain",
                                                                  "acceptance_rate", "plain_steps_share", "same_as_plain")}
                               for s in pair["summary"] if s["mode"] == "draft_auto"}
            rows.append(row)
        if tasks_per_class != 0:  # what a user notices: does each format still answer right (side by side)
            from ondevice.quality import evaluate

            say("task eval: every format answers the quality tasks")
            ev = evaluate([files[f][0] for f in formats], per_class=tasks_per_class, threads=threads,
                          unsafe_no_sandbox=unsafe_no_sandbox)
            for row, m in zip(rows, ev["models"], strict=True):
                row["tasks"] = {k: m[k] for k in ("overall", "classes", "decode_tokens_per_second", "wall_seconds")}
                row["pass_rate"] = m["overall"]["pass_rate"]
    pick, why = recommend(rows)
    ref_note = ("quality is measured against the source itself: the numbers are what requantizing costs relative "
                "to it, not the distance from the float model" if ref == src else
                f"quality is measured against {Path(ref).name}, a more precise file of the same model")
    return {"machine": machine(), "config": {"model": str(model), "source": str(src), "formats": formats, "draft": draft,
            "reference": str(ref), "classes": list(classes), "per_class": per_class, "repeats": repeats,
            "max_tokens": max_tokens, "rounds": rounds, "threads": threads, "seconds": time.perf_counter() - t_start},
            "formats": rows, "recommendation": {"format": pick, "why": why, "reference_note": ref_note}}


def table(doc: dict) -> None:
    """Print the advisor's rows and recommendation."""
    from rich.console import Console
    from rich.table import Table

    t = Table("format", "bpw", "decode tok/s", "prefill tok/s", "cost(4)", "cost(8)", "cost(16)", "top-1", "KL",
              "tasks ✓", "n-gram × (edit)", "oracle", "pair ×", title=f"ondevice bench --formats · {Path(doc['config']['source']).name}")
    for r in doc["formats"]:
        ng = (r.get("ngram") or {}).get("edit") or {}
        pair = (r.get("pair") or {}).get("edit") or {}
        f = lambda x, fmt: "" if x is None else format(x, fmt)  # noqa: E731
        t.add_row(r["format"], f(r["bits_per_weight"], ".2f"), f(r["decode_tokens_per_second"], ".1f"),
                  f(r["prefill_tokens_per_second"], ".0f"), *(f(r["verify_cost"][k], ".2f") for k in ("4", "8", "16")),
                  f(r["top1_agreement"], ".1%"), f(r["mean_kl"], ".3f"), _tasks_cell(r.get("tasks")),
                  f(r.get("edit_speedup"), ".2f"),
                  f(ng.get("oracle_speedup"), ".2f"), f(pair.get("decode_speedup_vs_plain"), ".2f"))
    con = Console(stderr=True)
    con.print(t)
    con.print(f"recommended: {doc['recommendation']['why']}\n({doc['recommendation']['reference_note']})")


def _tasks_cell(t: dict | None) -> str:
    """passed/n and the pass rate with its 95 % Wilson interval, or blank when the task eval was skipped."""
    if not t:
        return ""
    o = t["overall"]
    return f"{o['passed']}/{o['n']} {o['pass_rate']:.0%} [{o['ci95'][0]:.0%}–{o['ci95'][1]:.0%}]"


def plot(doc: dict, out_dir: Path) -> Path:
    """speedup_vs_quality.png: effective tok/s on grounded edits against mean KL, one point per format."""
    from ondevice.bench.tools import pyplot

    plt = pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(5, 4))
    for r in doc["formats"]:
        y = r["decode_tokens_per_second"] * (r.get("edit_speedup") or 1.0)
        ax.scatter(r["mean_kl"], y)
        ax.annotate(r["format"], (r["mean_kl"], y), fontsize=8)
    ax.set_xlabel(f"mean KL vs {Path(doc['config']['reference']).name} (nats)")
    ax.set_ylabel("effective tok/s on grounded edits (decode × n-gram speedup)")
    path = out_dir / "speedup_vs_quality.png"
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close("all")
    return path
