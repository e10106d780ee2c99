"""The OpenAI chat.completions dialect (``POST /v1/chat/completions``): messages rendered with the model's chat
template, tools, response_format and logprobs; answers as ``chat.completion`` or streamed
``chat.completion.chunk`` objects (a role chunk first, tool calls as ``tool_calls`` deltas)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

from ondevice.errors import OndeviceError
from ondevice.logprobs import TokenLogprob
from ondevice.server.engine import Piece
from ondevice.server.errors import FINISH, ApiError
from ondevice.server.openai_api import OpenAIReply, chat_messages, check_context, generation_args, stream_args
from ondevice.server.structured import (
    Structured,
    ToolStream,
    chat_logprobs_args,
    response_format_args,
    tool_args,
)
from ondevice.server.types import Call, Dialect
from ondevice.speculative import Stats
from ondevice.tools import parse_calls, template_messages


class ChatCompletions(Dialect):
    path = "/v1/chat/completions"

    def parse(self, body: dict) -> Call:
        rt = self.ctx.rt
        stream, with_usage = stream_args(body, self.ctx.model_id)
        st = Structured()
        chat_logprobs_args(body, st)
        response_format_args(body, st)
        tool_args(body, rt.target.chat_template, st)
        try:  # the template is untrusted: it renders in its own budgeted process
            ids = rt.render_chat(template_messages(chat_messages(body)), tools=st.tools)
        except OndeviceError as e:
            raise ApiError(400, str(e), param="messages") from e
        if not ids:
            raise ApiError(400, "the prompt is empty", param="prompt")
        check_context(len(ids), rt.n_ctx)
        req = dataclasses.replace(generation_args(body, len(ids), rt.n_ctx), **st.run)
        return Call(ids, req, ChatReply(self.ctx.model_id, with_usage, st, rt.target.token_bytes), stream)


class ChatReply(OpenAIReply):
    """A chat answer: content and tool calls (parsed from the text when tools were given), chat-shaped logprobs."""

    prefix, object, chunk_object = "chatcmpl-", "chat.completion", "chat.completion.chunk"

    def __init__(self, model: str, with_usage: bool, st: Structured, token_bytes: Callable[[int], bytes]) -> None:
        super().__init__(model, with_usage)
        self.st = st
        self.token_bytes = token_bytes
        self.tools = ToolStream(st.tool_format, st.tools, "grammar" in st.run) if st.tools else None

    def whole(self, pieces: list[Piece], stats: Stats) -> dict:
        st = self.st
        answer, calls = "".join(p.chunk.text for p in pieces), None
        if st.tools:
            answer, calls = parse_calls(answer, st.tool_format, st.tools)
            if "grammar" in st.run and not calls:
                answer = None  # a forced call cut short is no content (as streamed: ToolStream)
        lp = chat_logprobs([x for p in pieces for x in p.chunk.logprobs or []], self.token_bytes) if st.logprobs else None
        msg = {"role": "assistant", "content": answer, "refusal": None, **({"tool_calls": calls} if calls else {})}
        finish = "tool_calls" if calls else FINISH.get(stats.stop_reason, "stop")
        return self.answer({"index": 0, "message": msg, "logprobs": lp, "finish_reason": finish}, stats)

    def opening(self) -> list[dict]:
        return [self.head(_delta({"role": "assistant", "content": ""}))]

    def piece(self, piece: Piece) -> list[dict]:
        c = piece.chunk
        lp = chat_logprobs(c.logprobs or [], self.token_bytes) if self.st.logprobs else None
        text = self.tools.feed(c.text) if self.tools else c.text
        return [self.chunk(_delta({"content": text} if text else {}, lp), c.from_draft, piece.drafted, piece.accepted)]

    def closing(self, stats: Stats) -> list[dict]:
        out, calls = [], []
        if self.tools:
            tail, calls = self.tools.finish()
            if tail or calls:
                delta = {"content": tail} if tail else {}
                if calls:
                    delta["tool_calls"] = tool_call_deltas(calls)
                out.append(self.chunk(_delta(delta), [], 0, 0))
        finish = "tool_calls" if calls else FINISH.get(stats.stop_reason, "stop")
        return out + self.finish(_delta({}, finish=finish), stats)


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


def tool_call_deltas(calls: Sequence[dict]) -> list[dict]:
    """Streamed ``delta.tool_calls`` entries (one per call, with its index)."""
    return [{"index": i, "id": c["id"], "type": "function", "function": dict(c["function"])} for i, c in enumerate(calls)]
