"""``ondevice chat``: a streaming REPL (or, with piped stdin, one user turn per line)."""

from __future__ import annotations

import re
import signal
import sys
from contextlib import contextmanager

from ondevice.chat import ChatSession
from ondevice.errors import OndeviceError
from ondevice.images import load_image
from ondevice.params import GenerateRequest
from ondevice.reasoning import Splitter

HELP = ("/help shows this · /reset clears the history · /stats shows the last answer's statistics · "
        "/think on|off turns a thinking model's thinking on or off · /thinking shows the last thinking · "
        "/image FILE attaches an image to your next message · /exit quits · Ctrl-C stops an answer")
FOLD_LINES = 4  # lines of thinking shown (dimmed) while it streams; then it folds into one line
# C0 controls but newline and tab, a carriage return not followed by a newline, DEL and the C1 controls
_CONTROL = re.compile(r"\r(?!\n)|[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")


def visible(text: str) -> str:
    """``text`` as model output may reach the terminal: every control character that could drive it (an ESC
    sequence clears the screen, sets the window title or writes the clipboard with OSC 52; C1 controls; a lone
    carriage return rewrites the line shown) written out visibly as ``\\x1b`` and so on; newlines, tabs and
    CRLF line ends stay. A model's text is untrusted: ``ondevice generate`` and ``ondevice chat`` print it
    through this, piped or not (``--json`` escapes it already)."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


class _Turn:
    """One answer as the REPL shows it: a thinking model's thinking with its last lines dimmed while it streams
    (a transient rich Live on a terminal), then folded into one dim line (``/thinking`` prints it all); the
    answer printed as it comes."""

    def __init__(self, out, err, interactive: bool) -> None:
        self.out, self.err, self.interactive = out, err, interactive
        self.parts: list[str] = []
        self.answer: list[str] = []
        self.live = None
        self.folded = False

    def show(self, reasoning: str, content: str, style: str | None = None) -> None:
        """Show a piece of thinking and / or answer (``ondevice.reasoning.Splitter``'s output)."""
        if reasoning:
            self.add(reasoning)
        if content:
            self.fold()
            self.out.print(visible(content), style=style, end="", markup=False)
            self.answer.append(content)

    def add(self, text: str) -> None:
        from rich.text import Text

        self.parts.append(text)
        if not self.interactive:
            return
        tail = "\n".join("".join(self.parts).strip().splitlines()[-FOLD_LINES:])
        view = Text(visible(tail), style="dim italic")
        if self.live is None:
            from rich.live import Live

            self.live = Live(view, console=self.out, transient=True, auto_refresh=False)
            self.live.start()
        self.live.update(view, refresh=True)

    def fold(self) -> None:
        """End the live view and leave one line saying how much was thought (nothing if nothing was)."""
        if self.live is not None:
            self.live.stop()
            self.live = None
        text = self.text
        if text and not self.folded:
            self.folded = True
            self.err.print(f"[dim]▸ thought for {len(text.split())} words · /thinking shows it[/dim]")

    @property
    def text(self) -> str:
        return "".join(self.parts).strip()


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
             title: str, think: bool | None = None, images: list[str] | None = None) -> int:
    """Run the chat loop until /exit, EOF or (at the prompt) Ctrl-C. ``images`` (paths) go with the first
    message, and ``/image FILE`` attaches one to the next.

    A turn that fails (too long for the context, a broken chat template) is reported in one line and the
    session goes on with the next turn, its history kept. A thinking model's thinking (the template's
    convention, ``ondevice.reasoning``) is shown dimmed while it streams, then folded into one line; only the
    answer is kept in the history. ``think``: the template's enable_thinking (None: its default). Returns the
    exit status: 0, or 1 when a turn of piped input was refused.
    """
    from rich.markup import escape

    from ondevice.cli.app import console

    out = console(highlight=False, soft_wrap=True, emoji=False)
    err = console(stderr=True, highlight=False, soft_wrap=True, emoji=False)
    refused = 0
    session = ChatSession(runtime, system=system, request=request,
                          variables={} if think is None else {"enable_thinking": think})
    interactive = sys.stdin.isatty()
    warned = False
    pending = list(images or [])
    thoughts = None
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
        if line == "/think" or (line.startswith("/think ") and line not in ("/think on", "/think off")):
            err.print("[yellow]use /think on or /think off[/yellow]")  # not a message to the model
            continue
        if line in ("/think on", "/think off"):
            session.variables["enable_thinking"] = line == "/think on"
            err.print(f"[dim]thinking {line.split()[1]} (the template's enable_thinking; a template without it "
                      "ignores this)[/dim]")
            continue
        if line == "/thinking":
            err.print(f"[dim]{escape(visible(thoughts.text))}[/dim]" if thoughts and thoughts.text else "[dim]no thinking yet[/dim]")
            continue
        if line == "/stats":
            s = runtime.last_stats
            err.print(_stats_line(s) if s else "[dim]no answer yet[/dim]")
            continue
        if line == "/image" or line.startswith("/image "):
            path = line.removeprefix("/image").strip()
            if not path:
                err.print("[yellow]use /image FILE (a PNG, JPEG, GIF or BMP)[/yellow]")
                continue
            try:  # checked now: a missing or bad file must not cost the next message
                load_image(path)
            except OndeviceError as e:
                err.print(f"[bold red]error:[/bold red] {escape(str(e).splitlines()[0])}")
                refused += 1
                continue
            pending.append(path)
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
        split, thoughts = Splitter(session.thinking), _Turn(out, err, interactive)
        try:
            with _ctrl_c_cancels(stream):
                for chunk in stream:
                    style = "cyan" if show_draft and chunk.from_draft and all(chunk.from_draft) else None
                    thoughts.show(*split.feed(chunk.text), style)
            thoughts.show(*split.finish())
        finally:
            thoughts.fold()
        out.print()
        if stream.stats.stop_reason == "cancelled":
            err.print("[dim](stopped)[/dim]")
        elif note := context_note(stream.stats, runtime.n_ctx):
            err.print(f"[yellow]{note}[/yellow]")
        session.commit(user, "".join(thoughts.answer))
        if show_stats:
            err.print(f"[dim]{_stats_line(stream.stats)}[/dim]")
    return 1 if refused and not interactive else 0
