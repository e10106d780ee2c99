"""Writing an f16 GGUF from an HF checkpoint with ``gguf`` (``converters.quantize`` quantizes it)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

from converters.archs import arch_of, gguf_tensors, write_hparams
from converters.hf import HFCheckpoint
from converters.tokenizer import Vocab
from ondevice.errors import OndeviceError, shown


def write_gguf(
    ckpt: HFCheckpoint, vocab: Vocab, out: Path, *, on_tensor: Callable[[str], None] | None = None
) -> dict[str, int]:
    """Write ``ckpt`` as an F16 GGUF (norms and biases F32) at ``out``, one tensor at a time.

    The header (every tensor's name, shape and type) is written from the safetensors headers first; then
    each tensor is read, converted and written before the next is read, so memory stays at one tensor
    whatever the model's size (``gguf.GGUFWriter.add_tensor`` would hold them all until the end).

    Returns:
        Parameter count per GGUF tensor name.
    """
    import gguf

    from converters.archs import gguf_names
    from converters.lazy import SafetensorsMap

    arch = arch_of(ckpt.config, ckpt.path / "config.json")
    names = gguf_names(ckpt, arch)
    shapes = SafetensorsMap(ckpt.files)
    w = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH[arch.gguf_arch]])
    try:
        w.add_name(ckpt.config.get("_name_or_path") or ckpt.path.name)
        write_hparams(w, ckpt.config, arch, len(vocab.tokens))
        w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
        write_vocab(w, vocab)
        planned = []
        for hf in ckpt.tensor_names():
            if hf not in names:
                continue
            shape = shapes.shape(hf)
            dtype = np.dtype(np.float16 if len(shape) >= 2 else np.float32)  # llama.cpp wants 1-D tensors in F32
            planned.append((names[hf], shape, dtype))
        return write_streamed(w, planned, gguf_tensors(ckpt, arch), shown(ckpt.path), on_tensor)
    finally:
        w.close()


def write_streamed(w, planned: list[tuple[str, tuple[int, ...], np.dtype]], tensors: Iterable[tuple[str, np.ndarray]],
                   where: str, on_tensor: Callable[[str], None] | None = None) -> dict[str, int]:
    """Finish the GGUF ``w`` (its keys already added) one tensor at a time: the header of every tensor in
    ``planned`` first (shapes known without reading the data), then each of ``tensors``, read, converted and
    written before the next is read, so memory stays at one tensor whatever the model's size
    (``gguf.GGUFWriter.add_tensor`` would hold them all until the end).

    Args:
        w: a ``gguf.GGUFWriter`` whose keys are all added; the caller closes it.
        planned: (GGUF name, shape, stored dtype) of each tensor, in the order written.
        tensors: (GGUF name, array) in the same order, lazily (a generator).
        where: what an error names first (the source).
        on_tensor: called with each tensor's name once it is written.
    Returns:
        Parameter count per GGUF tensor name.
    Raises:
        OndeviceError: a tensor came out of ``tensors`` in another order than ``planned``.
    """
    counts: dict[str, int] = {}
    for name, shape, dtype in planned:
        w.add_tensor_info(name, shape, dtype, int(np.prod(shape)) * dtype.itemsize)
        counts[name] = int(np.prod(shape))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for (want, _, dtype), (name, t) in zip(planned, tensors, strict=True):
        if name != want:
            raise OndeviceError(f"{where}: tensor {name} came out of order (expected {want})")
        w.write_tensor_data(np.ascontiguousarray(t, dtype=dtype))
        if on_tensor:
            on_tensor(name)
    return counts


def write_vocab(w, vocab: Vocab) -> None:
    """The tokenizer keys: byte-level BPE (``gpt2`` + pre-tokenizer + merges) or SentencePiece (``llama`` + scores)."""
    w.add_tokenizer_model(vocab.model)
    if vocab.model == "gpt2":
        w.add_tokenizer_pre(vocab.pre)
        w.add_token_merges(vocab.merges)
    else:
        w.add_token_scores(vocab.scores)
        w.add_add_space_prefix(vocab.add_space_prefix)
    w.add_token_list(vocab.tokens)
    w.add_token_types(vocab.types)
    for key, value in (("bos", vocab.bos_id), ("eos", vocab.eos_id), ("unk", vocab.unk_id), ("pad", vocab.pad_id)):
        if value is not None:
            getattr(w, f"add_{key}_token_id")(value)
    w.add_add_bos_token(vocab.add_bos)
    w.add_add_eos_token(vocab.add_eos)
    if vocab.chat_template:
        w.add_chat_template(vocab.chat_template)
