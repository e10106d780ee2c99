"""The prompt cache on disk (ondevice.prompt_cache): a restored prefix gives the logits and greedy answer of a
fresh prefill bit for bit (after a "restart": a new backend and a new cache object); truncated, altered,
other-model and other-build files are refused and deleted, never restored; the folder stays within its bound."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
from helpers import PROMPT

from ondevice.backends.llama import LlamaBackend
from ondevice.errors import OndeviceError
from ondevice.prompt_cache import PromptCache

SYSTEM = (PROMPT + " with tools and a long document. ") * 4
TEXT = SYSTEM + "Question: what does the target verify?"


def _open(path, **kw):
    return LlamaBackend(path, n_ctx=512, threads=1, **kw)


def _cache(tmp_path, backend, notes=None, **kw):
    return PromptCache(tmp_path / "pc", backend, min_tokens=8, warn=(notes.append if notes is not None else None), **kw)


def _greedy(b, ids, first_logits, n=12):
    out, row = [], first_logits[-1]
    for _ in range(n):
        out.append(int(np.argmax(row)))
        row = b.eval([out[-1]])[-1]
    return out


def _fresh(path, ids, **kw):
    """Logits of the last prompt token and the greedy continuation, prefilling ``ids[:-1]`` in one batch."""
    b = _open(path, **kw)
    try:
        b.eval(ids[:-1], logits="last")
        first = b.eval(ids[-1:])
        return first, _greedy(b, ids, first)
    finally:
        b.close()


@pytest.mark.parametrize("types", [("f16", "f16"), ("q8_0", "q4_0")])
def test_restore_after_restart_equals_fresh_prefill(tiny_gguf, tmp_path, types):
    path = tiny_gguf("llama")
    kw = dict(cache_type_k=types[0], cache_type_v=types[1])
    b = _open(path, **kw)
    ids = b.tokenize(TEXT)
    b.eval(ids[:-1], logits="last")
    assert _cache(tmp_path, b).store(ids[:-1])
    b.close()
    ref_first, ref_tokens = _fresh(path, ids, **kw)

    b = _open(path, **kw)  # a new process: nothing in memory
    try:
        cache = _cache(tmp_path, b)
        n, restore = cache.lookup(ids)
        assert n == len(ids) - 1
        b.eval(ids[:3])  # whatever the sequence held before is replaced
        assert restore() == n and b.n_past == n
        first = b.eval(ids[-1:])
        assert np.array_equal(first, ref_first)
        assert _greedy(b, ids, first) == ref_tokens
    finally:
        b.close()


def test_longest_common_prefix_is_restored_and_cut(tiny_gguf, tmp_path):
    """A request that shares only the system prompt with a stored one reuses exactly that part."""
    path = tiny_gguf("llama")
    b = _open(path)
    try:
        cache = _cache(tmp_path, b)
        ids = b.tokenize(TEXT)
        other = b.tokenize(SYSTEM + "Answer: none of it, the draft does.")
        m = next(i for i, (x, y) in enumerate(zip(ids, other, strict=False)) if x != y)
        b.eval(ids[:-1], logits="last")
        cache.store(ids[:-1])
        n, restore = cache.lookup(other)
        assert n == m and restore() == m and b.n_past == m
        tail = b.eval(other[m:])
        b.rollback(0)
        b.eval(other[:m], logits="last")
        assert np.array_equal(tail, b.eval(other[m:]))  # the same passes as a fresh prefill split at m
        assert cache.lookup(b.tokenize("Something else entirely, no shared prefix at all here.")) == (0, None)
        assert cache.lookup(ids[:5]) == (0, None)  # below min_tokens
    finally:
        b.close()


def _stored(tmp_path, path, notes=None):
    b = _open(path)
    cache = _cache(tmp_path, b, notes)
    ids = b.tokenize(TEXT)
    b.eval(ids[:-1], logits="last")
    assert cache.store(ids[:-1])
    (f,) = list(cache.dir.glob("*.kvc"))
    return b, cache, ids, f


@pytest.mark.parametrize("damage", ["truncate", "flip_state", "flip_token", "garbage", "pad"])
def test_damaged_file_is_refused_and_deleted(tiny_gguf, tmp_path, damage):
    notes = []
    b, cache, ids, f = _stored(tmp_path, tiny_gguf("llama"), notes)
    try:
        data = bytearray(f.read_bytes())
        if damage == "truncate":
            data = data[: len(data) - 100]
        elif damage == "flip_state":
            data[-50] ^= 1
        elif damage == "flip_token":
            data[12 + int.from_bytes(data[8:12], "little") + 4] ^= 1  # the second stored token's low byte
        elif damage == "garbage":
            data = b"not a cache file" * 10
        else:
            data += b"\0" * 8
        f.write_bytes(bytes(data))
        b.rollback(0)
        cache = _cache(tmp_path, b, notes)  # a restart: nothing remembered about the file
        assert cache.lookup(ids) == (0, None)
        assert not f.exists() and b.n_past == 0
        assert len(notes) == 1 and f.name in notes[0] and "refused" in notes[0]
    finally:
        b.close()


def test_another_models_file_is_refused(tiny_gguf, tmp_path):
    """llama_draft has llama's shapes, so llama.cpp itself would load llama's state into it: the identity in
    the file is what refuses it."""
    notes = []
    a, cache_a, ids, f = _stored(tmp_path, tiny_gguf("llama"), notes)
    a.close()
    b = _open(tiny_gguf("llama_draft"))
    try:
        cache_b = _cache(tmp_path, b, notes)
        assert cache_b.model_sha256 != cache_a.model_sha256
        assert cache_b.lookup(ids) == (0, None) and f.exists()  # another model's file: not read, left alone
        forged = cache_b._path(ids[:-1])
        shutil.copy(f, forged)  # under model B's name
        assert cache_b.lookup(ids) == (0, None)
        assert not forged.exists() and f.exists()
        assert "another model" in notes[-1]
    finally:
        b.close()


def test_llama_cpp_refusal_leaves_sequence_empty_and_deletes_file(tiny_gguf, tmp_path):
    """A state of another cache type (forged with this backend's identity and a valid checksum): llama.cpp's
    own check refuses it; restore reports 0, the sequence is empty, the file is gone."""
    path = tiny_gguf("llama")
    q = _open(path, cache_type_k="q8_0")
    ids = q.tokenize(TEXT)
    q.eval(ids[:-1], logits="last")
    state = q.save_seq_state()
    q.close()
    notes = []
    b = _open(path)
    try:
        with pytest.raises(OndeviceError, match="refused a saved KV state"):
            b.load_seq_state(state, len(ids) - 1)
        assert b.n_past == 0
        b.eval(ids[:-1], logits="last")
        cache = _cache(tmp_path, b, notes)
        cache.store(ids[:-1])
        (f,) = list(cache.dir.glob("*.kvc"))
        b.save_seq_state = lambda seq=0: state  # noqa: E731 - the forged file gets this backend's header and hash
        f.unlink()
        cache._index.clear()
        cache.store(ids[:-1])
        n, restore = _cache(tmp_path, b, notes).lookup(ids)
        assert n == len(ids) - 1
        assert restore() == 0 and b.n_past == 0 and not f.exists()
        assert "refused" in notes[-1]
    finally:
        b.close()


def test_other_build_files_are_deleted_other_models_kept(tiny_gguf, tmp_path):
    b, cache, ids, f = _stored(tmp_path, tiny_gguf("llama"))
    try:
        stale = cache.dir / f"{cache.model_sha256[:16]}-00000000-{'0' * 32}.kvc"
        other_model = cache.dir / f"{'f' * 16}-00000000-{'0' * 32}.kvc"
        stale.write_bytes(f.read_bytes())
        other_model.write_bytes(f.read_bytes())
        _cache(tmp_path, b, [])
        assert not stale.exists() and other_model.exists() and f.exists()
    finally:
        b.close()


def test_size_bound_evicts_least_recently_used(tiny_gguf, tmp_path):
    b = _open(tiny_gguf("llama"))
    try:
        prompts = [b.tokenize(f"{w} " + SYSTEM) for w in ("Alpha", "Bravo", "Charlie")]
        probe = _cache(tmp_path / "probe", b)
        b.eval(prompts[0], logits="last")
        probe.store(prompts[0])
        one = probe.size_bytes()
        cache = _cache(tmp_path, b, max_bytes=int(2.5 * one))
        paths = []
        for i, ids in enumerate(prompts[:2]):
            b.rollback(0)
            b.eval(ids, logits="last")
            assert cache.store(ids)
            paths.append(cache._path(ids))
            os.utime(paths[-1], ns=(10**18 + i, 10**18 + i))
        assert cache.lookup(prompts[0] + [5])[0] == len(prompts[0])  # a hit makes Alpha the most recent
        b.rollback(0)
        b.eval(prompts[2], logits="last")
        assert cache.store(prompts[2])
        assert paths[0].exists() and not paths[1].exists() and cache._path(prompts[2]).exists()
        assert cache.size_bytes() <= cache.max_bytes
        assert not cache.store(prompts[2])  # already stored: not written again
        b.rollback(len(prompts[2]) - 4)  # a stored prefix extended: the shorter file is superseded
        longer = prompts[2][:-4] + b.tokenize(" and more words", add_bos=False)
        b.eval(longer[len(prompts[2]) - 4 :], logits="last")
        assert cache.store(longer) and cache._path(prompts[2]).exists()  # not a prefix of longer: kept
        b.rollback(len(prompts[2]) - 4)
        assert cache.store(prompts[2][:-4]) is False  # covered by a stored file
        more = b.tokenize(" then the target verifies once more", add_bos=False)
        b.eval(longer[len(prompts[2]) - 4 :] + more, logits="last")
        assert cache.store(longer + more) and not cache._path(longer).exists()  # extended: superseded
        small = _cache(tmp_path / "small", b, max_bytes=one // 2)
        assert not small.store(longer + more) and small.size_bytes() == 0  # one file over the bound: not stored
    finally:
        b.close()


def test_store_and_restore_another_sequence(tiny_gguf, tmp_path):
    """Parallel slots: a prefix stored from sequence 2 restores into sequence 1 of a fresh backend, exactly,
    leaving sequence 0 as it was (one KV buffer per sequence, as batched answers use)."""
    path = tiny_gguf("llama")

    def opened():
        return LlamaBackend(path, n_ctx=4 * 256, threads=1, n_seq_max=4, kv_unified=False)

    b = opened()
    try:
        ids = b.tokenize(TEXT)
        n = len(ids) - 1
        b.eval_seqs([(2, i, t) for i, t in enumerate(ids[:-1])], outputs=[False] * n)
        assert _cache(tmp_path, b).store(ids[:-1], seq=2)
        ref = b.eval_seqs([(2, n, ids[-1])])[0]
    finally:
        b.close()
    b = opened()
    try:
        other = b.tokenize("Something else in slot zero.")
        b.eval(other)
        n_restored, restore = _cache(tmp_path, b).lookup(ids)
        assert n_restored == n and restore(seq=1) == n
        assert b.seq_positions(1) == n and b.n_past == len(other)
        assert np.array_equal(b.eval_seqs([(1, n, ids[-1])])[0], ref)
    finally:
        b.close()


def test_bad_folder_or_bound_is_one_line_error(tiny_gguf, tmp_path):
    b = _open(tiny_gguf("llama"))
    try:
        (tmp_path / "file").write_text("x")
        with pytest.raises(OndeviceError, match=r"prompt cache .*file: cannot use it as a folder"):
            PromptCache(tmp_path / "file", b)
        with pytest.raises(OndeviceError, match=r"prompt cache max_bytes=0: must be an integer >= 1"):
            PromptCache(tmp_path / "pc", b, max_bytes=0)
    finally:
        b.close()
