"""--output-type / --embedding-type: the output projection and token embedding get the tensor type asked, on
convert, pull (a variant named NAME:FMT+out-TYPE that never collides with NAME:FMT) and the quant advisor."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ondevice.errors import OndeviceError


def _types(path) -> dict[str, str]:
    import gguf

    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}


def _greedy(path, n: int = 8) -> list[int]:
    """Load the file in llama.cpp and generate ``n`` tokens greedily (one eval per token)."""
    from ondevice.backends.llama import LlamaBackend

    b = LlamaBackend(path, n_ctx=128)
    try:
        ids = b.tokenize("the draft proposes and the target verifies")
        logits = b.eval(ids, logits="last")
        out = []
        for _ in range(n):
            out.append(int(logits[-1].argmax()))
            logits = b.eval([out[-1]], logits="last")
        return out
    finally:
        b.close()


def test_output_and_embedding_tensors_get_the_types_asked(tiny_gguf, tmp_path):
    from converters import convert

    q8 = tiny_gguf("qwen2", "q8_0")  # untied: output.weight and token_embd.weight are two tensors
    convert(q8, to="gguf", quant="iq4_nl", out=tmp_path / "plain", allow_requantize=True, progress=False)
    s = convert(q8, to="gguf", quant="iq4_nl", out=tmp_path / "o", allow_requantize=True, output_type="Q4_0",
                embedding_type="q8_0", progress=False)
    t, t_plain = _types(tmp_path / "o" / "model.gguf"), _types(tmp_path / "plain" / "model.gguf")
    assert t["output.weight"] == "Q4_0" and t["token_embd.weight"] == "Q8_0"
    assert t_plain["output.weight"] == "Q6_K" and t_plain["token_embd.weight"] == "IQ4_NL"  # control: llama.cpp's own
    assert {n: v for n, v in t.items() if n not in ("output.weight", "token_embd.weight")} == \
           {n: v for n, v in t_plain.items() if n not in ("output.weight", "token_embd.weight")}
    assert s["fallbacks"] == {} and s["output_type"] == "q4_0" and s["quality"]["mean_kl"] > 0
    m = json.loads((tmp_path / "o" / "manifest.json").read_text())
    assert m["output_type"] == "q4_0" and m["embedding_type"] == "q8_0"
    assert len(_greedy(tmp_path / "o" / "model.gguf")) == 8
    # tied (llama): the output projection is the embedding, so --output-type types token_embd.weight
    convert(tiny_gguf("llama", "q8_0"), to="gguf", quant="q4_0", out=tmp_path / "tied", allow_requantize=True,
            output_type="q8_0", progress=False)
    tied = _types(tmp_path / "tied" / "model.gguf")
    assert "output.weight" not in tied and tied["token_embd.weight"] == "Q8_0"
    # two types for one tied tensor: llama.cpp would keep one quietly; refused before anything is written
    with pytest.raises(OndeviceError, match="tied weights"):
        convert(tiny_gguf("llama", "q8_0"), to="gguf", quant="q4_0", out=tmp_path / "two", allow_requantize=True,
                output_type="q8_0", embedding_type="q4_0", progress=False)
    assert not (tmp_path / "two").exists()


def test_hf_to_gguf_takes_an_output_type_and_verifies(tiny_hf, tmp_path):
    from converters import convert

    s = convert(tiny_hf["qwen2"], to="gguf", quant="q4_0", out=tmp_path / "o", output_type="q8_0", progress=False)
    assert _types(tmp_path / "o" / "model.gguf")["output.weight"] == "Q8_0" and s["fallbacks"] == {}
    assert s["verify"]["passed"]


def test_hf_to_gguf_names_the_checkpoint_not_its_temporary_f16(tiny_hf, tmp_path):
    """Two types for a tied tensor, from an HF checkpoint: the refusal names the checkpoint the user gave (was:
    the f16 file written on the way, inside the output's temporary directory); nothing is left."""
    from converters import convert
    from ondevice.errors import shown

    src = tiny_hf["llama"]  # tied embeddings
    with pytest.raises(OndeviceError, match="tied weights") as e:
        convert(src, to="gguf", quant="q4_0", out=tmp_path / "o", output_type="q4_0", embedding_type="q8_0",
                progress=False)
    assert str(e.value).startswith(f"{shown(src)}: ") and "f16" not in str(e.value), str(e.value)
    assert not (tmp_path / "o").exists()


def test_a_bad_tensor_type_is_one_line_and_leaves_nothing(tiny_gguf, tmp_path):
    from converters import convert

    q8 = tiny_gguf("llama", "q8_0")
    with pytest.raises(OndeviceError, match=r"--output-type q7_0: unknown tensor type; choose one of .*iq4_nl"):
        convert(q8, to="gguf", quant="q4_0", out=tmp_path / "bad", allow_requantize=True, output_type="q7_0")
    with pytest.raises(OndeviceError, match="--to mlx does not take them"):
        convert(q8, to="mlx", out=tmp_path / "mlx", output_type="q4_0")
    with pytest.raises(OndeviceError, match="need a quantized --quant"):
        convert(q8, to="gguf", quant="f16", out=tmp_path / "f16", output_type="q4_0")
    assert list(tmp_path.iterdir()) == []
    r = subprocess.run([sys.executable, "-P", "-m", "ondevice", "convert", str(q8), "--to", "gguf", "--quant", "q4_0",
                        "--out", str(tmp_path / "cli"), "--allow-requantize", "--embedding-type", "bogus"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "q6_k" in r.stderr
    assert not (tmp_path / "cli").exists()


def test_pull_output_type_variant_is_its_own_name(tiny_gguf, tiny_catalog):
    """NAME:FMT+out-TYPE resolves to its own recorded file, never to (or from) the plain NAME:FMT; made from
    the cached plain variant when that gives the same bytes."""
    from converters.quantize import llama_quantize
    from converters.variants import _copy_source, pull_variant
    from ondevice.store import catalog, lookup

    published = tiny_gguf("qwen2", "q4_k_m")  # output.weight Q6_K, as in the published Qwen files
    entry = tiny_catalog(published)
    with pytest.raises(OndeviceError, match="pull tiny --quant iq4_nl --output-type iq4_nl"):
        lookup.resolve("tiny:iq4_nl+out-iq4_nl")
    with pytest.raises(OndeviceError, match=r"--output-type bogus: unknown tensor type"):
        pull_variant("tiny", "iq4_nl", output_type="bogus", quiet=True)
    assert [f.name for f in catalog.cached_path(entry).parent.iterdir()] == ["tiny.gguf"]  # refused before any work
    plain = pull_variant("tiny", "iq4_nl", quiet=True)
    path = pull_variant("tiny", "iq4_nl", output_type="iq4_nl", quiet=True)
    assert path.name == "tiny.local-iq4_nl+out-iq4_nl.gguf" and path != plain
    assert lookup.resolve("tiny:iq4_nl+out-iq4_nl") == path == lookup.resolve("tiny:IQ4_NL+OUT-IQ4_NL")
    assert pull_variant("tiny", "IQ4_NL", output_type="IQ4_NL", quiet=True) == path  # spelt as llama.cpp does
    assert lookup.resolve("tiny:iq4_nl") == plain and lookup.resolve("tiny") == catalog.cached_path(entry)
    assert _types(path)["output.weight"] == "IQ4_NL" and _types(plain)["output.weight"] == "Q6_K"
    rec = json.loads(path.with_suffix(".json").read_text())
    assert rec["variant"] == "tiny:iq4_nl+out-iq4_nl" and rec["output_type"] == "iq4_nl" and rec["published"] is False
    assert rec["source_sha256"] == entry.sha256 and rec["quantized_from"] == plain.name
    assert 0 < rec["quality"]["top1_agreement"] <= 1 and rec["quality"]["mean_kl"] > 0
    assert "tiny:iq4_nl+out-iq4_nl" in {r["name"] for r in lookup.listing()}
    # made from the plain variant, it is byte for byte what quantizing the published file gives
    direct = path.with_name("direct.gguf")
    llama_quantize(published, direct, "iq4_nl", allow_requantize=True, output_type="iq4_nl")
    assert direct.read_bytes() == path.read_bytes()
    direct.unlink()
    # control: where the plain variant requantized the tensor asked (q8_0 output → Q6_K), it is not used
    q8 = tiny_gguf("qwen2", "q8_0")
    via = path.with_name("via-q6k.gguf")
    llama_quantize(q8, via, "iq4_nl", allow_requantize=True)
    assert _copy_source(q8, via, "q4_0", None) is None and _copy_source(published, plain, "q4_0", None) == plain
    a, b = path.with_name("a.gguf"), path.with_name("b.gguf")
    llama_quantize(q8, a, "iq4_nl", allow_requantize=True, output_type="q4_0")
    llama_quantize(via, b, "iq4_nl", allow_requantize=True, output_type="q4_0")
    assert a.read_bytes() != b.read_bytes()  # the shortcut would have stacked Q6_K under the asked Q4_0
    with pytest.raises(OndeviceError, match="FMT, FMT\\+out-TYPE"):
        lookup.resolve("tiny:iq4_nl+output-q4_0")


def test_advisor_takes_output_type_variants(tiny_gguf, tmp_path, monkeypatch):
    from converters.advisor import advise, parse_formats

    assert parse_formats(["q4_0", "IQ4_NL+out-Q4_0"]) == {"q4_0": ("q4_0", None, None),
                                                         "iq4_nl+out-q4_0": ("iq4_nl", "q4_0", None)}
    with pytest.raises(OndeviceError, match="only read as published"):
        parse_formats(["q4_1+out-q4_0"])
    with pytest.raises(OndeviceError, match="unknown tensor type"):
        parse_formats(["q4_0+out-q9"])
    monkeypatch.setenv("ONDEVICE_HOME", str(tmp_path))
    doc = advise(str(tiny_gguf("qwen2", "q8_0")), ["q8_0", "q8_0+out-q4_0"], classes=["edit"], per_class=1,
                 max_tokens=8, rounds=1, threads=1)
    rows = {r["format"]: r for r in doc["formats"]}
    assert rows["q8_0"]["made"] == "source" and rows["q8_0+out-q4_0"]["made"] == "requantized into a temp dir"
    assert rows["q8_0+out-q4_0"]["mean_kl"] > 0 and rows["q8_0+out-q4_0"]["ngram"]["edit"]["same_as_plain"] is True


@pytest.mark.parametrize("tag", ["iq4_nl+out-../../x", "iq4_nl+out-a/b", "../iq4_nl", "q4_0/..", "", "iq4_nl+emb-q 8"])
def test_a_variant_tag_that_is_no_name_is_a_one_line_error(tag):
    """A tag becomes part of the variant's file name: one with a path separator made ``resolve`` raise a bare
    ValueError from pathlib ("Invalid name") instead of saying what a variant name looks like."""
    from ondevice.store import lookup, variants

    with pytest.raises(OndeviceError):
        variants.parse_variant_tag(tag)
    if tag:
        with pytest.raises(OndeviceError):
            lookup.resolve(f"smollm2-135m-instruct:{tag}", auto_pull=False)
