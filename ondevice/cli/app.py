"""The ``ondevice`` command line's shared machinery: the typer app, one-line errors, and the options several
commands share. Every option mirrors an API parameter with the same name; defaults come from ``ondevice.params``.
Heavy modules (llama_cpp, mlx, coremltools, even numpy) are imported inside the commands, so ``ondevice --help``
stays fast.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import sys
import typing
from typing import Annotated

import typer

from ondevice import __version__
from ondevice.params import DEFAULT_GAMMA, DEFAULT_MAX_TOKENS, DEFAULTS, GenerateRequest

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

    Console(stderr=True, highlight=False, emoji=False).print(f"[bold red]error:[/bold red] {escape(message)}", soft_wrap=True)
    raise typer.Exit(code)


PIPE_WIDTH = 200  # columns for output that is not a terminal (rich's default, 80, cuts table cells to "qwen2.5-…")


def console(stderr: bool = False, **kwargs):
    """A rich ``Console`` for a command's output. A closed pipe (``| head``) raises ``BrokenPipeError``, which
    ``command`` turns into a quiet exit 141 as for plain writes (rich's own handler exits 1, which ``chat``
    uses for a refused turn); output that is not a terminal is ``PIPE_WIDTH`` wide (unless ``COLUMNS`` is set),
    so piped tables keep whole names for grep."""
    from rich.console import Console

    class _Console(Console):
        def on_broken_pipe(self) -> None:
            self.quiet = True
            raise BrokenPipeError

    c = _Console(stderr=stderr, **kwargs)
    if not c.is_terminal and "COLUMNS" not in os.environ:
        c.width = PIPE_WIDTH
    return c


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
ThreadsOpt = Annotated[int | None, typer.Option("--threads", min=1, help="CPU threads (default: the physical cores not busy with other processes at load).")]
CacheTypeKOpt = Annotated[str, typer.Option("--cache-type-k", help="KV-cache type of K: f16 | q8_0 | q4_0 (llama.cpp).")]
CacheTypeVOpt = Annotated[str, typer.Option("--cache-type-v", help="KV-cache type of V: f16 | q8_0 | q4_0 (llama.cpp; "
                                             "a quantized V turns flash attention on).")]
PromptCacheOpt = Annotated[str | None, typer.Option("--prompt-cache", metavar="DIR", help="Keep KV states of long "
                                                     "prompt prefixes in DIR and restore them, also after a restart "
                                                     "(llama.cpp).")]
PromptCacheSizeOpt = Annotated[str, typer.Option("--prompt-cache-size", help="Bound of --prompt-cache: bytes or e.g. "
                                                  "4GiB, 512MB (least recently used files go first).")]
MmprojOpt = Annotated[str | None, typer.Option("--mmproj", metavar="FILE", help="Vision projector (mmproj GGUF) for "
                                                "images [default: one beside the model].")]


# The options of one GenerateRequest: the API's names and defaults (ondevice.params), in --help order.
REQUEST_OPTIONS = (
    ("max_tokens", MaxTokOpt, DEFAULT_MAX_TOKENS), ("temperature", TempOpt, DEFAULTS.temperature),
    ("top_k", TopKOpt, DEFAULTS.top_k), ("top_p", TopPOpt, DEFAULTS.top_p), ("min_p", MinPOpt, DEFAULTS.min_p),
    ("repetition_penalty", RepOpt, DEFAULTS.repetition_penalty), ("seed", SeedOpt, DEFAULTS.seed),
    ("gamma", GammaOpt, DEFAULT_GAMMA),
)


def request_options(fn):
    """Give a command the generation options (``REQUEST_OPTIONS``), built into one ``GenerateRequest`` (validated
    there, before any model loads) and passed to the command as its ``request`` argument."""
    sig = inspect.signature(fn)
    hints = typing.get_type_hints(fn, include_extras=True)  # this module's annotations are strings
    own = [p.replace(annotation=hints[n]) for n, p in sig.parameters.items() if n != "request"]
    added = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, annotation=a, default=d) for n, a, d in REQUEST_OPTIONS]

    @functools.wraps(fn)
    def inner(*args, **kwargs):
        options = {n: kwargs.pop(n) for n, _, _ in REQUEST_OPTIONS}
        return fn(*args, request=GenerateRequest.of(**options), **kwargs)

    inner.__signature__ = sig.replace(parameters=own + added, return_annotation=None)
    inner.__annotations__ = {p.name: p.annotation for p in own + added}
    return inner


def _drafter(draft: str | None, ngram: bool, no_spec: bool) -> str | None:
    if sum([draft is not None, ngram, no_spec]) > 1:
        from ondevice.errors import OndeviceError

        raise OndeviceError("use only one of --draft (a model, auto or heads), --ngram, --no-spec")
    return "none" if no_spec else "ngram" if ngram else ("model" if draft else None)


OutputTypeOpt = Annotated[str | None, typer.Option("--output-type", help="GGUF: tensor type of the output projection "
                                                  "(llama-quantize's --output-tensor-type), e.g. iq4_nl | q4_0 | q8_0; "
                                                  "default: llama.cpp's Q6_K, which x86 CPUs verify without repacking.")]
EmbeddingTypeOpt = Annotated[str | None, typer.Option("--embedding-type", help="GGUF: tensor type of the token "
                                                      "embedding (llama-quantize's --token-embedding-type).")]
