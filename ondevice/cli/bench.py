"""``ondevice bench``: plain vs speculative side by side, the quant advisor (``--formats``), synthetic costs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from ondevice.cli.app import DeviceOpt, DraftOpt, NgramOpt, TempOpt, ThreadsOpt, _csv, command
from ondevice.params import DEFAULT_GAMMA


@command("bench")
def bench_cmd(
    model: Annotated[str, typer.Argument(help="Target model: path or catalog name (a pair name sets --draft).")],
    draft: DraftOpt = None,
    ngram: NgramOpt = False,
    classes: Annotated[str, typer.Option("--classes", help="Comma-separated prompt classes.")] = "code,edit,summary,chat",
    max_tokens: Annotated[int, typer.Option("--max-tokens", min=1, help="Tokens per request.")] = 64,
    repeats: Annotated[int | None, typer.Option("--repeats", min=1, help="Repeats per prompt (interleaved) [default: 3; a quick run without --per-class: 2].")] = None,
    gamma: Annotated[str, typer.Option("--gamma", help="auto, N, a list (2,4,auto) or sweep (1,2,4,8,auto).")] = str(DEFAULT_GAMMA),
    anchors: Annotated[bool, typer.Option("--anchors", help="Also run the libraries on the same prompts: llama-cpp-python (GGUF) or mlx-lm stream_generate (MLX).")] = False,
    cold_start: Annotated[bool, typer.Option("--cold-start", help="Measure process start → first token, cold and warm.")] = False,
    synthetic: Annotated[str | None, typer.Option("--synthetic", help="Measure costs on a shape-true random model (e.g. qwen2.5-1.5b) instead.")] = None,
    formats: Annotated[str | None, typer.Option("--formats", help="Quant advisor: requantize MODEL to each (e.g. q4_k_m,q4_0,iq4_nl,iq4_nl+out-iq4_nl), measure speed, verify curve, quality, speedup; recommend one.")] = None,
    reference: Annotated[str | None, typer.Option("--reference", help="--formats: judge quality against this more precise GGUF (default: the source).")] = None,
    per_class: Annotated[int | None, typer.Option("--per-class", min=1, help="Only the first N prompts of each class [default: all; a quick run without --repeats: 2].")] = None,
    temperature: TempOpt = 0.0,
    threads: ThreadsOpt = None,
    device: DeviceOpt = None,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write the JSON document here.")] = None,
    plot: Annotated[Path | None, typer.Option("--plot", help="Write PNG plots into this directory.")] = None,
    link_latency: Annotated[float | None, typer.Option("--link-latency", help="With --synthetic: predict tok/s with the target sharded over --world-size machines on a link of this many ms per collective.")] = None,
    world_size: Annotated[int, typer.Option("--world-size", min=2, help="Machines for --link-latency.")] = 2,
    quality: Annotated[bool, typer.Option("--quality", help="Task eval: MODEL[,MODEL...] answer the shipped tasks (code run in a sandbox, exact-match answers); pass rates side by side.")] = False,
    unsafe_no_sandbox: Annotated[bool, typer.Option("--unsafe-no-sandbox", help="--quality, --formats (its task eval): run model-written code even where no OS sandbox (bubblewrap / sandbox-exec) is available; it can then read and write your files.")] = False,
) -> None:
    """Benchmark plain vs speculative decoding (and anchors) on the prompt suite; JSON + table + plots."""
    from ondevice.bench import run as bench
    from ondevice.bench import tools as bench_tools
    from ondevice.store import lookup

    if quality:  # ondevice.quality: MODEL is a comma-separated list; --per-class / --json / --plot / --threads apply
        from ondevice.quality.report import bench_quality

        return bench_quality(_csv(model), json_path=json_path, plot_dir=plot, per_class=per_class, threads=threads,
                             echo=typer.echo, progress=lambda m: typer.echo(m, err=True),
                             unsafe_no_sandbox=unsafe_no_sandbox)
    if draft is None:
        pair = lookup.resolve_pair(model)
        if pair:
            model, draft = pair
    if synthetic:
        from converters.synthetic import SYNTHETIC, synthetic_costs

        doc = synthetic_costs(synthetic, draft_config=draft, threads=threads, device=device)
        if link_latency is not None:
            from ondevice.distributed.tools import predict_link

            doc["distributed_prediction"] = predict_link(doc["costs"], latency_ms=link_latency, world_size=world_size,
                                                         n_layers=SYNTHETIC[synthetic]["num_hidden_layers"])
    elif formats:
        from converters import advisor

        doc = advisor.advise(model, _csv(formats), draft=draft,
                                   reference=reference, classes=_csv(classes),
                                   per_class=per_class, repeats=repeats or 3, max_tokens=max_tokens, threads=threads,
                                   progress=lambda m: typer.echo(m, err=True), unsafe_no_sandbox=unsafe_no_sandbox)
        if plot:
            doc["plots"] = [str(advisor.plot(doc, plot))]
        if json_path:  # before the table: a display error must not lose a long measurement
            json_path.write_text(json.dumps(doc, indent=2, default=str))
        advisor.table(doc)
    else:
        if per_class is None and repeats is None:  # the quick run (minutes on a loaded laptop)
            per_class, repeats = bench.QUICK_PER_CLASS, bench.QUICK_REPEATS
            typer.echo(f"quick run: {per_class} prompts per class, {repeats} repeats (--per-class N / --repeats R "
                       "for more)", err=True)
        doc = bench.run_bench(model, draft, ngram=ngram, classes=_csv(classes),
                              max_tokens=max_tokens, repeats=repeats or 3, gamma=gamma, anchors=anchors, per_class=per_class,
                              temperature=temperature, threads=threads,
                              progress=lambda r: typer.echo(f"{r['class']:>8} {r['mode']:<28} {r['tokens_per_second']:7.1f} tok/s", err=True))
        if cold_start:
            doc["cold_start"] = bench_tools.cold_start(lookup.resolve(model), threads=threads)
        bench_tools.table(doc)
        if doc["runs"] and "world_size" in doc["runs"][0]:  # a target sharded with mlx.launch
            from ondevice.distributed.tools import bench_summary

            doc["distributed"] = bench_summary(doc)
        if plot:
            doc["plots"] = [str(p) for p in bench_tools.plots(doc, plot)]
    text = json.dumps(doc, indent=2, default=str)
    if json_path:
        json_path.write_text(text)
    else:
        typer.echo(text)
