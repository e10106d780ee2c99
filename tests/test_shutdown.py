"""Reliability, second round (issue 28), part 2: close() with a waiting request, convert onto a directory that
cannot be replaced, honest Core ML wording, API inputs, the missing-module skip check, and the smaller items."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import ondevice
from ondevice.errors import OndeviceError

PROMPT = "The model draft and the target verify"
TESTS = Path(__file__).resolve().parent


# -- 5. close() while another thread waits for its turn -----------------------------------------------------
def test_close_refuses_a_waiting_request_and_does_not_wait_for_it(tiny_gguf, monkeypatch):
    from ondevice.backends.llama import LlamaBackend

    real = LlamaBackend.eval

    def slow(self, *a, **kw):  # 50 ms a pass: B's 64 tokens would take over 3 s
        time.sleep(0.05)
        return real(self, *a, **kw)

    monkeypatch.setattr(LlamaBackend, "eval", slow)
    rt = ondevice.load(tiny_gguf("llama"), drafter="none", threads=1, n_ctx=512)
    started, b_out = threading.Event(), []

    def a_streams():
        try:
            for _ in rt.stream(PROMPT, max_tokens=400, temperature=0, gamma=0):
                started.set()
        except OndeviceError:
            pass
        started.set()

    def b_waits():
        try:
            b_out.append(rt.generate(PROMPT, max_tokens=64, temperature=0, gamma=0))
        except OndeviceError as e:
            b_out.append(e)

    a = threading.Thread(target=a_streams)
    a.start()
    assert started.wait(60)
    b = threading.Thread(target=b_waits)
    b.start()
    time.sleep(0.5)  # B is waiting for the slot A holds
    t0 = time.monotonic()
    rt.close()
    took = time.monotonic() - t0
    a.join(30)
    b.join(30)
    assert isinstance(b_out[0], OndeviceError) and "closed" in str(b_out[0]), b_out[0]
    assert took < 2.0  # one pass of A, not B's whole answer


# -- 6. convert --out onto an empty directory that cannot be replaced ---------------------------------------
def test_convert_onto_an_unreplaceable_directory_fails_before_any_work(tiny_hf, tmp_path, monkeypatch):
    from converters import convert

    out = tmp_path / "mnt"
    out.mkdir()
    monkeypatch.setattr(os.path, "ismount", lambda p: Path(p) == out)
    t0 = time.monotonic()
    with pytest.raises(OndeviceError, match="mount point"):
        convert(tiny_hf["llama"], to="gguf", out=out, quant="q8_0", progress=False)
    monkeypatch.undo()
    real_rename = os.rename

    def busy(src, dst, *a, **kw):  # what the kernel answers for a directory in use (EBUSY)
        if Path(src) == out:
            raise OSError(errno.EBUSY, os.strerror(errno.EBUSY), str(src))
        return real_rename(src, dst, *a, **kw)

    monkeypatch.setattr(os, "rename", busy)
    with pytest.raises(OndeviceError, match="cannot be replaced.*busy") as e:
        convert(tiny_hf["llama"], to="gguf", out=out, quant="q8_0", progress=False)
    assert "\n" not in str(e.value) and time.monotonic() - t0 < 10
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mnt"] and not any(out.iterdir())  # nothing written


# -- 7. a Core ML check says what it compared ---------------------------------------------------------------
def test_coreml_verified_line_does_not_claim_agreement_with_the_source(tmp_path):
    from ondevice.store.info import _verified

    (tmp_path / "manifest.json").write_text(json.dumps({"verified": {
        "check": "mil-interpreter vs numpy reference on the package's decompressed weights", "tokens": 8, "top1": 1.0,
        "max_rel_err": 0.001}}))
    line = _verified(tmp_path)
    assert not line.startswith("yes") and "not against the source" in line and "top-1 1.0" in line
    record = json.loads((tmp_path / "manifest.json").read_text())  # a GGUF source: checked against llama.cpp too
    record["verified"]["source"] = {"reference": "llama.cpp (source GGUF), held-out text", "tokens": 96,
                                    "top1_agreement": 0.958, "gated": True}
    (tmp_path / "manifest.json").write_text(json.dumps(record))
    line = _verified(tmp_path)
    assert line.startswith("yes, against the source: llama.cpp") and "top-1 0.958" in line and "(gated)" in line


# -- 8. the API's inputs: one OndeviceError, never a raw Python error ---------------------------------------
def test_chat_api_takes_openai_message_forms_and_refuses_bad_ones(tiny_gguf):
    with ondevice.load(tiny_gguf("llama"), drafter="none", threads=1, n_ctx=256) as rt:
        parts = [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]
        assert rt.render_chat([{"role": "user", "content": parts}]) == rt.render_chat([{"role": "user",
                                                                                       "content": "Hello there"}])
        assert rt.render_chat([{"role": "system", "content": None}, {"role": "user", "content": "x"}]) == \
            rt.render_chat([{"role": "system", "content": ""}, {"role": "user", "content": "x"}])
        cases = {
            "non-empty list": dict(messages=[]),
            "content part of type 'image_url'": dict(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
            "'role' string": dict(messages=[{"content": "x"}]),
            "seed='abc'": dict(messages=[{"role": "user", "content": "x"}], seed="abc"),
            "temperature='hot'": dict(messages=[{"role": "user", "content": "x"}], temperature="hot"),
        }
        for needle, kw in cases.items():
            with pytest.raises(OndeviceError, match=needle.replace("(", r"\(").replace("[", r"\[")) as e:
                rt.chat(**kw, max_tokens=2)
            assert "\n" not in str(e.value)
        with pytest.raises(OndeviceError, match="seed='abc'"):
            rt.generate(PROMPT, seed="abc")


# -- 9. no test skipped for a missing module ----------------------------------------------------------------
def test_a_skip_for_a_missing_module_fails_the_run(tmp_path):
    (tmp_path / "conftest.py").write_text(f"import sys\nsys.path.insert(0, {str(TESTS)!r})\n"
                                          "from skipcheck import *  # noqa\n")
    (tmp_path / "test_missing.py").write_text("import pytest\nnope = pytest.importorskip('no_such_module_xyz', "
                                              "reason='not installed')\n\ndef test_x():\n    pass\n")
    (tmp_path / "test_platform.py").write_text("import pytest\n\n@pytest.mark.skip(reason='needs macOS')\n"
                                               "def test_y():\n    pass\n\ndef test_z():\n    pass\n")
    run = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path)]
    r = subprocess.run([*run, str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 1 and "no_such_module_xyz" in r.stdout, r.stdout
    r = subprocess.run([*run, str(tmp_path / "test_platform.py")], capture_output=True, text=True, timeout=300,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stdout  # a platform skip is allowed


def test_dev_extra_installs_what_the_tests_import():
    import tomllib

    dev = tomllib.loads((TESTS.parent / "pyproject.toml").read_text())["project"]["optional-dependencies"]["dev"]
    names = {d.split(">")[0].split("=")[0].split("[")[0].split(";")[0].strip().lower() for d in dev}
    assert {"httpx", "openai", "pytest", "scipy", "jsonschema"} <= names


# -- 10. the smaller items ----------------------------------------------------------------------------------
def test_cli_error_prints_colon_words_as_written(tmp_path):
    model = tmp_path / ":loop:" / "m.gguf"
    r = subprocess.run([sys.executable, "-m", "ondevice", "generate", str(model), "-p", "hi"], capture_output=True,
                       timeout=300)
    err = r.stderr.decode()
    assert r.returncode == 2 and ":loop:" in err and "\U0001f501" not in err, err


def test_a_character_cut_by_max_tokens_is_dropped_not_replaced():
    from ondevice.speculative import TextAssembler

    pieces = {1: b"ok ", 2: "🙂".encode()[:2], 3: "🙂".encode()[2:]}
    t = TextAssembler(pieces.__getitem__, [])
    assert t.feed(1) + t.feed(2) + t.flush() == "ok "  # the cut half of the emoji is not "�"
    t = TextAssembler(pieces.__getitem__, [])
    assert t.feed(1) + t.feed(2) + t.feed(3) + t.flush() == "ok 🙂"


def test_repl_help_and_symlink_loop(tiny_gguf, tmp_path):
    r = subprocess.run([sys.executable, "-m", "ondevice", "chat", str(tiny_gguf("llama")), "--no-spec", "--threads", "1",
                        "--max-tokens", "2"], input=b"/help\n", capture_output=True, timeout=300)
    assert r.returncode == 0 and "/reset" in r.stderr.decode() and "unknown" not in r.stderr.decode(), r.stderr
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    a.symlink_to(b)
    b.symlink_to(a)
    for args in (["generate", str(a), "-p", "hi"], ["info", str(a)]):
        r = subprocess.run([sys.executable, "-m", "ondevice", *args], capture_output=True, timeout=300)
        assert r.returncode == 2 and "symlink loop" in r.stderr.decode(), r.stderr


def test_models_local_keeps_errors_out_of_the_arch_column():
    from ondevice.cli.local import row

    cells = row({"name": "ollama:x", "error": "truncated"})
    assert cells[2] == "" and "truncated" in cells[0]


def test_truncated_ollama_blob_without_a_size_is_an_error(tiny_gguf, tmp_path, monkeypatch):
    from ondevice.store import discovery

    data = tiny_gguf("llama").read_bytes()
    cut = data[: len(data) - 1000]
    digest = hashlib.sha256(cut).hexdigest()
    root = tmp_path / "ollama"
    (root / "blobs").mkdir(parents=True)
    (root / "blobs" / f"sha256-{digest}").write_bytes(cut)
    manifest = root / "manifests" / "registry.ollama.ai" / "library" / "tiny" / "latest"
    manifest.parent.mkdir(parents=True)
    manifest.write_text(json.dumps({"schemaVersion": 2, "layers": [  # no "size": nothing to compare with
        {"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}"}]}))
    monkeypatch.setenv("OLLAMA_MODELS", str(root))
    monkeypatch.setenv("ONDEVICE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("LMSTUDIO_HOME", str(tmp_path / "lms"))
    rows = [m for m in discovery.local_models() if m["name"] == "ollama:tiny:latest"]
    assert rows and "truncated" in rows[0].get("error", ""), rows


def test_uncached_hf_name_fails_fast_when_offline(monkeypatch, tmp_path):
    import socket

    from ondevice.store import sources

    def offline(*a, **kw):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", offline)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    for k in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(k, raising=False)
    t0 = time.monotonic()
    with pytest.raises(OndeviceError, match="cannot be reached"):
        sources.resolve_hf("someorg/somerepo")
    assert time.monotonic() - t0 < 5


def test_sigterm_during_the_cost_probe_stops_at_once(smollm2, tmp_path):
    """The first gamma=auto request measures costs (seconds); a shutdown must not wait for it."""
    import urllib.request

    from ondevice.server.run import launch

    log = tmp_path / "serve.log"
    with open(log, "wb") as f:
        env_home = os.environ.get("ONDEVICE_HOME")
        os.environ["ONDEVICE_HOME"] = str(tmp_path / "home")  # no cached costs: the first request probes
        try:
            proc, url = launch(str(smollm2), "--threads", "1", "--n-ctx", "512", stderr=f)
        finally:
            os.environ.pop("ONDEVICE_HOME") if env_home is None else os.environ.__setitem__("ONDEVICE_HOME", env_home)
        try:
            body = json.dumps({"model": "x", "prompt": "1, 2, 3,", "max_tokens": 50}).encode()
            model = json.loads(urllib.request.urlopen(url + "/v1/models", timeout=30).read())["data"][0]["id"]
            body = json.dumps({"model": model, "prompt": "1, 2, 3,", "max_tokens": 50}).encode()
            req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
            th = threading.Thread(target=lambda: _ignore(urllib.request.urlopen, req, timeout=120), daemon=True)
            th.start()
            time.sleep(1.5)  # the request is in the probe
            t0 = time.monotonic()
            proc.terminate()
            proc.wait(timeout=60)
            took = time.monotonic() - t0
        finally:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert "timeout graceful shutdown exceeded" not in text, text
    assert took < 30, took  # the pass in progress, not the whole probe or answer


def _ignore(fn, *a, **kw):
    try:
        fn(*a, **kw)
    except Exception:  # noqa: BLE001 - the answer does not matter here
        pass


# -- 4. the default thread count leaves the cores other processes use ---------------------------------------
def test_default_threads_counts_free_physical_cores(monkeypatch):
    from ondevice import threads

    monkeypatch.setattr(threads, "usable_cpus", lambda: 8)
    monkeypatch.setattr(threads, "physical_cores", lambda: 4)  # SMT: 8 logical CPUs on 4 cores
    for busy, want in ((0.0, 4), (3.0, 4), (5.0, 3), (7.0, 1), (30.0, 1)):
        monkeypatch.setattr(threads, "busy_cpus", lambda b=busy: b)
        assert threads.default_threads() == want, (busy, want)
    monkeypatch.setattr(threads, "usable_cpus", lambda: 2)
    monkeypatch.setattr(threads, "physical_cores", lambda: 2)
    monkeypatch.setattr(threads, "busy_cpus", lambda: 1.0)  # one CPU-bound process on a 2-core machine
    assert threads.default_threads() == 1
    monkeypatch.undo()
    from ondevice.backends.llama import LlamaBackend

    assert "default_threads" in LlamaBackend.__init__.__code__.co_names  # the backend's default is this one


def test_coreml_progress_shows_life_during_the_long_step(tiny_hf, tmp_path, monkeypatch):
    """coremltools' convert is most of the minute with the bar at 0/6: a spinner and the elapsed time show it works."""
    pytest.importorskip("coremltools")
    import rich.progress

    from converters import convert

    columns: list = []

    class Recording(rich.progress.Progress):
        def __init__(self, *cols, **kw):
            columns.extend(cols)
            super().__init__(*cols, **kw)

    monkeypatch.setattr(rich.progress, "Progress", Recording)
    convert(tiny_hf["llama"], to="coreml", out=tmp_path / "c", context=128, compress="int4", progress=False)
    kinds = {type(c).__name__ for c in columns}
    assert {"SpinnerColumn", "TimeElapsedColumn"} <= kinds, kinds


def test_ctrl_c_while_the_cli_imports_exits_quietly():
    """Ctrl-C in the first tenth of a second of `ondevice ...` lands while typer / rich import: exit 130 and no
    traceback (as a Ctrl-C during the command), through the console script's entry point and `python -m`."""
    import tomllib

    root = Path(__file__).resolve().parent.parent
    entry = tomllib.loads((root / "pyproject.toml").read_text())["project"]["scripts"]["ondevice"]
    module, func = entry.split(":")
    interrupt = ("import builtins\nreal = builtins.__import__\n"
                 "def imp(name, *a, **kw):\n"
                 "    if name == 'typer':\n        raise KeyboardInterrupt\n"
                 "    return real(name, *a, **kw)\n"
                 "builtins.__import__ = imp\n")
    for call in (f"import {module}; {module}.{func}()", "import runpy; runpy.run_module('ondevice', run_name='__main__')"):
        p = subprocess.run([sys.executable, "-c", interrupt + call, "--help"], capture_output=True, text=True,
                           cwd=root, timeout=60)
        assert p.returncode == 130 and p.stderr == "" and p.stdout == "", (call, p.returncode, p.stderr)
