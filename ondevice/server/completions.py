"""The OpenAI completions dialect (``POST /v1/completions``): a text or token-id prompt, response_format and
logprobs (an integer); answers as ``text_completion`` objects, whole or streamed."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from ondevice.errors import OndeviceError
from ondevice.logprobs import TokenLogprob
from ondevice.server.engine import Piece
from ondevice.server.errors import FINISH, ApiError
from ondevice.server.openai_api import OpenAIReply, check_context, generation_args, stream_args
from ondevice.server.structured import (
    Structured,
    completion_logprobs_args,
    no_tool_args,
    response_format_args,
)
from ondevice.server.types import Call, Dialect
from ondevice.speculative import Stats


class Completions(Dialect):
    path = "/v1/completions"

    def parse(self, body: dict) -> Call:
        rt = self.ctx.rt
        stream, with_usage = stream_args(body, self.ctx.model_id)
        st = Structured()
        completion_logprobs_args(body, st)
        response_format_args(body, st)
        no_tool_args(body)
        ids = self._ids(body)
        req = dataclasses.replace(generation_args(body, len(ids), rt.n_ctx), **st.run)
        return Call(ids, req, CompletionReply(self.ctx.model_id, with_usage, st.logprobs, rt.target.token_bytes), stream)

    def _ids(self, body: dict) -> list[int]:
        rt = self.ctx.rt
        p = completion_prompt(body)
        try:
            ids = rt.tokenize(p) if isinstance(p, str) else p
        except OndeviceError as e:
            raise ApiError(400, str(e), param="prompt") from e
        if isinstance(p, str) and not p and rt.target.bos_id is not None:
            ids = [rt.target.bos_id]
        bad = [x for x in ids if not 0 <= x < rt.target.vocab_size]
        if bad:
            raise ApiError(400, f"prompt token id {bad[0]} is outside the vocabulary (size "
                           f"{rt.target.vocab_size})", param="prompt")
        if not ids:
            raise ApiError(400, "the prompt is empty", param="prompt")
        check_context(len(ids), rt.n_ctx)
        return ids


def completion_prompt(body: dict) -> str | list[int]:
    """``prompt`` of /v1/completions: a string or token ids (a batch of one is accepted)."""
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str | list):
        p = p[0]
    if isinstance(p, str):
        return p
    if isinstance(p, list) and p and all(isinstance(x, int) and not isinstance(x, bool) for x in p):
        return p
    if isinstance(p, list) and len(p) > 1 and all(isinstance(x, str | list) for x in p):
        raise ApiError(400, f"'prompt': batches are not supported (got {len(p)} prompts); send one per request",
                       param="prompt", code="unsupported_value")
    raise ApiError(400, "'prompt' must be a string or a list of token ids", param="prompt", code="invalid_value")


class CompletionReply(OpenAIReply):
    """A text completion: the text and, if asked, logprobs in the completions shape (with text offsets)."""

    prefix, object, chunk_object = "cmpl-", "text_completion", "text_completion"

    def __init__(self, model: str, with_usage: bool, logprobs: bool, token_bytes: Callable[[int], bytes]) -> None:
        super().__init__(model, with_usage)
        self.logprobs = logprobs
        self.token_bytes = token_bytes
        self.offset = 0  # characters streamed so far (text_offset of the next chunk's first token)

    def whole(self, pieces: list[Piece], stats: Stats) -> dict:
        text = "".join(p.chunk.text for p in pieces)
        lps = [x for p in pieces for x in p.chunk.logprobs or []]
        lp = completion_logprobs(lps, self.token_bytes) if self.logprobs else None
        return self.answer(_choice(text, lp, FINISH.get(stats.stop_reason, "stop")), stats)

    def piece(self, piece: Piece) -> list[dict]:
        c = piece.chunk
        lp = None
        if self.logprobs:
            lp = completion_logprobs(c.logprobs or [], self.token_bytes, self.offset)
            self.offset += len(c.text)
        return [self.chunk(_choice(c.text, lp), c.from_draft, piece.drafted, piece.accepted)]

    def closing(self, stats: Stats) -> list[dict]:
        return self.finish(_choice(None, None, FINISH.get(stats.stop_reason, "stop")), stats)


def _choice(text: str | None, logprobs: dict | None, finish: str | None = None) -> dict:
    return {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish}


def completion_logprobs(lps: Sequence[TokenLogprob], token_bytes: Callable[[int], bytes], offset: int = 0) -> dict:
    """``choices[i].logprobs`` of a text completion: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens, offsets = [], []
    for x in lps:
        offsets.append(offset)
        t = token_bytes(x.token).decode("utf-8", "replace")
        tokens.append(t)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": [x.logprob for x in lps],
            "top_logprobs": [{token_bytes(i).decode("utf-8", "replace"): v for i, v in x.top} for x in lps],
            "text_offset": offsets}
