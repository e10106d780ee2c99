"""HF checkpoint → GGUF (f16, q8_0, q4_0, q4_k_m), with a manifest and a report of fallbacks."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

from converters.gguf_writer import write_gguf
from converters.hf import open_checkpoint
from converters.output import write_manifest
from converters.quant_types import fallbacks, tensor_types
from converters.quantize import llama_quantize
from converters.tokenizer import read_hf_vocab
from ondevice.errors import shown


def hf_to_gguf(src: Path, out: Path, *, quant: str = "q4_k_m", progress: bool = True, output_type: str | None = None,
               embedding_type: str | None = None) -> dict:
    """Write ``out/model.gguf`` and ``out/manifest.json``; return the summary (``output_type``,
    ``embedding_type``: tensor types for those two tensors, ``converters.quantize.llama_quantize``)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    t0 = time.perf_counter()
    ckpt = open_checkpoint(src)
    vocab = read_hf_vocab(ckpt.path, ckpt.vocab_size, ckpt.config)
    final = out / "model.gguf"
    f16 = final if quant == "f16" else out / "model-f16.gguf.tmp"
    names = [n for n in ckpt.tensor_names() if not n.endswith("rotary_emb.inv_freq")]
    cols = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn())
    with Progress(*cols, console=Console(stderr=True), disable=not progress, transient=True) as bar:
        task = bar.add_task(f"gguf {src.name}", total=len(names))
        counts = write_gguf(ckpt, vocab, f16, on_tensor=lambda n: bar.update(task, advance=1, description=f"gguf {n}"))
        if quant != "f16":
            bar.update(task, description=f"quantize {quant} (llama.cpp)")
            llama_quantize(f16, final, quant, output_type=output_type, embedding_type=embedding_type, name=shown(src))
            f16.unlink()
    types = tensor_types(final)
    n_params = sum(counts.values())
    size = final.stat().st_size
    summary = {
        "format": "gguf",
        "quant": quant,
        "arch": ckpt.arch,
        "path": final.name,
        "size_bytes": size,
        "n_params": n_params,
        "bits_per_weight": round(size * 8 / n_params, 3),
        "tensor_types": dict(Counter(types.values())),
        "output_type": output_type,
        "embedding_type": embedding_type,
        "fallbacks": fallbacks(types, quant, {t.upper() for t in (output_type, embedding_type) if t}),
        "seconds": round(time.perf_counter() - t0, 3),
    }
    write_manifest(out, {
        "source": str(Path(src).resolve()),
        "source_sha256": ckpt.source_sha256(),
        "format": "gguf",
        "quant": quant,
        "output_type": output_type,
        "embedding_type": embedding_type,
        "arch": ckpt.arch,
        "vocab_size": len(vocab.tokens),
        "vocab_sha256": vocab.sha256(),
        "tensor_types": types,
    })
    return summary
