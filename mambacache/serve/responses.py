"""OpenAI response bodies and server-sent-event chunks for completions and chat completions.

Pure functions of the generated ids, text and counts; ``usage`` carries the radix cache's hit as
``prompt_tokens_details.cached_tokens``. With ``return_token_ids`` a choice also carries the
token ids it covers (``token_ids``), and the response the prompt's ids (``prompt_token_ids``).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

Piece = Callable[[int], str]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def completion_logprobs(ids: Sequence[int], logprobs: Sequence[float], piece: Piece,
                        start_offset: int = 0) -> dict[str, Any]:
    """The legacy completions ``logprobs`` object (no top-k alternatives)."""
    tokens = [piece(t) for t in ids]
    offsets, pos = [], start_offset
    for tok in tokens:
        offsets.append(pos)
        pos += len(tok)
    return {"tokens": tokens, "token_logprobs": list(logprobs), "top_logprobs": None,
            "text_offset": offsets}


def chat_logprobs(ids: Sequence[int], logprobs: Sequence[float], piece: Piece) -> dict[str, Any]:
    content = []
    for t, lp in zip(ids, logprobs, strict=True):
        tok = piece(t)
        content.append({"token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8")),
                        "top_logprobs": []})
    return {"content": content}


class ResponseShape:
    """Builds the bodies of one request: ``chat`` or completions, fixed id / model / time."""

    def __init__(self, *, chat: bool, model: str, return_token_ids: bool):
        self.chat, self.model, self.return_token_ids = chat, model, return_token_ids
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())

    def _head(self, chunk: bool) -> dict[str, Any]:
        obj = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat \
            else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def full(self, *, text: str, ids: Sequence[int], logprobs: dict[str, Any] | None,
             finish_reason: str, usage_: dict[str, Any], prompt_ids: Sequence[int]
             ) -> dict[str, Any]:
        """The non-streamed response."""
        choice: dict[str, Any] = {"index": 0, "logprobs": logprobs, "finish_reason": finish_reason}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        body = self._head(chunk=False) | {"choices": [choice], "usage": usage_}
        if self.return_token_ids:
            choice["token_ids"] = list(ids)
            body["prompt_token_ids"] = list(prompt_ids)
        return body

    def chunk(self, *, text: str = "", ids: Sequence[int] = (),
              logprobs: dict[str, Any] | None = None, finish_reason: str | None = None,
              role: bool = False) -> dict[str, Any]:
        """One streamed choice delta (``role``: the chat stream's opening delta)."""
        choice: dict[str, Any] = {"index": 0, "logprobs": logprobs, "finish_reason": finish_reason}
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if text:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text
        if self.return_token_ids:
            choice["token_ids"] = list(ids)
        return self._head(chunk=True) | {"choices": [choice]}

    def usage_chunk(self, usage_: dict[str, Any]) -> dict[str, Any]:
        """The last chunk of a stream with ``stream_options.include_usage``."""
        return self._head(chunk=True) | {"choices": [], "usage": usage_}


def sse(obj: dict[str, Any] | str) -> str:
    """One server-sent event (``data: ...``); ``obj`` a body or the final ``[DONE]``."""
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)
    return f"data: {data}\n\n"
