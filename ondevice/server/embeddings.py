"""``POST /v1/embeddings`` in OpenAI's shape: ``input`` (a string, a list of strings, a token-id list or a list of
them), ``encoding_format`` float | base64, unit-length vectors and ``usage``; computed by ``ondevice.embed``
(a llama.cpp embedding context of the named model's GGUF, made at its first request; the route runs it in a
worker thread: ``ondevice.server.routes``)."""

from __future__ import annotations

import base64
from typing import Any

from ondevice.errors import OndeviceError
from ondevice.server.errors import ApiError


def _inputs(body: dict) -> list[str | list[int]]:
    x: Any = body.get("input")
    ints = lambda v: isinstance(v, list) and bool(v) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)  # noqa: E731
    if isinstance(x, str):
        return [x]
    if ints(x):
        return [x]
    if isinstance(x, list) and x and all(isinstance(v, str) or ints(v) for v in x):
        return x
    raise ApiError(400, "'input' must be a string, a non-empty list of strings, a list of token ids or a list of "
                   "token-id lists", param="input", code="invalid_value")


def embeddings_answer(embedder, model_id: str, body: dict) -> dict:
    """The JSON answer to an embeddings request (runs llama.cpp: call it in a worker thread).

    Raises:
        ApiError: a bad field, or an input longer than the context (400 naming its index).
    """
    from ondevice.embed import TooLong

    fmt = body.get("encoding_format", "float") or "float"
    if fmt not in ("float", "base64"):
        raise ApiError(400, "'encoding_format' must be 'float' or 'base64'", param="encoding_format", code="invalid_value")
    inputs = _inputs(body)
    dims = body.get("dimensions")
    if dims is not None and dims != embedder.n_embd:
        raise ApiError(400, f"'dimensions': this model's embeddings have {embedder.n_embd} dimensions (got {dims!r}); "
                       "leave it out", param="dimensions", code="unsupported_value")
    try:
        vectors, n = embedder.embed(inputs)
    except TooLong as e:
        raise ApiError(400, str(e), param="input", code="context_length_exceeded") from e
    except OndeviceError as e:
        raise ApiError(400, str(e), param="input", code="invalid_value") from e
    data = [{"object": "embedding", "index": i,
             "embedding": base64.b64encode(v.astype("<f4").tobytes()).decode() if fmt == "base64" else v.tolist()}
            for i, v in enumerate(vectors)]
    return {"object": "list", "data": data, "model": model_id, "usage": {"prompt_tokens": n, "total_tokens": n},
            "ondevice": {"pooling": embedder.pooling, "pooling_declared": embedder.declared}}
