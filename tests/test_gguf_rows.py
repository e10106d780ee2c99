"""``TableRows``: selected rows of a quantized GGUF matrix equal the same rows of the whole matrix dequantized."""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from ondevice.formats.gguf_rows import TableRows  # noqa: E402


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "F16"])
def test_rows_match_whole_table(tmp_path, qtype):
    qt = getattr(gguf.GGMLQuantizationType, qtype)
    table = np.random.default_rng(0).standard_normal((12, 64)).astype(np.float32)
    data = gguf.quants.quantize(table, qt)
    path = tmp_path / "t.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("token_embd.weight", data, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    t = next(x for x in gguf.GGUFReader(str(path)).tensors if x.name == "token_embd.weight")
    rows = TableRows(t)
    whole = np.asarray(gguf.quants.dequantize(np.asarray(t.data), t.tensor_type), np.float32).reshape(12, 64)
    assert rows.shape == (12, 64)
    np.testing.assert_array_equal(rows[[3, 0, 11]], whole[[3, 0, 11]])
    np.testing.assert_array_equal(rows[np.array([[1, 2], [2, 1]])], whole[np.array([[1, 2], [2, 1]])])
    assert np.abs(whole - table).max() < 0.3  # the quantized table is the one written (Q4_0: 16 levels on ±3)
    empty = rows[[]]  # gguf-py's block dequantizers fail on zero rows: answered without them
    assert empty.shape == (0, 64) and empty.dtype == np.float32
