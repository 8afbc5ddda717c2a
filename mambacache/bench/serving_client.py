"""One request of the serving benchmark against ``/v1/completions`` (httpx, async), streamed as
server-sent events or not, timed on the client: TTFT at the first chunk that carries tokens,
one inter-token latency per later chunk, end-to-end latency at the end of the response.

The prompt goes as token ids and the reply is asked for its ``token_ids`` (``return_token_ids``),
so lengths are exact and a multi-turn client can extend a conversation without a tokenizer.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Sequence
from typing import Any

import httpx


@dataclasses.dataclass
class Reply:
    """What one request gave: generated ids, the usage the server reported, client timings."""

    output_ids: list[int] = dataclasses.field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ttft_s: float = 0.0
    latency_s: float = 0.0
    itl_s: list[float] = dataclasses.field(default_factory=list)
    error: str | None = None


def _usage(reply: Reply, usage: dict[str, Any] | None) -> None:
    if usage:
        reply.prompt_tokens = int(usage.get("prompt_tokens", 0))
        details = usage.get("prompt_tokens_details") or {}
        reply.cached_tokens = int(details.get("cached_tokens") or 0)


async def _read_stream(resp: httpx.Response, reply: Reply, t0: float) -> None:
    last = t0
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            break
        obj = json.loads(data)
        if "error" in obj:
            reply.error = obj["error"].get("message", str(obj["error"]))
            return
        _usage(reply, obj.get("usage"))
        ids = [t for c in obj.get("choices", []) for t in c.get("token_ids") or []]
        if ids:
            now = time.perf_counter()
            if not reply.output_ids:
                reply.ttft_s = now - t0
            else:
                reply.itl_s.append(now - last)
            last = now
            reply.output_ids += ids


async def send_completion(http: httpx.AsyncClient, *, model: str, prompt: Sequence[int],
                          max_tokens: int, stream: bool = True, ignore_eos: bool = True,
                          extra: dict[str, Any] | None = None) -> Reply:
    """POST one greedy completion; failures come back as ``Reply.error`` (never raised)."""
    body: dict[str, Any] = {"model": model, "prompt": list(prompt), "max_tokens": max_tokens,
                            "temperature": 0.0, "ignore_eos": ignore_eos, "stream": stream,
                            "return_token_ids": True, **(extra or {})}
    if stream:
        body["stream_options"] = {"include_usage": True}
    reply = Reply()
    t0 = time.perf_counter()
    try:
        if stream:
            async with http.stream("POST", "/v1/completions", json=body) as resp:
                if resp.status_code != 200:
                    reply.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode()}"
                    return reply
                await _read_stream(resp, reply, t0)
        else:
            resp = await http.post("/v1/completions", json=body)
            if resp.status_code != 200:
                reply.error = f"HTTP {resp.status_code}: {resp.text}"
                return reply
            obj = resp.json()
            reply.output_ids = list(obj["choices"][0].get("token_ids") or [])
            _usage(reply, obj.get("usage"))
            reply.ttft_s = time.perf_counter() - t0
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as err:
        reply.error = f"{type(err).__name__}: {err}"
    reply.latency_s = time.perf_counter() - t0
    return reply
