"""``ondevice pull NAME --quant FMT``: a local requantization of a catalog model, cached and recorded beside
the published file (never presented as it)."""

from __future__ import annotations

import os
from pathlib import Path

from converters.quality import report
from converters.quant_types import FTYPES, check_tensor_types, tensor_types
from converters.quantize import requantize_file
from ondevice.errors import OndeviceError


def _copy_source(published: Path, plain: Path, output_type: str | None, embedding_type: str | None) -> Path | None:
    """``plain`` (the recorded ``FMT`` variant of ``published``) when quantizing from it gives the very bytes
    quantizing ``published`` would: the tensors whose type is asked are verbatim copies of the published ones
    there (llama.cpp copies a tensor already of its new type, so the rest come out as in ``plain``); else None.
    """
    pub, var = tensor_types(published), tensor_types(plain)
    names = {"token_embd.weight"} if embedding_type else set()
    if output_type:
        names.add("output.weight" if "output.weight" in pub else "token_embd.weight")  # tied: the embedding
    return plain if all(n in pub and pub[n] == var.get(n) for n in names) else None


def pull_variant(name: str, quant: str, *, output_type: str | None = None, embedding_type: str | None = None,
                 force: bool = False, quiet: bool = False) -> Path:
    """``ondevice pull NAME --quant FMT [--output-type T] [--embedding-type T]``: requantize a pulled catalog
    model locally, once, and cache it.

    The variant lives beside the published file (``variants.variant_path``) with a JSON record naming the
    published file and its sha256, the quantizer, the tensor types asked and the measured quality; it is
    never presented as the published file (``resolve(NAME)`` still returns that; ``resolve("NAME:FMT")``, or
    ``"NAME:FMT+out-T"`` with an output type (``variants.variant_tag``), returns the variant). With a type
    asked and the plain ``NAME:FMT`` variant cached, the quantizer reads that one (same bytes, in seconds).
    """
    from ondevice.store import catalog, fetch, lookup, variants

    quant = quant.lower()  # as resolve("NAME:IQ4_NL") reads it

    pair = lookup.resolve_pair(name)
    if pair:
        raise OndeviceError(f"{name} is a pair: requantize each model, `ondevice pull {pair[0]} --quant {quant}` and "
                            f"`ondevice pull {pair[1]} --quant {quant}`")
    entry = catalog.get(name)
    if quant not in FTYPES or quant == "f16":
        raise OndeviceError(f"--quant {quant}: choose one of {', '.join(q for q in FTYPES if q != 'f16')}")
    output_type, embedding_type = check_tensor_types(quant, output_type, embedding_type)
    tag = variants.variant_tag(quant, output_type, embedding_type)
    src = fetch.pull(name, quiet=quiet)
    dest = variants.variant_path(entry, tag)
    if not force and variants.variant_record(entry, tag) is not None:
        return dest
    import llama_cpp

    from converters.output import check_interrupted, sigint_remembered

    via = _copy_source(src, variants.variant_path(entry, quant), output_type, embedding_type) if (
        tag != quant and variants.variant_record(entry, quant) is not None) else None
    dest.parent.mkdir(parents=True, exist_ok=True)
    # written and measured under a temp name, renamed and recorded last: a failure or Ctrl-C leaves nothing
    tmp = dest.with_name(f".{dest.stem}.{os.getpid()}.measuring.gguf")
    try:
        with sigint_remembered():
            summary = requantize_file(src, tmp, quant, allow_requantize=True, reference=src, output_type=output_type,
                                      embedding_type=embedding_type, quantize_from=via)
            check_interrupted()
            os.replace(tmp, dest)
            variants.record_variant(entry, tag, {
                "published": False, "source_model": entry.name, "source_file": entry.filename,
                "source_sha256": entry.sha256, "source_quant": entry.quant, "quant": quant,
                "output_type": output_type, "embedding_type": embedding_type, "variant": f"{entry.name}:{tag}",
                "quantizer": f"llama_model_quantize (llama-cpp-python {llama_cpp.__version__}, allow_requantize)",
                "quantized_from": via.name if via else entry.filename,
                "bits_per_weight": summary["bits_per_weight"], "tensor_types": summary["tensor_types"],
                "quality": summary["quality"], "warning": summary["warning"]})
    finally:
        tmp.unlink(missing_ok=True)
    if not quiet:
        report(summary)
        from rich.console import Console
        from rich.markup import escape

        Console(stderr=True, soft_wrap=True).print(f"[green]✓[/green] {escape(f'{entry.name}:{tag}')} (local "
                                                   f"requantization, not the published file) → {escape(str(dest))}")
    return dest
