"""Every supported (architecture, tokenizer family), built tiny, converts to GGUF f16 and MLX float16 and
verifies; planted bugs (wrong pre-tokenizer name, swapped tensor, dropped quirk) make convert fail."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from converters import convert
from converters.probe import PROBE
from ondevice.errors import OndeviceError

# Each architecture and each tokenizer family at least once, as real models pair them.
PAIRS = [
    ("llama", "smollm"),  # SmolLM / SmolLM2
    ("llama", "llama-bpe"),  # Llama 3.x
    ("llama", "llama-spm"),  # Llama 2, TinyLlama (SentencePiece tokenizer.json, space prefix)
    ("llama", "spm-model"),  # a SentencePiece tokenizer.model alone
    ("llama", "gpt-2"),  # GPT-2's plain byte-level tokenizer on a llama body
    ("mistral", "llama-spm"),  # Mistral 7B
    ("mistral", "tekken"),  # Mistral-Nemo
    ("qwen2", "qwen2"),  # Qwen2 / 2.5
    ("qwen3", "qwen2"),  # Qwen3 (q/k norms, head_dim ≠ hidden / heads)
    ("gemma3_text", "gemma"),  # Gemma 3 (norm offset, sliding window, q/k norms; SentencePiece, no prefix)
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from ondevice.testing import make_tiny_hf

    base, made = tmp_path_factory.mktemp("matrix"), {}

    def get(arch: str, family: str) -> Path:
        if (arch, family) not in made:
            made[arch, family] = make_tiny_hf(base / f"{arch}-{family}", arch, tokenizer=family)
        return made[arch, family]

    return get


def _hf_ids(src: Path) -> list[int]:
    """The source tokenizer's own ids: HF tokenizers on tokenizer.json, else sentencepiece on tokenizer.model."""
    if not (src / "tokenizer.json").is_file():
        import sentencepiece

        return sentencepiece.SentencePieceProcessor(model_file=str(src / "tokenizer.model")).encode(PROBE)
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(src / "tokenizer.json")).encode(PROBE, add_special_tokens=False).ids


@pytest.mark.parametrize("arch,family", PAIRS, ids=[f"{a}-{f}" for a, f in PAIRS])
def test_gguf_f16_loads_in_llama_cpp_and_matches_source(tiny, tmp_path, arch, family):
    from ondevice.backends.llama import LlamaBackend

    src = tiny(arch, family)
    s = convert(src, to="gguf", quant="f16", out=tmp_path / "g", progress=False)
    v = s["verify"]
    assert v["passed"] and v["runtime"] == "llama.cpp" and v["precision"] == "float"
    assert v["source"]["top1_agreement"] >= 0.98 and v["source"]["max_rel_error"] <= 0.02, v
    assert v["weights"]["max_weight_rel_error"] < 5e-3
    assert json.loads((tmp_path / "g" / "manifest.json").read_text())["verify"] == v
    b = LlamaBackend(tmp_path / "g" / "model.gguf", n_ctx=64)  # independently of the verifier
    try:
        assert b.tokenize(PROBE, add_bos=False) == _hf_ids(src)
    finally:
        b.close()


@pytest.mark.parametrize("arch,family", PAIRS, ids=[f"{a}-{f}" for a, f in PAIRS])
def test_mlx_float16_loads_in_mlx_lm_and_matches_source(tiny, tmp_path, arch, family):
    from mlx_lm import load

    src = tiny(arch, family)
    s = convert(src, to="mlx", bits=16, out=tmp_path / "m", progress=False)
    v = s["verify"]
    assert v["passed"] and v["runtime"] == "mlx-lm" and v["precision"] == "float"
    assert v["source"]["top1_agreement"] >= 0.98 and v["source"]["max_rel_error"] <= 0.02, v
    _, tok = load(str(tmp_path / "m"))
    assert tok.encode(PROBE, add_special_tokens=False) == _hf_ids(src)


def test_quantized_outputs_verify_on_their_own_weights(tiny, tmp_path):
    """q4_k_m / 4-bit are judged tensor by tensor against the source and on their written weights."""
    src = tiny("qwen2", "qwen2")
    for to, kw in (("gguf", {"quant": "q4_k_m"}), ("mlx", {"bits": 4})):
        v = convert(src, to=to, out=tmp_path / to, progress=False, **kw)["verify"]
        assert v["precision"] == "quantized" and v["passed"]
        assert 0.02 < v["weights"]["max_weight_rel_error"] < 0.25  # rounded, not wrong
        assert v["written"]["top1_agreement"] >= v["written"]["min_top1"]
        assert "top1_agreement" in v["source"]  # recorded against the float source too


def _swap_ffn_up(monkeypatch):
    import converters.gguf_writer as gw

    real = gw.gguf_tensors

    def swapped(ckpt, arch):
        d = dict(real(ckpt, arch))
        d["blk.0.ffn_up.weight"], d["blk.1.ffn_up.weight"] = d["blk.1.ffn_up.weight"], d["blk.0.ffn_up.weight"]
        return iter(d.items())

    monkeypatch.setattr(gw, "gguf_tensors", swapped)


def _plant_pre(name):
    def plant(monkeypatch):
        import converters.gguf_writer as gw

        real = gw.write_vocab

        def write_vocab(w, vocab):
            vocab.pre = name
            real(w, vocab)

        monkeypatch.setattr(gw, "write_vocab", write_vocab)

    return plant


def _plant_config(**change):
    def plant(monkeypatch):
        import converters.archs as archs
        import converters.gguf_writer as gw

        monkeypatch.setattr(gw, "write_hparams", lambda w, cfg, arch, n: archs.write_hparams(w, {**cfg, **change}, arch, n))

    return plant


def _plant_arch(name, **change):
    def plant(monkeypatch):
        import dataclasses

        import converters.archs as archs

        monkeypatch.setitem(archs.ARCHS, name, dataclasses.replace(archs.ARCHS[name], **change))
        # the verifier reads back with the same (planted) table, so only the forward pass can catch it

    return plant


PLANTED = {
    "pre-gpt2-refused-by-llama.cpp": (("llama", "gpt-2"), _plant_pre("gpt2"), "does not load"),
    "pre-wrong-tokenizes-differently": (("llama", "smollm"), _plant_pre("llama-bpe"), "tokenizes the probe differently"),
    "swapped-tensor": (("llama", "smollm"), _swap_ffn_up, "differs from the source by"),
    "no-rope-permutation": (("llama", "smollm"), _plant_arch("llama", permute_qk=False), "disagrees with its source"),
    "gemma3-no-norm-offset": (("gemma3_text", "gemma"), _plant_arch("gemma3_text", norm_offset=0.0),
                              "disagrees with its source"),
    "gemma3-no-sliding-window": (("gemma3_text", "gemma"), _plant_config(sliding_window=None), "disagrees with its source"),
    "wrong-rope-base": (("qwen3", "qwen2"), _plant_config(rope_theta=100.0), "disagrees with its source"),
}


@pytest.mark.parametrize("case", list(PLANTED))
def test_planted_bugs_fail_conversion_with_one_line_and_no_output(tiny, tmp_path, monkeypatch, case):
    """The verification's negative controls: each planted bug must be caught, nothing left behind."""
    (arch, family), plant, needle = PLANTED[case]
    src = tiny(arch, family)
    plant(monkeypatch)
    with pytest.raises(OndeviceError) as e:
        convert(src, to="gguf", quant="f16", out=tmp_path / "out", progress=False)
    msg = str(e.value)
    assert needle in msg and "verification failed" in msg and "\n" not in msg, msg
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".*"))


def test_planted_bug_in_a_quantized_output_is_caught(tiny, tmp_path, monkeypatch):
    _plant_config(rope_theta=100.0)(monkeypatch)
    with pytest.raises(OndeviceError, match="disagrees with its own weights"):
        convert(tiny("qwen2", "qwen2"), to="gguf", quant="q4_k_m", out=tmp_path / "q", progress=False)
    assert not (tmp_path / "q").exists()


def test_unknown_tokenizers_and_architectures_are_refused_by_name(tiny, tmp_path):
    import shutil

    src = tmp_path / "src"
    shutil.copytree(tiny("llama", "smollm"), src)
    tj = json.loads((src / "tokenizer.json").read_text())
    tj["pre_tokenizer"] = {"type": "Split", "pattern": {"Regex": r"\p{L}+|[^\p{L}]"}, "behavior": "Isolated",
                           "invert": False}
    (src / "tokenizer.json").write_text(json.dumps(tj))
    with pytest.raises(OndeviceError, match=r"unknown byte-level pre-tokenizer Split\('\\\\p\{L\}.*known: gpt-2, smollm"):
        convert(src, to="gguf", out=tmp_path / "o1", progress=False)
    tj["model"]["type"] = "WordPiece"
    (src / "tokenizer.json").write_text(json.dumps(tj))
    with pytest.raises(OndeviceError, match="tokenizer model 'WordPiece' is not supported"):
        convert(src, to="gguf", out=tmp_path / "o2", progress=False)
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "model_type": "phi3"}))
    with pytest.raises(OndeviceError, match="unsupported architecture 'phi3'; supported: llama, mistral, qwen2, qwen3, gemma3_text"):
        convert(src, to="mlx", out=tmp_path / "o3", progress=False)
    assert not any((tmp_path / n).exists() for n in ("o1", "o2", "o3"))


def test_gemma3_quirks_are_written_for_llama_cpp(tiny, tmp_path):
    """Norm weights stored as 1 + w, the sliding-window pattern and its rope base; q/k norms by gguf's names."""
    import gguf

    src = tiny("gemma3_text", "gemma")
    convert(src, to="gguf", quant="f16", out=tmp_path / "g", progress=False)
    r = gguf.GGUFReader(str(tmp_path / "g" / "model.gguf"))
    fields = {k: f.contents() for k, f in r.fields.items() if not k.startswith("tokenizer.ggml.")}
    assert fields["gemma3.attention.sliding_window"] == 16
    assert fields["gemma3.attention.sliding_window_pattern"] == [True, False]
    assert fields["gemma3.rope.freq_base_swa"] == 10000.0 and fields["gemma3.rope.freq_base"] == 1e6
    assert r.fields["tokenizer.ggml.model"].contents() == "llama"
    assert r.fields["tokenizer.ggml.add_space_prefix"].contents() is False
    names = {t.name: t for t in r.tensors}
    assert {"blk.0.attn_q_norm.weight", "blk.0.post_attention_norm.weight", "blk.0.post_ffw_norm.weight"} <= set(names)
    from safetensors.numpy import load_file

    hf = load_file(str(src / "model.safetensors"))
    got = np.asarray(names["blk.1.ffn_norm.weight"].data, np.float32)
    assert np.allclose(got, hf["model.layers.1.pre_feedforward_layernorm.weight"].astype(np.float32) + 1.0)


ONE_PER_ARCH = [("llama", "smollm"), ("mistral", "llama-spm"), ("qwen2", "qwen2"), ("qwen3", "qwen2"), ("gemma3_text", "gemma")]


@pytest.mark.parametrize("arch,family", ONE_PER_ARCH, ids=[a for a, _ in ONE_PER_ARCH])
def test_gguf_names_map_back_to_hf_names(tiny, arch, family):
    """Reading a GGUF (→ MLX, info, Core ML) names tensors by the reverse of the same gguf TensorNameMap."""
    import gguf

    from converters.archs import arch_of, gguf_names
    from converters.hf import open_checkpoint
    from ondevice.formats.gguf import hf_name

    ckpt = open_checkpoint(tiny(arch, family))
    gguf_arch = gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH[arch_of(ckpt.config, "").gguf_arch]]
    names = gguf_names(ckpt, arch_of(ckpt.config, ""))
    assert len(names) >= 9 * ckpt.config["num_hidden_layers"]
    assert {hf_name(g, gguf_arch): h for h, g in names.items()} == {h: h for h in names}
