"""What convert writes and says: an output folder that cannot be replaced fails before any work, a Core ML
check says what it compared, and the long Core ML step shows it is alive."""

from __future__ import annotations

import errno
import json
import os
import time
from pathlib import Path

import pytest

from ondevice.errors import OndeviceError


def test_convert_onto_an_unreplaceable_directory_fails_before_any_work(tiny_hf, tmp_path, monkeypatch, time_scale):
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
    assert "\n" not in str(e.value) and time.monotonic() - t0 < time_scale(10)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mnt"] and not any(out.iterdir())  # nothing written


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
