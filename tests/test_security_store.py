"""Model files and folders are untrusted input (issue #41): crafted GGUF headers, concurrent pulls, oversized
wheel members, catalog names shadowed by local folders."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest

from ondevice.errors import OndeviceError
from ondevice.formats import gguf as G

ROOT = Path(__file__).resolve().parent.parent


# -- crafted GGUF files ----------------------------------------------------------------------------
def _s(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def _kv_str(key: str, value: str) -> bytes:
    return _s(key) + struct.pack("<I", 8) + _s(value)


def _kv_tokens(tokens: list[str]) -> bytes:
    return _s(G.TOKENS_KEY) + struct.pack("<IIQ", 9, 8, len(tokens)) + b"".join(_s(t) for t in tokens)


def _nested(key: str, depth: int) -> bytes:
    """An array of an array of … (``depth`` levels) of an empty u32 array."""
    return _s(key) + struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * (depth - 1) + struct.pack("<IQ", 4, 0)


def _gguf(path: Path, *kvs: bytes, n_tensors: int = 0, tail: bytes = b"") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, n_tensors, len(kvs)) + b"".join(kvs) + tail)
    return path


def _good(path: Path, n_tokens: int = 64) -> Path:
    """A header-only GGUF with an architecture and a vocabulary (what discovery reads)."""
    return _gguf(path, _kv_str("general.architecture", "llama"), _kv_tokens([f"t{i}" for i in range(n_tokens)]))


def test_nested_arrays_are_one_error_not_a_recursion_error(tmp_path):
    ok = _gguf(tmp_path / "ok.gguf", _nested("a.b", 3), _kv_str("general.architecture", "llama"))
    assert G.read_header(ok)[0] == {"general.architecture": "llama"}  # legal nesting is still read
    bad = _gguf(tmp_path / "deep.gguf", _nested("a.b", 5000))
    with pytest.raises(OndeviceError, match=r"deep\.gguf: corrupt GGUF header .*nested more than") as e:
        G.read_header(bad)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("field", ["string", "array", "tokens", "n_kv"])
def test_crafted_lengths_and_counts_are_refused_before_allocating(tmp_path, field):
    huge = 1 << 40
    kvs = {
        "string": [_s("k") + struct.pack("<IQ", 8, huge)],
        "array": [_s("k") + struct.pack("<IIQ", 9, 0, huge)],
        "tokens": [_s(G.TOKENS_KEY) + struct.pack("<IIQ", 9, 8, huge)],
        "n_kv": [],
    }[field]
    path = _gguf(tmp_path / "crafted.gguf", *kvs, tail=b"\0" * 64)
    if field == "n_kv":
        raw = bytearray(path.read_bytes())
        raw[16:24] = struct.pack("<Q", huge)
        path.write_bytes(bytes(raw))
    with pytest.raises(OndeviceError, match=r"crafted\.gguf: corrupt GGUF header \(it declares"):
        G.read_header(path)


def test_crafted_n_dims_does_not_build_a_huge_string(tmp_path):
    """A tensor claiming 2**26 dimensions: refused at once (ggml has 4), not a 64 MB format string first."""
    table = _s("blk.0.w") + struct.pack("<I", 1 << 26) + b"\0" * 64
    path = _gguf(tmp_path / "dims.gguf", _kv_str("general.architecture", "llama"), n_tensors=1, tail=table)
    tracemalloc.start()
    try:
        with pytest.raises(OndeviceError, match=r"dims\.gguf: corrupt GGUF tensor table .*67108864 dimensions"):
            G.check_tensor_data(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, f"{peak} bytes allocated to reject the file"


@pytest.fixture
def stores(tmp_path, monkeypatch):
    """Empty HF cache and Ollama store, an LM Studio folder in tmp (offline)."""
    lms = tmp_path / "lmstudio"
    lms.mkdir()
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "OLLAMA_MODELS": str(tmp_path / "ollama"),
           "ONDEVICE_LMSTUDIO_MODELS": str(lms), "ONDEVICE_HOME": str(tmp_path / "home")}
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return lms, env


def test_one_bad_gguf_in_a_store_is_listed_with_its_error_the_rest_still_work(stores, tmp_path):
    from ondevice.autodraft import candidates
    from ondevice.store import discovery

    lms, env = stores
    _good(lms / "org/small-GGUF/small-Q8_0.gguf")
    _gguf(lms / "org/evil-GGUF/evil-Q8_0.gguf", _nested("a.b", 5000), _kv_tokens(["x"]))
    evil_dir = lms / "org/evil-mlx"  # a weights folder whose tokenizer.json nests past json's recursion limit
    evil_dir.mkdir(parents=True)
    (evil_dir / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    (evil_dir / "model.safetensors").write_bytes(b"\0" * 16)
    (evil_dir / "tokenizer.json").write_text("[" * 100_000 + "]" * 100_000)
    rows = {r["name"]: r for r in discovery.local_models()}
    assert rows["lmstudio:org/small-GGUF/small-Q8_0.gguf"]["vocab_size"] == 64
    err = rows["lmstudio:org/evil-GGUF/evil-Q8_0.gguf"]["error"]
    assert "evil-Q8_0.gguf" in err and "nested more than" in err
    assert "evil-mlx" in rows["lmstudio:org/evil-mlx"]["error"]
    # --draft auto / check-pair judge every local model: the bad one is skipped with its reason
    target = _good(tmp_path / "target.gguf", 64)
    target.write_bytes(target.read_bytes() + b"\0" * 100_000)  # much larger than the small one
    _, verdicts = candidates(target)
    by_name = {v["name"]: v for v in verdicts}
    assert by_name["lmstudio:org/small-GGUF/small-Q8_0.gguf"]["ok"]
    assert not by_name["lmstudio:org/evil-GGUF/evil-Q8_0.gguf"]["ok"]
    # and as the user sees it
    out = subprocess.run([sys.executable, "-P", "-m", "ondevice", "models", "--local", "--json"], capture_output=True,
                         text=True, env={**os.environ, **env}, timeout=300)
    assert out.returncode == 0, out.stderr
    names = {m["name"] for m in json.loads(out.stdout)["models"]}
    assert {"lmstudio:org/small-GGUF/small-Q8_0.gguf", "lmstudio:org/evil-GGUF/evil-Q8_0.gguf"} <= names


# -- model folders that carry code ----------------------------------------------------------------
EVIL = '''
import pathlib
pathlib.Path({marker!r}).write_text("code from the model folder ran")
from transformers import PreTrainedTokenizerFast, PretrainedConfig
class EvilTokenizerFast(PreTrainedTokenizerFast):
    pass
class EvilConfig(PretrainedConfig):
    model_type = "qwen2"
'''


def with_auto_map(src: Path, dst: Path, marker: Path) -> Path:
    """A copy of the model folder ``src`` whose config and tokenizer config point (``auto_map``) at a module
    of the folder that writes ``marker`` when imported."""
    import shutil

    shutil.copytree(src, dst)
    (dst / "evil.py").write_text(EVIL.format(marker=str(marker)))
    for name, auto_map in (("config.json", {"AutoConfig": "evil.EvilConfig", "AutoTokenizer": [None, "evil.EvilTokenizerFast"]}),
                           ("tokenizer_config.json", {"AutoTokenizer": [None, "evil.EvilTokenizerFast"]})):
        f = dst / name
        f.write_text(json.dumps({**(json.loads(f.read_text()) if f.is_file() else {}), "auto_map": auto_map}))
    return dst


def test_no_code_from_a_model_folder_runs_when_mlx_or_coreml_load_its_tokenizer(tiny_hf, tmp_path, monkeypatch):
    pytest.importorskip("mlx.core", reason="MLX is not installed (pip install 'ondevice[mlx]')")
    from ondevice.backends.hf_vocab import load_tokenizer
    from ondevice.backends.mlx import MLXBackend

    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "modules"))
    marker = tmp_path / "MARKER"
    model = with_auto_map(tiny_hf["qwen2"], tmp_path / "evil", marker)
    b = MLXBackend(model, n_ctx=64, device="cpu")
    assert len(b.tokenize("hello")) > 0
    b.close()
    tok, _ = load_tokenizer(model)  # the Core ML / static backends' tokenizer
    assert tok.encode("hello")
    assert not marker.exists()


def test_no_trust_remote_code_true_anywhere():
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    grep = subprocess.run(["git", "grep", "-n", "trust_remote_code.*True", "--", "ondevice", "converters", "scripts"],
                          cwd=ROOT, capture_output=True, text=True)
    assert grep.returncode in (0, 1) and grep.stdout == "", grep.stdout


# -- Core ML packages that declare more than memory holds ----------------------------------------
def _package(tmp_path: Path, kind: str) -> Path:
    """A tiny iOS18 program saved as an .mlpackage, then made to declare a 2**20 × 2**20 value: a state
    (``state``), or a ``fill`` whose constant shape and declared output are edited in the protobuf (``fill``)."""
    ct = pytest.importorskip("coremltools")
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.mil import types

    n = 1 << 20
    x = mb.TensorSpec((1,), dtype=types.fp16)
    if kind == "state":
        @mb.program(input_specs=[mb.StateTensorSpec((n, n), dtype=types.fp16), x], opset_version=ct.target.iOS18)
        def prog(state, x):
            y = mb.slice_by_size(x=mb.read_state(input=state), begin=[0, 0], size=[1, 1])
            return mb.add(x=mb.reshape(x=y, shape=[1]), y=x)
    else:
        @mb.program(input_specs=[x], opset_version=ct.target.iOS18)
        def prog(x):
            y = mb.slice_by_size(x=mb.fill(shape=[2, 2], value=0.0, name="big"), begin=[0, 0], size=[1, 1])
            return mb.add(x=mb.reshape(x=mb.cast(x=y, dtype="fp16"), shape=[1]), y=x)
    model = ct.convert(prog, convert_to="mlprogram", minimum_deployment_target=ct.target.iOS18, skip_model_load=True,
                       pass_pipeline=ct.PassPipeline.EMPTY)
    spec = model.get_spec()
    if kind == "fill":
        fn = spec.mlProgram.functions["main"]
        for op in next(iter(fn.block_specializations.values())).operations:
            if op.type == "const" and op.outputs[0].name == "big_shape_0":
                op.attributes["val"].immediateValue.tensor.ints.values[:] = [n, n]
            if op.type == "fill":
                for d in op.outputs[0].type.tensorType.dimensions:
                    d.constant.size = n
    out = tmp_path / f"{kind}.mlpackage"
    ct.models.MLModel(spec, weights_dir=model.weights_dir, skip_model_load=True).save(str(out))
    return out


@pytest.mark.parametrize("kind", ["state", "fill"])
def test_mil_interpreter_refuses_declared_sizes_beyond_memory(tmp_path, kind):
    from ondevice.formats.mil import MILError, MILProgram

    package = _package(tmp_path, kind)
    what = "its states declare 2,199,023,255,552" if kind == "state" else "big is declared 4,398,046,511,104"
    with pytest.raises(MILError, match=rf"{kind}\.mlpackage: main: {what} bytes, more than this machine's"):
        MILProgram(package).new_state()


def test_atomic_writes_reach_the_disk_before_their_name(tmp_path, monkeypatch):
    """fsync of the data, then the rename, then fsync of the folder: a crash never leaves an empty file."""
    from ondevice import atomic

    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(atomic.os, "fsync", lambda fd: events.append(("fsync", os.path.realpath(f"/proc/self/fd/{fd}")
                                                                       if sys.platform == "linux" else fd))
                        or real_fsync(fd))
    monkeypatch.setattr(atomic.os, "replace", lambda a, b: events.append(("replace", str(b))) or real_replace(a, b))
    target = tmp_path / "kept.json"
    atomic.write_text(target, "{}")
    assert target.read_text() == "{}"
    assert [e[0] for e in events] == ["fsync", "replace", "fsync"]
    if sys.platform == "linux":
        assert events[0][1].startswith(str(tmp_path / ".kept.json.")) and events[2][1] == str(tmp_path)


# -- huge but self-consistent headers: the capped walk, never gguf.GGUFReader -----------------------------------
def _no_gguf_reader(monkeypatch):
    import gguf

    def refuse(*a, **k):
        raise AssertionError("gguf.GGUFReader was used (an object per array element: minutes on a huge header)")

    monkeypatch.setattr(gguf, "GGUFReader", refuse)


def test_info_and_pair_vocab_read_the_header_with_the_capped_walk(tiny_gguf, tmp_path, monkeypatch):
    """Before: ``ondevice info`` and the pair checks read a GGUF through ``gguf.GGUFReader``, which builds a Python
    object per array element (a header of a million merges: ~1 min on this machine, seconds with the walk). Now
    they read what they need with ``read_header`` / ``tensor_types``; the facts are the same as GGUFReader's."""
    import gguf

    from ondevice.formats.pairs import gguf_tokens
    from ondevice.store.info import describe

    model = tiny_gguf("llama")
    r = gguf.GGUFReader(str(model))
    want_types: dict[str, int] = {}
    for t in r.tensors:
        want_types[t.tensor_type.name] = want_types.get(t.tensor_type.name, 0) + 1
    field = r.fields["tokenizer.ggml.tokens"]
    want_tokens = [bytes(field.parts[i]).decode("utf-8", "replace") for i in field.data]
    _no_gguf_reader(monkeypatch)
    info = describe(model)
    assert info["tensor_types"] == want_types and info["vocab_size"] == len(want_tokens)
    assert info["arch"] == "llama" and info["quant"] == "Q8_0" and info["chat_template"] is True
    assert gguf_tokens(model) == want_tokens
    # a truncated file: still one line naming it (GGUFReader's mapping used to say so)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(model.read_bytes()[: model.stat().st_size // 2])
    with pytest.raises(OndeviceError, match=r"cut\.gguf: truncated"):
        describe(cut)


def test_a_crafted_token_id_in_tokenizer_json_is_refused_without_allocating(tmp_path):
    """Before: ``model_tokens`` made a list of max(token id) + 1 entries from a folder's tokenizer.json (an added
    token with id 2**40: memory until the machine gave out). Now ids beyond the vocabulary by more than the padding
    rows are one line naming the file (run in a child under a memory limit, so the old code fails by its error
    or the timeout instead of eating this machine's memory); an ordinary vocabulary with added tokens still
    reads."""
    from ondevice.formats.pairs import MAX_PADDING_ROWS, model_tokens

    def folder(name: str, added: list[dict]) -> Path:
        d = tmp_path / name
        d.mkdir()
        tj = {"model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "c": 2}}, "added_tokens": added}
        (d / "tokenizer.json").write_text(json.dumps(tj))
        return d

    ok = folder("ok", [{"id": 3, "content": "<s>"}, {"id": 4 + MAX_PADDING_ROWS, "content": "</s>"}])
    got = model_tokens(ok)
    assert got[:4] == ["a", "b", "c", "<s>"] and got[-1] == "</s>" and got[4] == "[PAD4]"
    cases = {"huge": ([{"id": 1 << 40, "content": "x"}], "token id 1099511627776 in a vocabulary of 4 tokens"),
             "holes": ([{"id": 4 + MAX_PADDING_ROWS, "content": "x"}], f"{MAX_PADDING_ROWS + 1} ids without"),
             "negative": ([{"id": -1, "content": "x"}], "not a non-negative integer"),
             "text": ([{"id": "7", "content": "x"}], "not a non-negative integer")}
    for name, (added, says) in cases.items():
        d = folder(name, added)
        code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))\n"
                "from ondevice.errors import OndeviceError\nfrom ondevice.formats.pairs import model_tokens\n"
                "try:\n    model_tokens(sys.argv[1])\nexcept OndeviceError as e:\n    print(e)\n")
        r = subprocess.run([sys.executable, "-P", "-c", code, str(d)], capture_output=True, text=True, timeout=60)
        out = r.stdout.strip()
        assert r.returncode == 0 and f"{name}/tokenizer.json" in out and says in out and "\n" not in out, (
            name, out, r.stderr[-300:])


# -- errors name files as the user knows them ---------------------------------------------------------------------
def test_errors_name_files_relative_to_the_working_directory_or_home(tmp_path, monkeypatch):
    """#41 item 11, relative names in errors: a model file's one-line error named it by its absolute path (here
    /tmp/pytest-…/work/models/bad.gguf, on a laptop /home/NAME/…). Now a file inside the working directory is
    named relative to it and one inside the home directory as ``~/…`` (store, formats, converters; the server
    then names either by its base name only)."""
    from typer.testing import CliRunner

    from converters.output import check_out
    from ondevice.cli.main import app
    from ondevice.errors import shown
    from ondevice.formats.pairs import model_tokens
    from ondevice.server.errors import local_names

    work, home = tmp_path / "work", tmp_path / "home"
    (work / "models").mkdir(parents=True)
    (home / "dl").mkdir(parents=True)
    monkeypatch.chdir(work)
    monkeypatch.setenv("HOME", str(home))
    bad_here = _gguf(work / "models" / "bad.gguf", _nested("a", 5000))
    bad_home = _gguf(home / "dl" / "bad.gguf", _nested("a", 5000))
    (home / "dl" / "hf").mkdir()
    (home / "out.txt").write_text("x")
    errors = []
    for call in (lambda: G.read_header(bad_here), lambda: G.read_header(bad_home), lambda: G.tensor_types(bad_home),
                 lambda: model_tokens(home / "dl" / "hf"), lambda: check_out(home / "out.txt")):
        with pytest.raises(OndeviceError) as e:
            call()
        errors.append(str(e.value))
    r = CliRunner().invoke(app, ["info", str(bad_home)])
    errors.append(r.output.strip())
    assert errors[0].startswith("models/bad.gguf: corrupt GGUF header"), errors[0]
    assert errors[1].startswith("~/dl/bad.gguf: corrupt GGUF header"), errors[1]
    assert errors[2].startswith("~/dl/bad.gguf:") and errors[3].startswith("~/dl/hf/tokenizer.json: missing")
    assert errors[4].startswith("~/out.txt: is a file") and "~/dl/bad.gguf: corrupt GGUF header" in errors[5]
    assert not any(str(tmp_path) in m or "\n" in m for m in errors), errors
    assert local_names(errors[1]).startswith("bad.gguf: corrupt")  # what a server's client reads
    assert [shown(p) for p in ("/elsewhere/x.gguf", "x.gguf", "smollm2-135m-instruct", work, home)] == [
        "/elsewhere/x.gguf", "x.gguf", "smollm2-135m-instruct", ".", "~"]
