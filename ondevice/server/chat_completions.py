"""The OpenAI chat.completions dialect (``POST /v1/chat/completions``): messages rendered with the model's chat
template (and ``chat_template_kwargs``), tools, response_format, grammar, logprobs and a thinking budget
(``reasoning_budget`` / ``reasoning_effort``: ``structured.budget_args``); answers as
``chat.completion`` or streamed ``chat.completion.chunk`` objects (a role chunk first; thinking as
``reasoning_content`` / ``reasoning``, tool calls as ``tool_calls`` deltas with arguments streamed)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

from ondevice import reasoning, toolcalls
from ondevice.chat import PROMPT_TAIL, render_prompt
from ondevice.errors import OndeviceError
from ondevice.logprobs import TokenLogprob
from ondevice.media import has_images, render_media
from ondevice.server.engine import Piece
from ondevice.server.errors import FINISH, ApiError
from ondevice.server.openai_api import OpenAIReply, chat_messages, check_context, generation_args, stream_args
from ondevice.server.structured import (
    Answer,
    Structured,
    budget_args,
    chat_logprobs_args,
    cut_by_limit,
    grammar_args,
    reasoning_args,
    response_format_args,
    template_args,
    tool_args,
)
from ondevice.server.types import Call, Dialect
from ondevice.speculative import Stats


class ChatCompletions(Dialect):
    path = "/v1/chat/completions"

    def parse(self, body: dict) -> Call:
        rt = self.ctx.rt
        stream, with_usage = stream_args(body, self.ctx.model_id)
        st = Structured()
        chat_logprobs_args(body, st)
        response_format_args(body, st)
        grammar_args(body, st)
        template = rt.target.chat_template
        tool_args(body, template, st)
        template_args(body, st)
        reasoning_args(body, st)
        msgs = toolcalls.template_messages(chat_messages(body), st.family)
        render = render_prompt
        if has_images(msgs):  # over HTTP an image is data only: a client never names a file on this machine
            data_urls_only(msgs)
            render = render_media
        try:  # the template is untrusted: it renders in its own budgeted process
            text, ids = render(rt, msgs, tools=st.tools, variables=st.variables)
        except OndeviceError as e:
            raise ApiError(400, str(e), param="messages") from e
        thinking = reasoning.detect(template, text[-PROMPT_TAIL:])
        st.thinking = thinking if st.split_thinking else None
        budget_args(body, thinking, rt.reasoning_budget, st)
        if not ids:
            raise ApiError(400, "the prompt is empty", param="prompt")
        check_context(len(ids), rt.n_ctx)
        req = dataclasses.replace(generation_args(body, len(ids), rt.n_ctx), **st.run)
        return Call(ids, req, ChatReply(self.ctx.model_id, with_usage, st, rt.target.token_bytes), stream)


class ChatReply(OpenAIReply):
    """A chat answer: thinking, content and tool calls (``structured.Answer``), chat-shaped logprobs."""

    prefix, object, chunk_object = "chatcmpl-", "chat.completion", "chat.completion.chunk"

    def __init__(self, model: str, with_usage: bool, st: Structured, token_bytes: Callable[[int], bytes]) -> None:
        super().__init__(model, with_usage)
        self.st = st
        self.token_bytes = token_bytes
        self.out = Answer(st)

    def whole(self, pieces: list[Piece], stats: Stats) -> dict:
        st = self.st
        self.out.feed("".join(p.chunk.text for p in pieces))
        self.out.finish(cut_by_limit(stats))
        thinking, answer, calls = self.out.result()
        lp = chat_logprobs([x for p in pieces for x in p.chunk.logprobs or []], self.token_bytes) if st.logprobs else None
        msg = {"role": "assistant", "content": answer, "refusal": None,
               **({"reasoning_content": thinking, "reasoning": thinking} if thinking else {}),
               **({"tool_calls": calls} if calls else {})}
        return self.answer({"index": 0, "message": msg, "logprobs": lp, "finish_reason": _finish(calls, stats)},
                           stats)

    def opening(self) -> list[dict]:
        return [self.head(_delta({"role": "assistant", "content": ""}))]

    def piece(self, piece: Piece) -> list[dict]:
        c = piece.chunk
        lp = chat_logprobs(c.logprobs or [], self.token_bytes) if self.st.logprobs else None
        deltas = self.out.feed(c.text) or [{}]  # every piece is a chunk: it carries the draft counters
        return [self.chunk(_delta(d, lp if i == 0 else None), c.from_draft if i == 0 else [], piece.drafted,
                           piece.accepted) for i, d in enumerate(deltas)]

    def closing(self, stats: Stats) -> list[dict]:
        out = [self.chunk(_delta(d), [], 0, 0) for d in self.out.finish(cut_by_limit(stats))]
        return out + self.finish(_delta({}, finish=_finish(self.out.result()[2], stats)), stats)


def _finish(calls: list[dict], stats: Stats) -> str:
    """'tool_calls' when the answer ended with calls; a call cut by the token limit is 'length', as OpenAI."""
    reason = FINISH.get(stats.stop_reason, "stop")
    return "tool_calls" if calls and reason == "stop" else reason


def _delta(delta: dict, logprobs: dict | None = None, finish: str | None = None) -> dict:
    return {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}


def _bytes_entry(token_bytes: Callable[[int], bytes], tid: int, lp: float) -> dict:
    b = token_bytes(tid)
    return {"token": b.decode("utf-8", "replace"), "logprob": lp if math.isfinite(lp) else -9999.0, "bytes": list(b)}


def chat_logprobs(lps: Sequence[TokenLogprob], token_bytes: Callable[[int], bytes]) -> dict:
    """``choices[i].logprobs`` of a chat completion: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    return {"content": [{**_bytes_entry(token_bytes, x.token, x.logprob),
                         "top_logprobs": [_bytes_entry(token_bytes, i, v) for i, v in x.top]} for x in lps],
            "refusal": None}


def data_urls_only(messages: list[dict]) -> None:
    """Refuse an ``image_url`` part whose url is not a ``data:`` URL (a path or file:// URL would read this
    machine's files for a remote client; http(s) is not fetched)."""
    for i, m in enumerate(messages):
        for part in m["content"] if isinstance(m.get("content"), list) else []:
            if isinstance(part, dict) and part.get("type") == "image_url":
                url = part.get("image_url", {}).get("url") if isinstance(part.get("image_url"), dict) else None
                if not (isinstance(url, str) and url.startswith("data:")):
                    raise ApiError(400, f"messages[{i}]: an image_url must be a data: URL "
                                   "(data:image/png;base64,...); this server reads no paths and fetches no URLs",
                                   param="messages", code="invalid_value")
