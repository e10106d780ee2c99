"""Verify-cheap formats: iq4_nl, GGUF → GGUF requantization and its quality cost, pull --quant variants."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from ondevice.errors import OndeviceError


def _cos(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def test_iq4_nl_writes_iq4_nl_tensors_that_track_f16(tiny_gguf):
    """Random tiny weights quantize coarsely at 4 bits, so iq4_nl is judged beside q4_0 (same bits, same
    block size) and against a control that compares unrelated positions."""
    from converters.quant_types import fallbacks, tensor_types
    from ondevice.backends.llama import LlamaBackend

    path = tiny_gguf("qwen2", "iq4_nl")
    types = tensor_types(path)
    assert sum(t == "IQ4_NL" for t in types.values()) >= 10 and fallbacks(types, "iq4_nl") == {}

    def logits(p, ids=None):
        b = LlamaBackend(p, n_ctx=256)
        ids = ids or b.tokenize("the model draft target token verify accept reject sample speculative " * 6)[:64]
        out = b.eval(ids)
        b.close()
        return ids, out

    ids, ref = logits(tiny_gguf("qwen2", "f16"))
    out = logits(path, ids)[1]
    q40 = logits(tiny_gguf("qwen2", "q4_0"), ids)[1]
    err, err_q40 = np.abs(out - ref).mean(), np.abs(q40 - ref).mean()
    print(f"iq4_nl vs f16: mean cos {_cos(out, ref).mean():.3f}, mean |Δ| {err:.4f} (q4_0: {err_q40:.4f})")
    assert err <= 1.25 * err_q40  # as close to f16 as q4_0 is
    assert _cos(out, ref).mean() >= 0.85
    assert _cos(out, ref).mean() > _cos(np.roll(out, 1, axis=0), ref).mean() + 0.2  # control: tracks position by position
    assert err > 1e-3  # really quantized


def test_requantize_measures_quality_and_refuses_stacking_without_consent(tiny_gguf, tmp_path):
    from converters import convert

    q8 = tiny_gguf("qwen2", "q8_0")
    with pytest.raises(OndeviceError, match="already quantized.*--allow-requantize"):
        convert(q8, to="gguf", quant="q4_0", out=tmp_path / "refused", progress=False)
    assert not (tmp_path / "refused").exists()  # nothing half-written
    s = convert(q8, to="gguf", quant="iq4_nl", out=tmp_path / "iq4", allow_requantize=True, progress=False)
    assert s["requantized"] and "stacks a second quantization" in s["warning"]
    assert s["tensor_types"].get("IQ4_NL", 0) >= 10
    q = s["quality"]
    assert 0.2 <= q["top1_agreement"] < 1.0 and q["mean_kl"] > 0 and q["tokens"] >= 64  # 4-bit random weights: coarse
    m = json.loads((tmp_path / "iq4" / "model.gguf").with_name("manifest.json").read_text())
    assert m["quality"] == q and len(m["source_sha256"]) == 64
    # from f16 no consent is needed, and the quality is near-perfect against its own source
    s16 = convert(tiny_gguf("qwen2", "f16"), to="gguf", quant="q8_0", out=tmp_path / "q8", progress=False)
    assert s16["warning"] is None and s16["quality"]["top1_agreement"] >= 0.85
    assert s16["quality"]["mean_kl"] < q["mean_kl"]  # 8-bit from f16 loses less than 4-bit stacked on 8-bit


def test_requantize_refuses_or_warns_on_a_low_bit_source(tiny_gguf, tmp_path):
    from converters import convert

    q4 = tiny_gguf("qwen2", "q4_0")
    with pytest.raises(OndeviceError, match="already 4.* bits per weight.*grow the file.*original f16"):
        convert(q4, to="gguf", quant="q8_0", out=tmp_path / "q8", allow_requantize=True, progress=False)
    assert not (tmp_path / "q8").exists()
    s = convert(q4, to="gguf", quant="iq4_nl", out=tmp_path / "iq4", allow_requantize=True, progress=False)
    assert "already low-bit" in s["warning"] and s["quality"]["mean_kl"] > 0


def test_requantize_cli_prints_the_warning_and_quality(tiny_gguf, tmp_path):
    r = subprocess.run([sys.executable, "-P", "-m", "ondevice", "convert", str(tiny_gguf("llama", "q8_0")), "--to", "gguf",
                        "--quant", "q4_0", "--out", str(tmp_path / "o"), "--allow-requantize"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "warning:" in r.stderr and "top-1 agreement" in r.stderr and "mean KL" in r.stderr
    r = subprocess.run([sys.executable, "-P", "-m", "ondevice", "convert", str(tiny_gguf("llama", "q8_0")), "--to", "gguf",
                        "--quant", "q4_0", "--out", str(tmp_path / "p")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "--allow-requantize" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_pull_quant_makes_a_recorded_local_variant(tiny_gguf, tiny_catalog, monkeypatch):
    """A local variant is cached beside the published file, recorded with its sha256, never resolved as it."""
    from converters.variants import pull_variant
    from ondevice.store import catalog, lookup
    from ondevice.store.fetch import sha256_file

    src = tiny_gguf("llama", "q8_0")
    try:
        entry = tiny_catalog(src, arch="llama", quant="Q8_0")
        with pytest.raises(OndeviceError, match="pull tiny --quant q4_0"):
            lookup.resolve("tiny:q4_0")
        import converters.quantize as cq

        def interrupted(*a, **k):  # Ctrl-C while the variant's quality is measured
            raise KeyboardInterrupt

        with monkeypatch.context() as m:
            m.setattr(cq, "quality", interrupted)
            with pytest.raises(KeyboardInterrupt):
                pull_variant("tiny", "q4_0", quiet=True)
        # review: the variant used to be renamed into place before it was measured and recorded
        assert sorted(f.name for f in catalog.cached_path(entry).parent.iterdir()) == ["tiny.gguf", "tiny.gguf.verified"]
        path = pull_variant("tiny", "q4_0", quiet=True)
        from ondevice.store.info import describe

        assert describe(path)["verified"].startswith("local requantization of tiny.gguf (not the published file)")
        assert path.parent == catalog.cached_path(entry).parent and path != catalog.cached_path(entry)
        rec = json.loads(path.with_suffix(".json").read_text())
        assert rec["published"] is False and rec["source_sha256"] == entry.sha256 and rec["sha256"] == sha256_file(path)
        assert 0 < rec["quality"]["top1_agreement"] <= 1 and rec["quality"]["mean_kl"] > 0
        assert lookup.resolve("tiny") == catalog.cached_path(entry)  # the name still means the published file
        assert lookup.resolve("tiny:q4_0") == path
        mtime = path.stat().st_mtime_ns
        assert pull_variant("tiny", "q4_0", quiet=True) == path and path.stat().st_mtime_ns == mtime  # cached
        path.write_bytes(path.read_bytes()[:-10])  # damaged: no longer resolves
        with pytest.raises(OndeviceError, match="no local q4_0 variant"):
            lookup.resolve("tiny:q4_0")
    finally:
        catalog.catalog.cache_clear()
