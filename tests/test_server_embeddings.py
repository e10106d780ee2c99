"""Embeddings: ``ondevice.embed`` (pooling against per-token hidden states computed apart, batching, limits) and
``/v1/embeddings`` through the real ``openai`` client against ``ondevice serve`` (SmolLM2)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import served

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
llama_cpp = pytest.importorskip("llama_cpp")

KEY = "test-key-embeddings"
N_CTX = 512
TEXTS = ["The cat sat on the mat.", "A dog barked at the postman.", "Quantum chromodynamics is hard.", "ok"]


def _token_states(path, text: str) -> np.ndarray:
    """Every token's final hidden state, from a llama.cpp context without pooling: [n_tokens, n_embd]."""
    llm = llama_cpp.Llama(model_path=str(path), embedding=True, n_ctx=256, n_batch=256, n_ubatch=256,
                          pooling_type=llama_cpp.LLAMA_POOLING_TYPE_NONE, verbose=False, n_threads=1)
    try:
        return np.array(llm.embed(text), np.float64)
    finally:
        llm.close()


def _unit(v: np.ndarray) -> np.ndarray:
    return v / np.linalg.norm(v)


@pytest.mark.parametrize("pooling", ["mean", "last", "cls"])
def test_pooling_matches_hidden_states(tiny_gguf, pooling):
    """Each pooling is the unit-length mean / last / first row of the per-token hidden states."""
    from ondevice.embed import Embedder

    path = tiny_gguf("llama")
    e = Embedder(path, n_ctx=256, threads=1, pooling=pooling)
    try:
        got = e.embed([TEXTS[0]])[0][0]
        states = _token_states(path, TEXTS[0])
        want = _unit({"mean": states.mean(0), "last": states[-1], "cls": states[0]}[pooling])
        assert np.allclose(got, want, atol=1e-5)
        other = _unit({"mean": states[-1], "last": states.mean(0), "cls": states.mean(0)}[pooling])
        assert not np.allclose(got, other, atol=1e-3)  # the control: another pooling differs
    finally:
        e.close()


def test_batched_equals_alone_and_limits(tiny_gguf, monkeypatch):
    from ondevice import embed as E

    e = E.Embedder(tiny_gguf("llama"), n_ctx=256, threads=1)
    try:
        assert (e.pooling, e.declared) == ("mean", False)  # a chat model declares none: mean of hidden states
        batch, n = e.embed(TEXTS)
        assert batch.shape == (len(TEXTS), e.n_embd) and n == sum(len(e.tokenize(t)) for t in TEXTS)
        assert np.isfinite(batch).all() and np.allclose(np.linalg.norm(batch, axis=1), 1, atol=1e-5)
        for i, t in enumerate(TEXTS):
            assert np.allclose(e.embed([t])[0][0], batch[i], atol=1e-5)
        assert np.allclose(e.embed([e.tokenize(TEXTS[1])])[0][0], batch[1], atol=1e-6)  # token ids = the text
        # more inputs than one decode holds: several decodes, same vectors
        many = e.embed(TEXTS * 70)[0]
        assert np.allclose(many[-len(TEXTS):], batch, atol=1e-5)
        with pytest.raises(E.TooLong, match=r"input\[1\] is \d+ tokens; the limit is 256"):
            e.embed(["short", "word " * 300])
        with pytest.raises(E.OndeviceError, match=r"input\[0\]: token id 999999"):
            e.embed([[1, 999999]])
    finally:
        e.close()
    with pytest.raises(E.OndeviceError, match="closed"):
        e.embed(["x"])
    monkeypatch.setattr(E, "declared_pooling", lambda path: "rank")
    with pytest.raises(E.OndeviceError, match="reranker"):
        E.Embedder(tiny_gguf("llama"), n_ctx=256)


def test_declared_pooling_reads_the_metadata(tiny_gguf, monkeypatch):
    from ondevice import embed as E
    from ondevice.formats import gguf

    meta, tokens = gguf.read_header(tiny_gguf("llama"))
    assert E.declared_pooling(tiny_gguf("llama")) is None
    monkeypatch.setattr(gguf, "read_header", lambda p: ({**meta, "llama.pooling_type": 3}, tokens))
    assert E.declared_pooling(tiny_gguf("llama")) == "last"


@pytest.fixture(scope="module")
def server(smollm2):
    yield from served(smollm2, N_CTX, KEY)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=120)


def test_openai_client_embeddings(client, server, smollm2):
    from ondevice.embed import Embedder

    model = client.models.list().data[0].id
    r = client.embeddings.create(model=model, input=TEXTS)  # the client asks for base64 and decodes it
    got = np.array([d.embedding for d in r.data])
    assert [d.index for d in r.data] == list(range(len(TEXTS))) and r.usage.prompt_tokens > len(TEXTS)
    assert np.isfinite(got).all() and np.allclose(np.linalg.norm(got, axis=1), 1, atol=1e-5)
    alone = [client.embeddings.create(model=model, input=t, encoding_format="float").data[0].embedding for t in TEXTS]
    assert np.allclose(np.array(alone), got, atol=1e-5)
    direct = Embedder(smollm2, n_ctx=N_CTX, threads=1)
    try:
        assert np.allclose(direct.embed(TEXTS)[0], got, atol=1e-5)
        ids = direct.tokenize(TEXTS[2])
    finally:
        direct.close()
    by_ids = client.embeddings.create(model=model, input=[ids], encoding_format="float").data[0].embedding
    assert np.allclose(by_ids, got[2], atol=1e-5)
    cases = [
        ({"model": model, "input": ["short", "word " * 600]}, 400, "context_length_exceeded", "input[1]"),
        ({"model": "text-embedding-3-small", "input": "x"}, 404, "model_not_found", "not served"),
        ({"model": model, "input": []}, 400, "invalid_value", "'input'"),
        ({"model": model, "input": "x", "encoding_format": "int8"}, 400, "invalid_value", "encoding_format"),
        ({"model": model, "input": "x", "dimensions": 64}, 400, "unsupported_value", "dimensions"),
    ]
    for body, status, code, words in cases:
        resp = httpx.post(server + "/v1/embeddings", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
        err = resp.json()["error"]
        assert (resp.status_code, err["code"]) == (status, code) and words in err["message"], resp.text[:200]
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert chat.choices[0].message.content  # generation still served beside the embedding context
