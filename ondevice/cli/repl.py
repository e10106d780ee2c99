"""``ondevice chat``: a streaming REPL (or, with piped stdin, one user turn per line)."""

from __future__ import annotations

import signal
import sys
from contextlib import contextmanager

from ondevice.chat import ChatSession
from ondevice.errors import OndeviceError
from ondevice.params import GenerateRequest

HELP = ("/help shows this · /reset clears the history · /stats shows the last answer's statistics · /image FILE "
        "attaches an image to your next message · /exit quits · Ctrl-C stops an answer")


@contextmanager
def _ctrl_c_cancels(stream):
    """While an answer streams, Ctrl-C cancels it (within one target pass) instead of ending the chat."""
    try:
        previous = signal.signal(signal.SIGINT, lambda *_: stream.cancel())
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def context_note(stats, n_ctx: int) -> str | None:
    """The line that says an answer was cut by the context (not by --max-tokens or end of sequence), or None."""
    if stats.stop_reason != "context":
        return None
    return f"(the answer stopped at the end of the context, {n_ctx} tokens; raise --n-ctx for longer answers)"


def _stats_line(s) -> str:
    return (f"{s.tokens} tokens · {s.tokens_per_second:.1f} tok/s · ttft {s.time_to_first_token * 1000:.0f} ms · "
            f"acceptance {s.acceptance_rate:.0%} · {s.mean_accepted_per_forward:.2f} tokens/pass · "
            f"prompt {s.prompt_eval_tokens}/{s.prompt_tokens} evaluated · drafter {s.drafter}")


def _lines(stdin):
    """Non-empty lines of piped stdin, strictly UTF-8."""
    for n, raw in enumerate(stdin.buffer, 1):
        try:
            line = raw.decode("utf-8").strip()
        except UnicodeDecodeError as e:
            raise OndeviceError(f"stdin line {n} is not valid UTF-8 ({e.reason} at byte {e.start}); send UTF-8 text") from e
        if line:
            yield line


def _with_images(line: str, images: list[str]):
    """The user's content: the text alone, or OpenAI image parts (local paths) followed by the text."""
    if not images:
        return line
    return [*({"type": "image_url", "image_url": {"url": f}} for f in images), {"type": "text", "text": line}]


def run_chat(runtime, *, system: str | None, show_draft: bool, show_stats: bool, request: GenerateRequest,
             title: str, images: list[str] | None = None) -> int:
    """Run the chat loop until /exit, EOF or (at the prompt) Ctrl-C. ``images`` (paths) go with the first
    message, and ``/image FILE`` attaches one to the next.

    A turn that fails (too long for the context, a broken chat template) is reported in one line and the
    session goes on with the next turn, its history kept. Returns the exit status: 0, or 1 when a turn of
    piped input was refused.
    """
    from rich.markup import escape

    from ondevice.cli.app import console

    out = console(highlight=False, soft_wrap=True, emoji=False)
    err = console(stderr=True, highlight=False, soft_wrap=True, emoji=False)
    refused = 0
    session = ChatSession(runtime, system=system, request=request)
    interactive = sys.stdin.isatty()
    warned = False
    pending = list(images or [])
    if interactive:
        err.print(f"[dim]{title}\n{HELP}[/dim]")
    lines = None if interactive else _lines(sys.stdin)
    while True:
        if interactive:
            try:
                line = out.input("[bold green]>>> [/bold green]").strip()
            except (EOFError, KeyboardInterrupt):
                out.print()
                break
            if not line:
                continue
        else:
            line = next(lines, None)
            if line is None:
                break
        if line in ("/help", "/?"):
            err.print(HELP)
            continue
        if line in ("/exit", "/quit", "/bye"):
            break
        if line == "/reset":
            session.reset()
            err.print("[dim]history cleared[/dim]")
            continue
        if line == "/stats":
            s = runtime.last_stats
            err.print(_stats_line(s) if s else "[dim]no answer yet[/dim]")
            continue
        if line.startswith("/image "):
            pending.append(line.removeprefix("/image ").strip())
            err.print("[dim]the image goes with your next message[/dim]")
            continue
        if line.startswith("/") and " " not in line:
            err.print(f"[yellow]unknown command {line}[/yellow] · {HELP}")
            continue
        user = _with_images(line, pending)
        try:
            stream = session.ask(user)
        except OndeviceError as e:
            err.print(f"[bold red]error:[/bold red] {escape(str(e).splitlines()[0])}")
            refused += 1
            pending = []
            continue
        except KeyboardInterrupt:  # Ctrl-C while the prompt renders: stop this turn, not the chat
            err.print("[dim](stopped)[/dim]")
            continue
        pending = []
        if session.dropped and not warned:
            err.print("[yellow]the conversation outgrew the context: dropping the oldest turns (the system prompt stays)[/yellow]")
            warned = True
        answer = []
        with _ctrl_c_cancels(stream):
            for chunk in stream:
                style = "cyan" if show_draft and chunk.from_draft and all(chunk.from_draft) else None
                out.print(chunk.text, style=style, end="", markup=False)
                answer.append(chunk.text)
        out.print()
        if stream.stats.stop_reason == "cancelled":
            err.print("[dim](stopped)[/dim]")
        elif note := context_note(stream.stats, runtime.n_ctx):
            err.print(f"[yellow]{note}[/yellow]")
        session.commit(user, "".join(answer))
        if show_stats:
            err.print(f"[dim]{_stats_line(stream.stats)}[/dim]")
    return 1 if refused and not interactive else 0
