"""``load(prompt_cache=DIR)``: the slot's prefill restores a long prompt prefix from disk after a restart (a new
``load``) and gives the same greedy answer; ``Stats.cached_tokens`` (and the OpenAI usage) report the reuse; a
corrupt file is refused with a warning and the answer is still right."""

from __future__ import annotations

import pytest

from ondevice.loader import load
from ondevice.server.openai_api import usage

SYSTEM = " ".join(f"Rule {i}: answer with care, cite item {i * 7 % 13} and keep the tone plain." for i in range(8))
PROMPT = SYSTEM + " Question: what does rule 3 say?"


def _answer(path, cache_dir, prompt=PROMPT, drafter="none", **kw):
    with load(path, drafter=drafter, n_ctx=1024, threads=1, prompt_cache=cache_dir, **kw) as rt:
        res = rt.generate(prompt, max_tokens=16, temperature=0)
        return res.tokens, res.stats


@pytest.fixture(scope="module")
def reference(tiny_gguf):
    path = tiny_gguf("llama")
    tokens, stats = _answer(path, None)
    assert stats.cached_tokens == 0 and stats.prompt_tokens > 300
    return path, tokens


def test_restart_reuses_the_prompt_and_answers_the_same(reference, tmp_path):
    path, ref = reference
    tokens, stats = _answer(path, tmp_path)  # cold: evaluated, then stored
    assert tokens == ref and stats.cached_tokens == 0
    assert len(list(tmp_path.glob("*.kvc"))) == 1
    tokens, stats = _answer(path, tmp_path)  # a restart: restored from disk
    assert tokens == ref
    assert stats.cached_tokens >= 0.8 * stats.prompt_tokens and stats.cached_tokens == stats.prompt_tokens - 1
    assert stats.prompt_eval_tokens == 1
    assert usage(stats)["prompt_tokens_details"]["cached_tokens"] == stats.cached_tokens
    tokens, stats = _answer(path, tmp_path, drafter="ngram")  # speculation on a restored cache stays exact
    assert tokens == ref and stats.cached_tokens == stats.prompt_tokens - 1
    # Another question after the same system prompt reuses the common prefix and answers as the same runtime
    # does after the first question (the same prefix reused in memory: the same batch split of the prefill).
    other = SYSTEM + " Question: and rule 9?"
    with load(path, drafter="none", n_ctx=1024, threads=1) as rt:
        rt.generate(PROMPT, max_tokens=16, temperature=0)
        warm = rt.generate(other, max_tokens=16, temperature=0)
    tokens, stats = _answer(path, tmp_path, other)
    assert tokens == warm.tokens and stats.cached_tokens == warm.stats.cached_tokens >= 0.8 * stats.prompt_tokens


def test_quantized_cache_restart(reference, tmp_path):
    path, _ = reference
    kw = {"cache_type_k": "q8_0", "cache_type_v": "q8_0"}
    cold, _ = _answer(path, tmp_path, **kw)
    tokens, stats = _answer(path, tmp_path, **kw)
    assert tokens == cold and stats.cached_tokens == stats.prompt_tokens - 1
    tokens, stats = _answer(path, tmp_path)  # an f16 cache never restores a q8_0 file (another identity)
    assert stats.cached_tokens == 0


def test_memory_prefix_is_counted_without_a_disk_cache(reference):
    path, ref = reference
    with load(path, drafter="none", n_ctx=1024, threads=1) as rt:
        first = rt.generate(PROMPT, max_tokens=16, temperature=0)
        again = rt.generate(PROMPT, max_tokens=16, temperature=0)
    assert first.tokens == again.tokens == ref
    assert first.stats.cached_tokens == 0 and again.stats.cached_tokens == again.stats.prompt_tokens - 1


def test_corrupt_file_is_refused_with_a_warning(reference, tmp_path, capfd):
    path, ref = reference
    _answer(path, tmp_path)
    (f,) = tmp_path.glob("*.kvc")
    data = bytearray(f.read_bytes())
    data[-100] ^= 0xFF  # inside the KV state: its sha256 no longer matches
    f.write_bytes(bytes(data))
    capfd.readouterr()
    tokens, stats = _answer(path, tmp_path)
    assert "prompt cache: refused" in capfd.readouterr().err
    assert tokens == ref and stats.cached_tokens == 0
    tokens, stats = _answer(path, tmp_path)  # stored again by the run that refused the bad file
    assert tokens == ref and stats.cached_tokens == stats.prompt_tokens - 1


def test_heads_like_drafter_gets_its_last_row_evaluated(reference, tmp_path, monkeypatch):
    """A drafter that reads the last cached row's features (heads) gets that row evaluated after a restore."""
    path, _ = reference
    _answer(path, tmp_path)
    from ondevice.prompt_cache import PromptCache

    asked = []
    real = PromptCache.lookup

    def spy(self, ids, max_tokens=None, more_than=0):
        asked.append((len(ids), max_tokens))
        return real(self, ids, max_tokens, more_than)

    monkeypatch.setattr(PromptCache, "lookup", spy)
    with load(path, drafter="none", n_ctx=1024, threads=1, prompt_cache=tmp_path) as rt:
        rt.slot.drafter = type("D", (), {"traits": type("T", (), {"needs": frozenset({"hidden"})})()})()
        rt.target.enable_hidden()
        n = rt.slot.prefill(rt.tokenize(PROMPT), drafts=True)
        rt.slot.drafter = None
    (m, cap), = asked
    assert cap == m - 2 and n == m - 2


def test_cli_prompt_cache(reference, tmp_path):
    import json

    from typer.testing import CliRunner

    from ondevice.cli.main import app

    path, ref = reference
    args = ["generate", str(path), "-p", PROMPT, "--no-spec", "--max-tokens", "16", "--temperature", "0", "--n-ctx",
            "1024", "--threads", "1", "--prompt-cache", str(tmp_path / "pc"), "--prompt-cache-size", "64MiB", "--json"]
    runs = [CliRunner().invoke(app, args) for _ in range(2)]
    assert all(r.exit_code == 0 for r in runs), runs[0].output
    docs = [json.loads(r.stdout) for r in runs]
    assert docs[0]["tokens"] == docs[1]["tokens"] == ref
    assert docs[0]["stats"]["cached_tokens"] == 0 and docs[1]["stats"]["cached_tokens"] == (
        docs[1]["stats"]["prompt_tokens"] - 1)


def test_a_failed_store_is_a_warning_not_an_error(reference, tmp_path, monkeypatch, capfd):
    from ondevice.prompt_cache import PromptCache

    def full(self, ids, seq=0):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(PromptCache, "store", full)
    path, ref = reference
    tokens, _ = _answer(path, tmp_path)
    assert tokens == ref and "could not store a prefix" in capfd.readouterr().err
