"""A tiny random-weight reranker GGUF for tests: a Qwen3 GGUF given llama.cpp's rank pooling and a classifier
head (``cls.output``: 2 rows, labels yes / no, the shape of a converted Qwen3-Reranker) and a rerank prompt
template (``tokenizer.chat_template.rerank`` with ``{query}`` / ``{document}``)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np

RERANK_TEMPLATE = "<|im_start|>user\n<Query>: {query}\n<Document>: {document}<|im_end|>\n<|im_start|>assistant\n"


def add_rank_head(src: str | Path, out: str | Path, *, seed: int = 0,
                  template: str | None = RERANK_TEMPLATE) -> Path:
    """Write ``out``: the GGUF ``src`` (a Qwen3 one) with pooling 'rank', a random 2-row ``cls.output`` and
    the rerank ``template`` (None: none, so pairs are joined with the vocabulary's separators).

    Args:
        src: a Qwen3 GGUF (llama.cpp reads ``cls.output`` for qwen3 and softmaxes its 2 outputs).
        out: the reranker GGUF to write (atomically).
        seed: the classifier head's random seed.
        template: the ``tokenizer.chat_template.rerank`` metadata, or None.

    Returns:
        ``out``.
    """
    import gguf

    r = gguf.GGUFReader(str(src))
    arch = str(r.fields[gguf.Keys.General.ARCHITECTURE].contents())
    if arch != "qwen3":
        raise ValueError(f"{src}: add_rank_head needs a qwen3 GGUF, got {arch!r}")
    n_embd = int(r.fields[f"{arch}.embedding_length"].contents())
    head = np.random.default_rng(seed).normal(0.0, 1.0 / np.sqrt(n_embd), (2, n_embd)).astype(np.float32)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    os.close(fd)
    try:  # a temp file beside it, renamed when whole
        w = gguf.GGUFWriter(tmp, arch)
        for f in r.fields.values():
            if f.name == gguf.Keys.General.ARCHITECTURE or f.name.startswith("GGUF."):
                continue
            vtype = f.types[0]
            w.add_key_value(f.name, f.contents(), vtype,
                            sub_type=f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
        w.add_key_value(f"{arch}.pooling_type", int(gguf.PoolingType.RANK), gguf.GGUFValueType.UINT32)
        w.add_key_value(f"{arch}.classifier.output_labels", ["yes", "no"], gguf.GGUFValueType.ARRAY,
                        sub_type=gguf.GGUFValueType.STRING)
        if template is not None:
            w.add_key_value("tokenizer.chat_template.rerank", template, gguf.GGUFValueType.STRING)
        for t in r.tensors:
            w.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
        w.add_tensor_info("cls.output.weight", head.shape, head.dtype, head.nbytes, gguf.GGMLQuantizationType.F32)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for t in r.tensors:
            w.write_tensor_data(t.data, tensor_endianess=r.endianess)
        w.write_tensor_data(head)
        w.close()
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out
