"""Chat templates are untrusted input: they render in a separate worker process with a budget.

A model file's jinja template can loop for hours (``range(100000)`` nested twice), build a string of
terabytes (doubling it 40 times) or recurse without end. The jinja2 sandbox stops a template from
reaching Python internals but not from spending time or memory, and a pure-Python loop in a thread
cannot be stopped. So templates render in one long-lived worker process (started on first use, in its
own session so a terminal's Ctrl-C does not reach it) with:

- time: the caller waits at most ``RENDER_SECONDS`` (``ONDEVICE_TEMPLATE_SECONDS``) and then kills the
  worker (the next render starts a fresh one);
- memory: the worker's address space is capped (``RLIMIT_AS``, ``MEMORY_BYTES``; Linux enforces it) and its
  data size (``RLIMIT_DATA``); macOS enforces neither for mmap'd memory, so there a thread also polls the
  worker's peak resident size every 20 ms and exits past the limit (not a hard limit: a burst can overshoot);
- output: rendering stops beyond ``MAX_CHARS`` characters;
- recursion: a low recursion limit, reported as such.

The worker sees no environment but ``PYTHONPATH`` (the directories holding ondevice, jinja2 and markupsafe)
and ``TZ``: no tokens or keys of the user's. Where the OS allows (``ondevice.quality.confine``: bubblewrap on
Linux, sandbox-exec on macOS) it runs confined: no network, nothing writable, only the Python installation
and those packages readable; elsewhere it runs unconfined (the jinja2 sandbox and the budgets still hold).
It never imports from the working directory (``-P``).

Every failure is one ``OndeviceError`` naming the model file. The caller's thread only waits on a pipe,
so an event loop stays free when it renders in an executor, and Ctrl-C (KeyboardInterrupt) while
waiting kills the worker and propagates.

Run as ``python -m ondevice.templates`` this module is the worker (JSON lines on stdin/stdout).
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from ondevice.errors import OndeviceError

RENDER_SECONDS = float(os.environ.get("ONDEVICE_TEMPLATE_SECONDS", "5"))
START_SECONDS = 60.0  # starting the worker (a Python start and jinja2's import) on a busy machine
MAX_CHARS = 8 << 20  # characters of rendered prompt (far beyond any context window)
MEMORY_BYTES = 1 << 30  # the worker's address space
RECURSION_LIMIT = 1000


def _worker_command(args: Sequence[str] = ("-m", "ondevice.templates")) -> tuple[list[str], dict[str, str], str | None]:
    """How the worker starts: (argv, environment, the OS confinement used or None).

    ``args`` follow ``python -P`` (tests pass ``-c CODE`` to see what code running in the worker could reach)."""
    import importlib.util

    from ondevice.quality.confine import available, bwrap_argv, macos_argv

    packages = [os.path.dirname(os.path.abspath(__file__))]  # ondevice/
    for name in ("jinja2", "markupsafe"):
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            packages.append(os.path.abspath(next(iter(spec.submodule_search_locations))))
    env = {"PYTHONPATH": os.pathsep.join(dict.fromkeys(os.path.dirname(p) for p in packages))}
    if os.environ.get("TZ"):
        env["TZ"] = os.environ["TZ"]  # strftime_now renders the user's local time
    argv = [sys.executable, "-P", *args]
    kind = available()
    if kind in ("bwrap", "bwrap+inodes"):
        # started from warm()'s short-lived thread: not --die-with-parent (it would die with that thread); the
        # worker ends when its stdin closes, i.e. when this process ends, or when it is killed
        argv = bwrap_argv(kind, argv, read_only=packages, env=env, writable=False, die_with_parent=False)
        return argv, {"PATH": "/usr/bin:/bin"}, kind
    if kind == "sandbox-exec":
        return macos_argv(argv, work=None, read_only=packages), env, kind
    return argv, env, None


class _Worker:
    def __init__(self) -> None:
        argv, env, self.confinement = _worker_command()
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     env=env, start_new_session=True, cwd="/" if os.name == "posix" else None)
        self.ready = False

    def signal_kill(self) -> None:
        """SIGKILL the worker's whole session (a sandbox tool, its PID 1 and the Python inside)."""
        try:
            if os.name == "posix":
                os.killpg(self.proc.pid, 9)
            else:
                self.proc.kill()
        except OSError:
            pass

    def kill(self) -> None:
        self.signal_kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass

    def read(self, deadline: float) -> bytes | None:
        """One line from the worker, or None when the deadline passed first (or it died)."""
        import selectors

        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                if sel.select(timeout=min(left, 0.1)):
                    line = self.proc.stdout.readline()
                    return line or None


_lock = threading.Lock()  # one render at a time per process (a render takes milliseconds)
_worker: _Worker | None = None


def _kill_worker() -> None:
    global _worker
    if _worker is not None:
        _worker.kill()
        _worker = None


def shutdown() -> None:
    """Kill the worker now (a render in progress fails at once with an OndeviceError). Safe to call any time."""
    w = _worker
    if w is not None:
        w.signal_kill()


atexit.register(shutdown)


def _started(source: str) -> _Worker:
    """The worker, started (and its hello read) if it is not running; call with ``_lock`` held."""
    global _worker
    if _worker is None or _worker.proc.poll() is not None:
        _kill_worker()
        _worker = _Worker()
    w = _worker
    if not w.ready:
        hello = w.read(time.monotonic() + START_SECONDS)
        if hello is None:
            status = w.proc.poll()
            _kill_worker()
            why = f"it exited with status {status}" if status is not None else f"no answer in {START_SECONDS:g} s"
            how = f" under {w.confinement}" if w.confinement else ""
            raise OndeviceError(f"{source}: could not start the chat template worker "
                                f"({sys.executable} -P -m ondevice.templates{how}: {why})")
        w.ready = True
    return w


def warm() -> None:
    """Start the worker in the background, for a caller that will render soon (``ChatSession``, the server):
    the first turn then does not wait for a Python start and jinja2's import (~0.2 s on a loaded 2-core
    machine, as much as the first token of a small model). A failure is left for ``render`` to report."""

    def start() -> None:
        with _lock:
            try:
                _started("warm-up")
            except (OndeviceError, OSError):
                pass

    threading.Thread(target=start, daemon=True, name="ondevice-template-warm").start()


def render(template: str, messages: Sequence[dict], *, source: str, seconds: float | None = None, **variables) -> str:
    """Render ``template`` with ``messages`` and ``variables`` in the worker, within the budget.

    Args:
        template: the jinja source (from the model file's metadata).
        messages: [{role, content}] with string contents.
        source: the model file, named in every error.
        seconds: the time budget (default ``RENDER_SECONDS``).
        variables: further template variables (add_generation_prompt, bos_token, eos_token).
    Returns:
        The rendered prompt.
    Raises:
        OndeviceError: the template does not compile, fails, is refused by the sandbox, or exceeds the
            time, output, memory or recursion budget.
    KeyboardInterrupt: propagates after the worker was killed.
    """
    budget = RENDER_SECONDS if seconds is None else seconds
    try:
        request = json.dumps({"template": template, "messages": list(messages), "variables": variables}).encode()
    except (TypeError, ValueError) as e:
        raise OndeviceError(f"chat messages for {source} must hold only strings, numbers, lists and dicts: {e}") from None
    request += b"\n"
    with _lock:
        pending = False  # a request was sent and its reply not read: the worker is busy with it
        try:
            w = _started(source)
            try:
                pending = True
                w.proc.stdin.write(request)
                w.proc.stdin.flush()
            except OSError:
                _kill_worker()
                raise OndeviceError(f"{source}: the chat template worker was stopped; try again") from None
            line = w.read(time.monotonic() + budget)
            pending = line is None
            if line is None:
                died = w.proc.poll() is not None
                _kill_worker()
                if died:
                    raise OndeviceError(f"chat template of {source} was stopped: it ran out of memory "
                                        f"(over {MEMORY_BYTES >> 20} MiB) or the worker was shut down")
                raise OndeviceError(f"chat template of {source} took over {budget:g} s to render; the model "
                                    "file's template is broken or hostile: use generate with a plain prompt")
        except BaseException:  # Ctrl-C while waiting included: a worker still rendering is killed
            if _worker is not None and (pending or not _worker.ready):
                _kill_worker()
            raise
        reply = json.loads(line)
        if "text" in reply:
            return reply["text"]
        # the model file's text (raise_exception's message): escape control characters before it reaches a terminal
        why = "".join(c if c.isprintable() else f"\\x{ord(c):02x}" if ord(c) < 256 else f"\\u{ord(c):04x}"
                      for c in str(reply["error"])[:2000])
        raise OndeviceError(f"chat template of {source} {why}")


# -- the worker process -----------------------------------------------------------------------------
def _raise(message: str):
    from jinja2.exceptions import TemplateError

    raise TemplateError(f"raise_exception: {message}")


_compiled: dict[str, object] = {}


def _tojson(x, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    """Plain ``json.dumps``, as transformers and llama.cpp render ``tojson`` (jinja2's own returns HTML-escaped
    Markup, so ``'<marker>' + x|tojson`` escaped the marker, and it takes no ``ensure_ascii``)."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _compile(template: str):
    import datetime

    from jinja2.sandbox import ImmutableSandboxedEnvironment

    t = _compiled.get(template)
    if t is None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        env.filters["tojson"] = _tojson
        t = env.from_string(template)
        if len(_compiled) > 8:
            _compiled.clear()
        _compiled[template] = t
    return t


def _render_one(req: dict) -> dict:
    from jinja2.exceptions import SecurityError, TemplateError, TemplateSyntaxError

    try:
        t = _compile(req["template"])
    except TemplateSyntaxError as e:
        return {"error": f"does not compile: {e}"}
    try:
        out, n = [], 0
        for piece in t.generate(messages=req["messages"], **req["variables"]):
            n += len(piece)
            if n > MAX_CHARS:
                return {"error": f"renders over {MAX_CHARS >> 20} M characters; the template is broken or hostile"}
            out.append(piece)
        return {"text": "".join(out)}
    except SecurityError as e:
        return {"error": f"rejected by the sandbox: {e}"}
    except TemplateError as e:
        return {"error": f"failed to render: {e}"}
    except RecursionError:
        return {"error": "recurses too deeply; the template is broken or hostile"}
    except MemoryError:
        return {"error": f"needs over {MEMORY_BYTES >> 20} MiB of memory; the template is broken or hostile"}
    except Exception as e:  # noqa: BLE001 - a template can raise anything from its filters and tests
        return {"error": f"failed to render: {type(e).__name__}: {(str(e).splitlines() or [''])[0]}"}


def _watch_memory() -> None:
    """Exit when resident memory passes ``MEMORY_BYTES`` (where RLIMIT_AS is not enforced, e.g. macOS); the
    parent reports the death as running out of memory. Exit too when the parent is gone (stdin hung up): a
    worker busy with a hostile template would otherwise render on, orphaned, until the template ends."""
    try:
        import resource
        import select
    except ImportError:  # no resource module (Windows): the time and output budgets still hold
        return
    hangup = select.poll()
    hangup.register(sys.stdin.fileno(), select.POLLHUP)

    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux

    def peak() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale

    # Linux keeps the high-water mark across execve: a worker started by a process that had held a 1.6 GB
    # model began "over the limit" and exited at once. Count only the growth past the mark it started with.
    start = peak()
    while True:
        if peak() - start > MEMORY_BYTES:
            os._exit(3)
        if any(ev & (select.POLLHUP | select.POLLERR | select.POLLNVAL) for _, ev in hangup.poll(0)):
            os._exit(4)
        time.sleep(0.02)


def _serve() -> None:
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides; it kills this process when it must
    try:
        import resource

        for limit in ("RLIMIT_AS", "RLIMIT_DATA"):
            try:
                resource.setrlimit(getattr(resource, limit), (MEMORY_BYTES, MEMORY_BYTES))
            except (ValueError, OSError, AttributeError):
                pass
    except ImportError:  # no resource module (Windows): the watchdog below and the time budget still hold
        pass
    threading.Thread(target=_watch_memory, daemon=True).start()
    import jinja2.sandbox  # noqa: F401 - imported before the first request is timed

    sys.setrecursionlimit(RECURSION_LIMIT)
    out = sys.stdout.buffer
    out.write(b"{}\n")
    out.flush()
    for line in sys.stdin.buffer:
        reply = _render_one(json.loads(line))
        out.write(json.dumps(reply).encode() + b"\n")
        out.flush()


if __name__ == "__main__":
    _serve()
