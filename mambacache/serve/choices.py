"""``n`` > 1 and batched prompts: one HTTP request, several engine requests, one response.

Choice ``k = i * n + j`` is sample ``j`` of prompt ``i``: an engine request of its own with seed
``seed + j`` (per-choice seeds: the same request gives the same choices, and they differ from
each other). All of them are submitted before the engine's next step, so the scheduler's
same-step deduplication computes a prompt shared by its ``n`` samples once; the other samples
fork from its cached state. ``usage`` counts each prompt once (``prompt_tokens``,
``cached_tokens`` of its first sample) and every choice's completion tokens.

Streams interleave the choices' chunks as they come, each with its ``index``; then the usage
chunk (``stream_options.include_usage``) and ``[DONE]``. Whichever way the HTTP side ends, every
engine request of the response is aborted or finished.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from mambacache.serve import generation as generation_mod
from mambacache.serve.generation import Generation
from mambacache.serve.protocol import SEED_LIMIT, ApiError, ChatRequest, CompletionRequest
from mambacache.serve.responses import ResponseShape, sse
from mambacache.serve.scored_logprobs import scored_response
from mambacache.serve.sglang_api import submit

_CLIENT_GONE = getattr(generation_mod, "ClientGone", ())
CLIENT_CLOSED_REQUEST = 499


def batch_prompts(req: CompletionRequest | ChatRequest) -> list[Any] | None:
    """A completions request's prompts when it sends several (None: one prompt)."""
    if not isinstance(req, CompletionRequest) or not isinstance(req.prompt, list):
        return None
    if req.prompt and isinstance(req.prompt[0], str | list) and len(req.prompt) > 1:
        return list(req.prompt)
    return None


def is_multi(req: CompletionRequest | ChatRequest) -> bool:
    return req.n > 1 or batch_prompts(req) is not None


def _prompt_ids(server: Any, req: CompletionRequest | ChatRequest) -> list[list[int]]:
    prompts = batch_prompts(req)
    if prompts is None:
        return [server.prompt_ids(req)]
    out = []
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ApiError(f"prompt[{i}]: must not be empty", param="prompt")
        out.append(server.tokenizer.encode(p) if isinstance(p, str) else list(p))
    return out


async def _submit_all(server: Any, http: Request, req: Any, chat: bool,
                      prompts: list[list[int]]) -> list[Generation]:
    base = server.sampling(req, chat)
    auth = getattr(server, "auth", None)
    namespace = None if auth is None else auth.cache_namespace(
        http.headers.get("authorization"), getattr(req, "cache_salt", None))
    param = "messages" if chat else "prompt"
    jobs = [(prompt, dataclasses.replace(base, seed=(base.seed + j) % SEED_LIMIT))
            for prompt in prompts for j in range(req.n)]
    # all queued before the engine thread drains its commands: one step admits them together
    got = await asyncio.gather(*(submit(server, p, sp, param, namespace) for p, sp in jobs),
                               return_exceptions=True)
    failed = [g for g in got if isinstance(g, BaseException)]
    if failed:
        for g in got:
            if not isinstance(g, BaseException):
                server.loop.abort(g)
        raise failed[0]
    return [Generation(server.loop, stream, server.tokenizer, stops=req.stop_strings(),
                       prompt_ids=prompt, is_disconnected=None if req.stream
                       else http.is_disconnected)
            for (prompt, _), stream in zip(jobs, got, strict=True)]


def _usage(gens: list[Generation], n: int) -> dict[str, Any]:
    firsts = [g.usage() for g in gens[::n]]
    prompt = sum(u["prompt_tokens"] for u in firsts)
    completion = sum(len(g.ids) for g in gens)
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in firsts)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


async def _bodies(server: Any, gens: list[Generation], shape: ResponseShape, chat: bool,
                  want_lp: bool, top_n: int, echo: bool) -> list[dict[str, Any]]:
    def one(g: Generation):
        if top_n or echo:
            return scored_response(server, g, shape, chat, top_n, echo)
        return server._collect(g, shape, chat, want_lp)

    try:
        return await asyncio.gather(*(one(g) for g in gens))
    except BaseException:
        for g in gens:
            if not g.finished:
                server.loop.abort(g.stream)
        raise


async def _merged_events(server: Any, gens: list[Generation], shape: ResponseShape, chat: bool,
                         want_lp: bool, include_usage: bool, n: int) -> AsyncIterator[str]:
    queue: asyncio.Queue[tuple[int, str | None]] = asyncio.Queue()

    async def pump(index: int, gen: Generation) -> None:
        try:
            async for event in server._events(gen, shape, chat, want_lp, False):
                if not event.startswith("data: [DONE]"):
                    await queue.put((index, event))
        finally:
            await queue.put((index, None))

    tasks = [asyncio.create_task(pump(k, g)) for k, g in enumerate(gens)]
    try:
        open_ = len(tasks)
        while open_:
            index, event = await queue.get()
            if event is None:
                open_ -= 1
                continue
            body = json.loads(event[len("data: "):])
            for choice in body.get("choices", ()):
                choice["index"] = index
            yield sse(body)
        if include_usage:
            yield sse(shape.usage_chunk(_usage(gens, n)))
        yield sse("[DONE]")
    finally:
        for t in tasks:  # the client went away: each pump's generation aborts its request
            t.cancel()


async def generate(server: Any, http: Request, req: Any, chat: bool, headers: dict[str, str],
                   top_n: int, echo: bool) -> Response:
    """The response to a request with ``n`` > 1 or several prompts."""
    prompts = _prompt_ids(server, req)
    gens = await _submit_all(server, http, req, chat, prompts)
    shape = ResponseShape(chat=chat, model=server.model_name,
                          return_token_ids=req.return_token_ids)
    want_lp = bool(req.logprobs) if chat else req.logprobs is not None
    if req.stream:
        return StreamingResponse(_merged_events(server, gens, shape, chat, want_lp,
                                                req.include_usage(), req.n),
                                 media_type="text/event-stream", headers=headers)
    try:
        bodies = await _bodies(server, gens, shape, chat, want_lp, top_n, echo)
    except _CLIENT_GONE:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    body = bodies[0]
    body["choices"] = [b["choices"][0] | {"index": k} for k, b in enumerate(bodies)]
    body["usage"] = _usage(gens, req.n)
    if top_n or echo:
        body["usage"]["prompt_tokens_details"]["scored_tokens"] = sum(
            b["usage"]["prompt_tokens_details"]["scored_tokens"] for b in bodies)
    return JSONResponse(body, headers=headers)
