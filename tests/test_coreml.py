"""Core ML drafts: the package checked through its spec (any OS), its own program run by the MIL
interpreter (any OS) against mlx-lm and the numpy reference, the host bookkeeping inside the real loop,
prediction on macOS."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from helpers import PROMPT, mlx_float32, mlx_logits

import ondevice
from converters.coreml import describe_package, open_source
from ondevice.backends import open_backend
from ondevice.backends.llama import LlamaBackend
from ondevice.backends.mil import MILBackend
from ondevice.backends.static import ReferenceBackend, plan
from ondevice.drafters import ModelDrafter
from ondevice.errors import OndeviceError
from ondevice.formats.decoder import DecoderConfig, ReferenceDecoder
from ondevice.formats.mil import MILError, MILProgram
from ondevice.formats.mil_check import check_package, read_config
from ondevice.runtime import Runtime

CTX = 128


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_package_spec(tiny_hf, tiny_coreml, arch):
    cfg = DecoderConfig.from_hf(json.loads((tiny_hf[arch] / "config.json").read_text()))
    d = describe_package(tiny_coreml(arch) / "model.mlpackage")
    assert d["default_function"] == "decode" and set(d["functions"]) == {"decode", "prefill"}
    kv = ["fp16", [cfg.n_kv_heads, CTX, cfg.head_dim]]
    for name, s in (("decode", 1), ("prefill", 64)):
        f = d["functions"][name]
        assert f["inputs"] == {"input_ids": ["int32", [1, s]], "position": ["int32", [1]]}
        assert f["outputs"] == {"logits": ["fp32", [1, s, cfg.vocab_size]]}
        assert f["states"] == {f"{kind}_cache_{i}": kv for i in range(cfg.n_layers) for kind in ("k", "v")}
        # every weight matrix (7 per layer, embedding, head) is int4 in blocks of 32; RoPE tables stay fp16
        assert f["weights"] == {"int4-block32": 7 * cfg.n_layers + 2, "fp16": 2}
        ops = f["ops"]
        assert ops["linear"] == 7 * cfg.n_layers + 1 and ops["softmax"] == cfg.n_layers
        assert ops["slice_update"] == ops["coreml_update_state"] == ops["read_state"] == 2 * cfg.n_layers
        assert ops["rsqrt"] == 2 * cfg.n_layers + 1


def test_palettized_package(tiny_coreml):
    f = describe_package(tiny_coreml("qwen2", "palettize4") / "model.mlpackage")["functions"]["decode"]
    assert f["weights"] == {"lut4": 16, "fp16": 2}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_numpy_reference_matches_mlx_lm(tiny_hf, arch):
    """The description the MIL graph is generated from, run in numpy, is the model mlx-lm runs."""
    ids = np.random.default_rng(0).integers(0, 512, 40).tolist()
    ref = ReferenceDecoder.from_checkpoint(tiny_hf[arch], context=64)
    ours = np.concatenate([ref.run(ids[:17], 0), ref.run(ids[17:18], 17), ref.run(ids[18:], 18)])
    theirs = mlx_logits(mlx_float32(tiny_hf[arch])[0], ids)
    assert np.abs(ours - theirs).max() < 1e-3 * np.abs(theirs).max()
    assert (ours.argmax(-1) == theirs.argmax(-1)).all()


def test_gguf_source_matches_llama_cpp(tiny_gguf):
    """A GGUF source (llama: Q/K rows un-permuted) gives the reference the same model llama.cpp runs."""
    path = tiny_gguf("llama", "q8_0")
    cfg, w, _, _ = open_source(path)
    ref = ReferenceDecoder(cfg, w, context=64)
    b = LlamaBackend(path, n_ctx=64)
    ids = b.tokenize(PROMPT * 3)[:32]
    theirs = b.eval(ids)
    b.close()
    ours = ref.run(ids, 0)
    assert (ours.argmax(-1) == theirs.argmax(-1)).mean() >= 0.9
    assert np.abs(ours - theirs).max() < 0.05 * np.abs(theirs).max()


def test_fp16_graph_survives_real_activation_outliers(smollm2, monkeypatch):
    """SmolLM2's residual stream reaches |x| ≈ 2.5e4, whose square is not an fp16 number. The shared
    RMSNorm divides by max|x| first: simulated in fp16 (every op rounded as the Core ML graph stores it)
    it keeps the float32 argmax; the textbook formula, same simulation, loses it (the planted control)."""
    import ondevice.formats.decoder as dec

    path = smollm2 if smollm2.is_file() else next(smollm2.glob("*.gguf"))
    cfg, w, _, _ = open_source(path)
    b = LlamaBackend(path, n_ctx=64)
    ids = b.tokenize(PROMPT * 8)[:48]
    b.close()
    exact = ReferenceDecoder(cfg, w, 64).run(ids, 0)
    half = ReferenceDecoder(cfg, w, 64, fp16=True).run(ids, 0)
    assert np.isfinite(half).all() and (half.argmax(-1) == exact.argmax(-1)).mean() >= 0.95

    def textbook(ops, x, weight, eps):
        return ops.mul(ops.mul(x, ops.rsqrt(ops.add(ops.mean(ops.mul(x, x)), eps))), weight)

    monkeypatch.setattr(dec, "rms_norm", textbook)
    broken = ReferenceDecoder(cfg, w, 64, fp16=True).run(ids, 0)
    assert (broken.argmax(-1) == exact.argmax(-1)).mean() < 0.5


def test_plan_positions():
    assert plan(0, 10, 64, 128) == [("prefill", 0, 10)]
    assert plan(5, 3, 64, 128) == [("decode", 0, 1), ("decode", 1, 1), ("decode", 2, 1)]
    assert plan(0, 130, 64, 256) == [("prefill", 0, 64), ("prefill", 64, 64), ("decode", 128, 1), ("decode", 129, 1)]
    # a padded prefill must fit the cache: near the end, single decodes
    assert plan(60, 8, 64, 128) == [("prefill", 0, 8)]
    assert plan(70, 8, 64, 128) == [("decode", i, 1) for i in range(8)]


def test_rollback_moves_the_write_position(tiny_hf):
    """Write, roll back, overwrite with other tokens (padded prefill and decodes): the logits equal a
    fresh pass over the final sequence, so stale and padding slots are never read."""
    b = ReferenceBackend(tiny_hf["qwen2"], context=CTX, chunk=16)
    rng = np.random.default_rng(3)
    a, c, d = (rng.integers(0, 512, n).tolist() for n in (10, 3, 6))
    b.eval(a)  # padded prefill: slots 10..15 hold padding
    b.eval(c)  # decodes at 10, 11, 12
    b.rollback(7)
    assert b.n_past == 7
    got = b.eval(d)  # padded prefill at 7..12 over stale slots
    assert b.n_past == 13
    fresh = ReferenceDecoder.from_checkpoint(tiny_hf["qwen2"], context=CTX).run(a[:7] + d, 0)[7:]
    assert np.abs(got - fresh).max() < 1e-4
    with pytest.raises(ValueError):
        b.rollback(14)
    with pytest.raises(OndeviceError, match="context overflow"):
        b.eval(list(range(CTX)))
    with pytest.raises(OndeviceError, match="reconvert with --context 4096"):
        ReferenceBackend(tiny_hf["qwen2"], context=CTX, n_ctx=4096)


def _runtime(target, draft):
    vocab = target.vocab_size
    return Runtime(target, ModelDrafter(draft, vocab, vocab), vocab_limit=vocab, load_seconds=0.0)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_static_cache_draft_in_the_loop(tiny_gguf, tiny_hf, arch):
    """The Core ML host code as a draft beside a llama.cpp target: greedy output equals plain decoding."""
    target_path = tiny_gguf(arch)
    with ondevice.load(target_path, drafter="none", n_ctx=CTX) as rt:
        ref = rt.generate(PROMPT, max_tokens=48, temperature=0, gamma=0)
    rt = _runtime(LlamaBackend(target_path, n_ctx=CTX), ReferenceBackend(tiny_hf[f"{arch}_draft"], context=CTX, chunk=8))
    with rt:
        for gamma in (1, 4):
            res = rt.generate(PROMPT, max_tokens=48, temperature=0, gamma=gamma)
            assert res.tokens == ref.tokens, f"gamma={gamma}"
            assert 0 < res.stats.accepted < res.stats.drafted


def test_static_cache_draft_equal_to_target_accepts_everything(tiny_hf):
    """Target and draft: the same reference model. Any slip in positions or rollback would reject a draft."""
    path = tiny_hf["llama"]
    rt = _runtime(ReferenceBackend(path, context=CTX, chunk=8), ReferenceBackend(path, context=CTX, chunk=8))
    with rt:
        for _ in range(2):  # the second request rolls both caches back to the shared prefix
            res = rt.generate(PROMPT, max_tokens=40, temperature=0, gamma=3)
            assert res.stats.acceptance_rate == 1.0 and res.stats.drafted > 0


@pytest.mark.skipif(sys.platform == "darwin", reason="checks the error shown off macOS")
def test_coreml_off_macos_is_a_clear_error(tiny_coreml, tiny_gguf):
    with pytest.raises(OndeviceError, match="Core ML runs on macOS only"):
        open_backend(tiny_coreml("llama"), n_ctx=CTX)
    r = subprocess.run([sys.executable, "-P", "-m", "ondevice", "generate", str(tiny_gguf("llama")), "-p", "hi", "--draft",
                        str(tiny_coreml("llama") / "model.mlpackage")], capture_output=True, text=True)
    assert r.returncode == 2 and "Core ML runs on macOS only" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_convert_cli_from_gguf_and_bad_options(tiny_gguf, tmp_path):
    src = tiny_gguf("qwen2", "q8_0")
    r = subprocess.run([sys.executable, "-P", "-m", "ondevice", "convert", str(src), "--to", "coreml", "--out",
                        str(tmp_path / "c"), "--context", "32", "--compress", "none", "--json"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["context"] == 32 and summary["prefill_chunk"] == 32 and summary["quant"] == "none"
    assert {"tokenizer.json", "config.json", "manifest.json", "model.mlpackage"} <= {p.name for p in (tmp_path / "c").iterdir()}
    f = describe_package(tmp_path / "c" / "model.mlpackage")["functions"]["prefill"]
    assert f["weights"] == {"fp16": 16 + 2}
    info = json.loads(subprocess.run([sys.executable, "-P", "-m", "ondevice", "info", str(tmp_path / "c"), "--json"],
                                     capture_output=True, text=True, check=True).stdout)
    assert info["format"] == "coreml" and info["context_length"] == 32 and info["functions"] == ["decode", "prefill"]
    bad = subprocess.run([sys.executable, "-P", "-m", "ondevice", "convert", str(src), "--to", "coreml", "--out",
                          str(tmp_path / "d"), "--compress", "int3"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--compress int3" in bad.stderr
    assert not (tmp_path / "d").exists() and not list(tmp_path.glob(".d.*"))


def test_missing_tokenizer_and_manifest_are_one_line_errors(tiny_hf, tiny_coreml, tmp_path):
    import shutil

    src = shutil.copytree(tiny_hf["llama"], tmp_path / "hf")
    (src / "tokenizer.json").unlink()
    r = subprocess.run([sys.executable, "-P", "-m", "ondevice", "convert", str(src), "--to", "coreml", "--out", str(tmp_path / "c")],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "tokenizer.json: missing" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "c").exists()
    pkg = shutil.copytree(tiny_coreml("llama"), tmp_path / "pkg")
    (pkg / "manifest.json").unlink()
    r = subprocess.run([sys.executable, "-P", "-m", "ondevice", "info", str(pkg)], capture_output=True, text=True)
    assert r.returncode == 2 and "manifest.json: missing or unreadable" in r.stderr and "reconvert" in r.stderr


# -- the saved program, run by the MIL interpreter (any OS) ----------------------------------------


def _interpreted(backend, ids):
    """Prefill 64, a padded prefill of 6, then single-token decodes: both functions, one shared state."""
    return np.concatenate([backend.eval(ids[:64]), backend.eval(ids[64:70]), *[backend.eval([t]) for t in ids[70:]]])


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_interpreted_program_matches_mlx_lm(tiny_hf, tiny_coreml, arch):
    """--compress none: the package's prefill + decode, interpreted in the fp16 it declares, is the model
    mlx-lm runs in float32; the few top-1 misses are near-ties smaller than the fp16 error."""
    model = mlx_float32(tiny_hf[arch])[0]
    got, ref = [], []
    for seed in range(3):
        ids = np.random.default_rng(seed).integers(0, 512, 100).tolist()
        got.append(_interpreted(MILBackend(tiny_coreml(arch, "none"), n_ctx=CTX), ids))
        ref.append(mlx_logits(model, ids))
    got, ref = np.concatenate(got), np.concatenate(ref)
    err = np.abs(got - ref).max()
    assert err < 0.02 * np.abs(ref).max()  # fp16 storage of every value, 2 layers deep
    assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.98
    top2 = np.sort(ref, -1)[:, -2:]
    missed = got.argmax(-1) != ref.argmax(-1)
    assert (top2[missed, 1] - top2[missed, 0] < 2 * err).all()


@pytest.mark.parametrize("arch,compress", [("llama", "int4"), ("qwen2", "int4"), ("qwen2", "palettize4")])
def test_compressed_program_matches_reference_on_its_own_weights(tiny_coreml, arch, compress):
    """int4 / palettized: the hand-written decompression equals coremltools' own, and the interpreted
    program equals the numpy reference run on the package's decompressed weights; the converter ran the
    same check and recorded it."""
    d = tiny_coreml(arch, compress)
    report = check_package(d / "model.mlpackage", read_config(d), context=CTX, chunk=64, n_decode=30)
    assert report["decompressed_ops_checked"] >= 2 * (7 * 2 + 1)  # every weight, in both functions
    assert report["tokens"] == 94 and report["top1"] >= 0.98 and report["max_rel_err"] < 0.02
    verified = json.loads((d / "manifest.json").read_text())["verified"]
    assert verified["check"].startswith("mil-interpreter") and verified["top1"] >= 0.9


@pytest.mark.parametrize("op", ["blockwise_shift_scale", "lut_to_dense"])
def test_decompression_check_catches_a_wrong_decompression(tiny_coreml, monkeypatch, op):
    """Negative control of the comparison with coremltools: a 1 % error in either decompression fails it."""
    import ondevice.formats.mil as mil

    real = getattr(mil, op)
    monkeypatch.setattr(mil, op, lambda *a: real(*a) * np.float16(1.01))
    with pytest.raises(MILError, match="decompresses differently from coremltools"):
        MILProgram(tiny_coreml("qwen2", "palettize4") / "model.mlpackage").check_decompression()


def test_interpreted_state_rollback_equals_fresh_run(tiny_coreml):
    """Prefill 64, decode 10, roll back 5, decode 5 others == a fresh run of the final sequence, bit for bit
    (logits and the states' written slots); past the context is refused, by the host and by the program."""
    path = tiny_coreml("qwen2")
    rng = np.random.default_rng(7)
    a, b, c = (rng.integers(0, 512, n).tolist() for n in (64, 10, 5))
    m = MILBackend(path, n_ctx=CTX)
    m.eval(a)
    before = np.concatenate([m.eval([t]) for t in b])
    m.rollback(69)
    got = np.concatenate([m.eval([t]) for t in c])
    f = MILBackend(path, n_ctx=CTX)
    f.eval(a)
    for t in b[:5]:
        f.eval([t])
    fresh = np.concatenate([f.eval([t]) for t in c])
    assert np.array_equal(got, fresh) and not np.allclose(got, before[5:], atol=1e-2)  # the rewrite mattered
    for name in m.state:
        assert np.array_equal(m.state[name][:, :74], f.state[name][:, :74])
    with pytest.raises(OndeviceError, match="context overflow"):
        m.eval(list(range(CTX)))
    with pytest.raises(MILError, match="cannot be evaluated"):  # the program itself has no slot 128
        m.program.run("decode", {"input_ids": np.ones((1, 1)), "position": np.array([CTX])}, m.program.new_state())


@pytest.mark.parametrize("bug", ["transpose", "write_window"])
def test_planted_graph_bug_fails_the_interpreter_check(tiny_hf, tmp_path, monkeypatch, bug):
    """The converter's own check is the negative control: a graph-builder bug is a one-line error and
    leaves no output directory."""
    import converters.coreml as cc
    from converters import convert

    write = cc.MILOps.cache_write

    def split_heads(self, x, n, d):  # a transpose over the wrong axes: identical for one token, not for 32
        return self.mb.transpose(x=self.mb.reshape(x=x, shape=[n, self.s, d]), perm=[0, 1, 2])

    def cache_write(self, layer, k, v, position):  # the state write window one slot late
        return write(self, layer, k, v, self.mb.add(x=position, y=np.int32(1)))

    if bug == "transpose":
        monkeypatch.setattr(cc.MILOps, "split_heads", split_heads)
    else:
        monkeypatch.setattr(cc.MILOps, "cache_write", cache_write)
    with pytest.raises(OndeviceError, match="disagrees with the reference decoder") as e:
        convert(tiny_hf["qwen2"], to="coreml", out=tmp_path / "c", context=96, compress="none", progress=False)
    assert "\n" not in str(e.value) and not list(tmp_path.iterdir())


def test_interpreted_coreml_draft_in_the_loop(tiny_gguf, tiny_coreml, tmp_path):
    """A Core ML draft, interpreted (draft_device='mil'), beside a llama.cpp target: greedy output equals
    plain decoding, through the API (fixed γ) and the CLI (γ auto: the cost probe runs the draft too)."""
    target, draft = tiny_gguf("llama"), tiny_coreml("llama_draft")
    with ondevice.load(target, drafter="none", n_ctx=CTX) as rt:
        ref = rt.generate(PROMPT, max_tokens=40, temperature=0, gamma=0)
    with ondevice.load(target, draft, n_ctx=CTX, draft_device="mil") as rt:
        assert isinstance(rt.drafter.backend, MILBackend)
        for gamma in (1, 4):
            res = rt.generate(PROMPT, max_tokens=40, temperature=0, gamma=gamma)
            assert res.tokens == ref.tokens, f"gamma={gamma}"
            assert 0 < res.stats.accepted < res.stats.drafted
    r = subprocess.run([sys.executable, "-P", "-m", "ondevice", "generate", str(target), "-p", PROMPT, "--max-tokens", "24",
                        "--temperature", "0", "--draft", str(draft), "--draft-device", "mil", "--json",
                        "--n-ctx", str(CTX)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["tokens"] == ref.tokens[:24]
    with pytest.raises(OndeviceError, match="device='mil' runs Core ML packages only"):
        open_backend(target, n_ctx=CTX, device="mil")


@pytest.mark.slow
def test_smollm2_coreml_interpreted_agrees_with_llama_cpp(smollm2, tmp_path):
    """SmolLM2 → Core ML (fp16, --compress none) → the interpreter, teacher-forced on README text vs
    llama.cpp on the Q4_1 GGUF it came from (~3 min and 2.2 GB to convert and check). Measured: 0.958, the
    same as the float32 numpy reference on the GGUF weights; an int4 package gets 0.53 (the re-quantization
    of Q4_1 / Q8_0 weights to symmetric int4, not the graph: the interpreter equals the reference on them)."""
    from pathlib import Path

    from converters import convert

    path = smollm2 if smollm2.is_file() else next(smollm2.glob("*.gguf"))
    convert(path, to="coreml", out=tmp_path / "cm", compress="none", progress=False)
    lb = LlamaBackend(path, n_ctx=512)
    ids = lb.tokenize((Path(__file__).parent.parent / "README.md").read_text())[:97]
    ref = lb.eval(ids)
    lb.close()
    got = MILBackend(tmp_path / "cm", n_ctx=512).eval(ids)
    agree = float((got[:-1].argmax(-1) == ref[:-1].argmax(-1)).mean())
    print(f"SmolLM2 Core ML (fp16, interpreted) vs llama.cpp teacher-forced top-1 over 96 tokens: {agree:.3f}")
    assert agree >= 0.93


# -- macOS 15+: Core ML's own runtime -------------------------------------------------------------


@pytest.mark.macos
def test_coreml_logits_match_numpy_reference(tiny_hf, tiny_coreml):
    from ondevice.backends.coreml import CoreMLBackend

    for compress, min_top1 in (("none", 0.95), ("int4", 0.8)):
        b = CoreMLBackend(tiny_coreml("qwen2", compress), n_ctx=CTX)
        ids = np.random.default_rng(5).integers(0, 512, 40).tolist()
        got = np.concatenate([b.eval(ids[:20]), b.eval(ids[20:22]), b.eval(ids[22:])])
        ref = ReferenceDecoder.from_checkpoint(tiny_hf["qwen2"], context=CTX).run(ids, 0)
        assert (got.argmax(-1) == ref.argmax(-1)).mean() >= min_top1, compress
        if compress == "none":  # fp16 compute vs float32
            assert np.abs(got - ref).max() < 0.05 * np.abs(ref).max()
        b.close()


@pytest.mark.macos
def test_coreml_runtime_matches_the_interpreter(tiny_coreml):
    """Core ML's runtime and the MIL interpreter on the same package: logits and the shared state after a
    prefill, decodes and a rollback (fp16 on both sides; the Neural Engine accumulates differently)."""
    from ondevice.backends.coreml import CoreMLBackend

    path = tiny_coreml("qwen2")
    c, m = CoreMLBackend(path, n_ctx=CTX, plan_devices=True), MILBackend(path, n_ctx=CTX)
    ids = np.random.default_rng(9).integers(0, 512, 84).tolist()
    for part in (ids[:64], *[[t] for t in ids[64:74]]):
        got, want = c.eval(part), m.eval(part)
        assert np.abs(got - want).max() < 0.05 * np.abs(want).max()
    c.rollback(69)
    m.rollback(69)
    got = np.concatenate([c.eval([t]) for t in ids[79:84]])
    want = np.concatenate([m.eval([t]) for t in ids[79:84]])
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.8
    if hasattr(c.state, "read_state"):
        for name, ours in m.state.items():
            theirs = c.read_state(name).reshape(ours.shape)[:, :74].astype(np.float32)
            assert np.abs(theirs - ours[:, :74]).max() < 0.05 * np.abs(ours[:, :74]).max() + 1e-3, name
    assert c.op_devices is None or set(c.op_devices) == {"decode", "prefill"}
    c.close()


@pytest.mark.macos
def test_coreml_draft_keeps_the_neural_engine(tiny_gguf, tiny_coreml):
    """A Core ML draft stays on CPU_AND_NE whatever device the target asks for."""
    with ondevice.load(tiny_gguf("llama"), tiny_coreml("llama_draft"), n_ctx=CTX, device="cpu") as rt:
        assert rt.drafter.backend.compute_units == "CPU_AND_NE"


@pytest.mark.macos
def test_greedy_equality_with_coreml_draft(tiny_gguf, tiny_coreml):
    target = tiny_gguf("llama")
    with ondevice.load(target, drafter="none", n_ctx=CTX) as rt:
        ref = rt.generate(PROMPT, max_tokens=48, temperature=0, gamma=0)
    with ondevice.load(target, tiny_coreml("llama_draft"), n_ctx=CTX) as rt:
        for gamma in (1, 4):
            res = rt.generate(PROMPT, max_tokens=48, temperature=0, gamma=gamma)
            assert res.tokens == ref.tokens and res.stats.drafted > 0
