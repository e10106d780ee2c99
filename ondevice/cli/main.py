"""The ``ondevice`` command: generate, chat, serve, check-pair, info, launch (this module), and the commands
of ``ondevice.cli.models`` and ``ondevice.cli.bench``, all registered on ``ondevice.cli.app.app``."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from ondevice.cli import bench, models  # noqa: F401  (their commands register on the app)
from ondevice.cli.app import (
    CacheTypeKOpt,
    CacheTypeVOpt,
    CtxOpt,
    DeviceOpt,
    DraftDeviceOpt,
    DraftOpt,
    MmprojOpt,
    NgramOpt,
    NoSpecOpt,
    PromptCacheOpt,
    PromptCacheSizeOpt,
    ThreadsOpt,
    _csv,
    _drafter,
    _dump,
    _fail,
    app,
    command,
    request_options,
)
from ondevice.params import DEFAULT_N_CTX, DEFAULT_PROMPT_CACHE_SIZE, GenerateRequest


def _prompt_text(prompt: str | None) -> str:
    """``-p TEXT`` as given; ``-p -`` or no ``-p`` with piped stdin: stdin (UTF-8, read before the model loads)."""
    from ondevice.errors import OndeviceError

    if prompt is not None and prompt != "-":
        return prompt
    if prompt is None and sys.stdin.isatty():
        raise OndeviceError("no prompt: pass -p TEXT, or pipe it (echo TEXT | ondevice generate MODEL)")
    data = sys.stdin.buffer.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise OndeviceError(f"stdin is not valid UTF-8 ({e.reason} at byte {e.start}); send UTF-8 text") from None


@command("generate")
@request_options
def generate_cmd(
    model: Annotated[str, typer.Argument(help="Target model: path or catalog name.")],
    prompt: Annotated[str | None, typer.Option("--prompt", "-p", help="Prompt text; - or none with piped stdin: "
                                               "read the prompt from stdin.")] = None,
    draft: DraftOpt = None,
    ngram: NgramOpt = False,
    no_spec: NoSpecOpt = False,
    n_ctx: CtxOpt = DEFAULT_N_CTX,
    threads: ThreadsOpt = None,
    device: DeviceOpt = None,
    draft_device: DraftDeviceOpt = None,
    cache_type_k: CacheTypeKOpt = "f16",
    cache_type_v: CacheTypeVOpt = "f16",
    prompt_cache: PromptCacheOpt = None,
    prompt_cache_size: PromptCacheSizeOpt = DEFAULT_PROMPT_CACHE_SIZE,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object: text, tokens, stats.")] = False,
    request: GenerateRequest | None = None,
) -> None:
    """Generate a completion, speculatively when a draft or n-gram drafter is given."""
    import dataclasses

    from ondevice.loader import load

    prompt = _prompt_text(prompt)

    with load(model, draft, drafter=_drafter(draft, ngram, no_spec), n_ctx=n_ctx, threads=threads, device=device,
              draft_device=draft_device, cache_type_k=cache_type_k, cache_type_v=cache_type_v,
              prompt_cache=prompt_cache, prompt_cache_size=prompt_cache_size) as rt:
        if json_out:
            res = rt.generate(prompt, request)
            doc = {"text": res.text, "tokens": res.tokens, "stats": dataclasses.asdict(res.stats)}
            return _dump({**doc, "draft_choice": rt.draft_choice} if rt.draft_choice else doc)
        if rt.draft_choice:
            typer.echo(f"draft: {rt.draft_choice['reason']}", err=True)
        from ondevice.cli.repl import context_note, visible

        stream = rt.stream(prompt, request)
        for chunk in stream:
            sys.stdout.write(visible(chunk.text))  # the model's text: no terminal escape sequences
            sys.stdout.flush()
        sys.stdout.write("\n")

        if note := context_note(stream.stats, rt.n_ctx):
            typer.echo(note, err=True)


ReasoningBudgetOpt = Annotated[int | None, typer.Option("--reasoning-budget", min=0, help="A thinking model thinks at "
                                                        "most N tokens, then the end of thinking is forced and "
                                                        "the answer follows [default: unbounded].")]
DEFAULT_CHAT_MODEL = "qwen2.5-coder-0.5b-instruct"  # chosen by pass rate, speed and size: docs/quality.md


@command("chat")
@request_options
def chat_cmd(
    model: Annotated[str, typer.Argument(help="Model: path or catalog name.")] = DEFAULT_CHAT_MODEL,
    draft: DraftOpt = None,
    ngram: NgramOpt = False,
    no_spec: NoSpecOpt = False,
    system: Annotated[str | None, typer.Option("--system", help="System prompt.")] = None,
    n_ctx: CtxOpt = DEFAULT_N_CTX,
    threads: ThreadsOpt = None,
    device: DeviceOpt = None,
    draft_device: DraftDeviceOpt = None,
    cache_type_k: CacheTypeKOpt = "f16",
    cache_type_v: CacheTypeVOpt = "f16",
    prompt_cache: PromptCacheOpt = None,
    prompt_cache_size: PromptCacheSizeOpt = DEFAULT_PROMPT_CACHE_SIZE,
    mmproj: MmprojOpt = None,
    image: Annotated[list[str] | None, typer.Option("--image", metavar="FILE", help="An image (PNG, JPEG, GIF, BMP) "
                                                    "for the first message (repeatable; the model needs its mmproj).")] = None,
    show_draft: Annotated[bool, typer.Option("--show-draft", help="Colour tokens that came from the draft.")] = False,
    stats: Annotated[bool, typer.Option("--stats", help="Print tok/s and acceptance after each answer.")] = False,
    think: Annotated[bool | None, typer.Option("--think/--no-think", help="A thinking model thinks or not (the template's enable_thinking; /think on|off in the chat) [default: the template's].")] = None,
    reasoning_budget: ReasoningBudgetOpt = None,
    request: GenerateRequest | None = None,
) -> None:
    """Chat in the terminal (streaming). With no arguments: Qwen2.5-Coder-0.5B-Instruct with n-gram drafting. Piped stdin: one turn per line."""
    from ondevice.cli.repl import run_chat
    from ondevice.loader import load

    drafter = _drafter(draft, ngram, no_spec)
    request = _with_budget(request, reasoning_budget)
    with load(model, draft, drafter=drafter, n_ctx=n_ctx, threads=threads, device=device, draft_device=draft_device,
              cache_type_k=cache_type_k, cache_type_v=cache_type_v, prompt_cache=prompt_cache,
              prompt_cache_size=prompt_cache_size, mmproj=mmproj) as rt:
        _check_budget(rt, reasoning_budget)
        name = rt.drafter.name if rt.drafter else "none"
        if rt.draft_choice:  # --draft auto: say what was chosen and why
            name += f" (auto: {rt.draft_choice['draft'] or 'ngram'})"
            if stats:
                typer.echo(f"draft: {rt.draft_choice['reason']}", err=True)
        code = run_chat(rt, system=system, show_draft=show_draft, show_stats=stats, request=request,
                        title=f"ondevice chat · {model} · drafter {name}", think=think, images=image)
    if code:
        raise typer.Exit(code)


@command("serve")
def serve_cmd(
    model: Annotated[list[str] | None, typer.Argument(metavar="MODEL", help="Models to serve (paths, catalog or store names), each under "
                                                       "its name; loaded on first use [default: "
                                                       f"{DEFAULT_CHAT_MODEL}].")] = None,
    draft: DraftOpt = None,
    ngram: NgramOpt = False,
    no_spec: NoSpecOpt = False,
    host: Annotated[str, typer.Option("--host", help="Address to bind; anything but loopback is reachable by others.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=0, max=65535, help="TCP port.")] = 8080,
    api_key: Annotated[str | None, typer.Option("--api-key", envvar="ONDEVICE_API_KEY", help="Require 'Authorization: Bearer KEY' (or 'x-api-key: KEY') on /v1 (needed off loopback).")] = None,
    no_auth: Annotated[bool, typer.Option("--no-auth", help="Serve off loopback without --api-key (any web page a browser on the network opens could drive the API).")] = False,
    allowed_host: Annotated[list[str] | None, typer.Option("--allowed-host", help="Also answer requests whose Host header is NAME (repeatable; against DNS rebinding only loopback names, IP addresses and --host are answered).")] = None,
    n_ctx: CtxOpt = DEFAULT_N_CTX,
    max_queue: Annotated[int, typer.Option("--max-queue", min=0, help="Requests that may wait per model behind its running one (more get 503).")] = 16,
    max_loaded: Annotated[int, typer.Option("--max-loaded", min=1, help="Models loaded at once at most (the least recently used idle one is unloaded to make room).")] = 3,
    keep_alive: Annotated[float, typer.Option("--keep-alive", help="Seconds an idle model stays loaded (negative: until exit; a request's keep_alive overrides it).")] = 300.0,
    cors_origin: Annotated[list[str] | None, typer.Option("--cors-origin", help="Allow browser calls from this origin (repeatable; '*' = any).")] = None,
    read_timeout: Annotated[float | None, typer.Option("--read-timeout", min=0.1, help="Seconds a client may take to send a request (head, then body) [default: 30].")] = None,
    max_connections: Annotated[int | None, typer.Option("--max-connections", min=1, help="Open connections at most; more get 503 [default: max(64, max-queue + 16)].")] = None,
    threads: ThreadsOpt = None,
    device: DeviceOpt = None,
    reasoning_budget: ReasoningBudgetOpt = None,
    parallel: Annotated[str, typer.Option("--parallel", metavar="N|auto", help="Requests of one model decoded together in one llama.cpp batch (each slot gets --n-ctx; GGUF models only; slots decode without speculation); auto: the slots this machine's measured batch curve says pay (docs/parallel.md).")] = "1",
    cache_type_k: CacheTypeKOpt = "f16",
    cache_type_v: CacheTypeVOpt = "f16",
    prompt_cache: PromptCacheOpt = None,
    prompt_cache_size: PromptCacheSizeOpt = DEFAULT_PROMPT_CACHE_SIZE,
    mmproj: MmprojOpt = None,
) -> None:
    """Serve the OpenAI and Anthropic APIs (/v1/chat/completions, /v1/completions, /v1/responses, /v1/messages, /v1/embeddings, /v1/models) and a chat page at /."""
    from functools import partial

    from ondevice.batch_load import parallel_option
    from ondevice.drafters import registry
    from ondevice.errors import OndeviceError
    from ondevice.loader import load
    from ondevice.server.models import Models, keep_alive_seconds
    from ondevice.server.run import check_exposure, open_socket, serve

    par = parallel_option(parallel, "--parallel")  # N or "auto"; a bad value fails here, in one line
    names = model or [DEFAULT_CHAT_MODEL]
    if len(names) > 1 and draft not in (None, "auto") and not registry.per_target(draft):
        raise OndeviceError(f"--draft {draft} is one model's draft; with several models use --draft auto (each "
                            "model chooses its own) or heads")
    check_exposure(host, api_key, no_auth)  # before anything listens
    sock = open_socket(host, port)  # fail fast on a busy port, before the model loads
    specs = [(Path(m).name.removesuffix(".gguf") if Path(m).exists() else m, m) for m in names]
    if len(names) > 1 and mmproj is not None:
        raise OndeviceError("--mmproj is one model's projector; with several models keep each one's beside it")
    loader = partial(_budgeted, reasoning_budget, partial(load, draft=draft, drafter=_drafter(draft, ngram, no_spec),
                                                         n_ctx=n_ctx, threads=threads, device=device,
                                                         cache_type_k=cache_type_k, cache_type_v=cache_type_v,
                                                         prompt_cache=prompt_cache,
                                                         prompt_cache_size=prompt_cache_size, mmproj=mmproj,
                                                         **({"parallel": par} if par != 1 else {})))
    served = Models(specs, loader, max_loaded=max_loaded, keep_alive=keep_alive_seconds(keep_alive, "--keep-alive"),
                    max_queue=max_queue)
    served.adopt(specs[0][0], loader(names[0]))  # the first model loads now: a bad one fails at once
    try:
        serve(served, host=host, port=port, api_key=api_key, no_auth=no_auth, allowed_hosts=allowed_host or [],
              max_queue=max_queue, cors_origins=cors_origin, read_seconds=read_timeout,
              max_connections=max_connections, sock=sock)
    finally:
        served.close_all()


def _with_budget(request: GenerateRequest, budget: int | None) -> GenerateRequest:
    import dataclasses

    return request if budget is None else dataclasses.replace(request, reasoning_budget=budget)


def _check_budget(rt, budget: int | None) -> None:
    """--reasoning-budget on a model whose template does not think: one line, before the chat starts."""
    from ondevice.errors import OndeviceError
    from ondevice.reasoning import detect

    if budget is not None and detect(rt.target.chat_template) is None:
        raise OndeviceError(f"--reasoning-budget: {rt.target.path} has no thinking convention in its chat "
                            "template; drop the option for this model")


def _budgeted(budget: int | None, load, name: str):
    """A served model with the server's default thinking budget (``Runtime.reasoning_budget``)."""
    rt = load(name)
    rt.reasoning_budget = budget
    return rt


@command("check-pair")
def check_pair_cmd(
    target: Annotated[str, typer.Argument(help="Target model (path or catalog name).")],
    draft: Annotated[str | None, typer.Argument(help="Draft model; omit it to list the local candidate drafts.")] = None,
) -> None:
    """Check that a draft can verify against a target: same token text for every shared id."""
    from ondevice.formats.pairs import check_vocabs
    from ondevice.store import lookup
    from ondevice.store.discovery import tokens

    if draft is None:
        from ondevice.cli.local import show_candidates

        return show_candidates(target)
    t, d = lookup.resolve(target), lookup.resolve(draft)
    n = check_vocabs(tokens(t), tokens(d), t, d)
    typer.echo(f"compatible: {n} shared token ids ({t} + {d})")


@command("info")
def info_cmd(
    model: Annotated[str, typer.Argument(help="Model path or catalog name.")],
    device: Annotated[str | None, typer.Option("--device", help="MLX device: gpu | cpu.")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Show a model's format, architecture, quantization, vocabulary and device."""
    from ondevice.store.info import describe

    info = describe(model, device)
    if info["format"] in ("gguf", "mlx"):  # the formats heads are trained for
        from ondevice.heads import eagle_store

        path = Path(info["path"])
        info["heads"] = eagle_store.stored(path / "model.gguf" if path.is_dir() and info["format"] == "gguf" else path)
    if info["format"] == "gguf":  # a model's own MTP heads (draft="mtp")
        from ondevice.backends.llama_mtp import file_mtp_layers

        path = Path(info["path"])
        n = file_mtp_layers(path / "model.gguf" if path.is_dir() else path)
        info["mtp_layers"] = n if json_out else f"{n} (--draft mtp)" if n else "none"
    if json_out:
        return _dump(info)
    if info.get("heads"):
        from ondevice.heads.eagle_store import describe

        info["heads"] = info["heads"]["error"] if "error" in info["heads"] else describe(info["heads"])
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
    from ondevice.distributed.tools import launch
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
