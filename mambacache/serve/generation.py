"""One request's generation as the HTTP side sees it: engine ``Delta``s in, text pieces out.

``Generation.pieces()`` yields ``Piece``s (text, the ids and logprobs they came from, a finish
reason on the last). It owns the request's end: a stop string aborts the engine request (the
text stops before it), and a client that goes away aborts it too (``finally``), so the engine
frees everything the request held whichever way the HTTP side ends.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from mambacache.serve.detokenize import IncrementalDetokenizer, StopStrings
from mambacache.serve.engine_loop import EngineLoop, RequestStream
from mambacache.serve.protocol import ApiError
from mambacache.serve.responses import usage

DISCONNECT_POLL_S = 0.5


class ClientGone(Exception):
    """The client of a non-streamed request went away (its request is aborted)."""


@dataclasses.dataclass
class Piece:
    text: str
    ids: list[int]
    logprobs: list[float]
    finish_reason: str | None = None


class Generation:
    """Drives ``stream`` to its end. ``is_disconnected``: polled while waiting (non-streamed
    requests; a streamed response is cancelled by the server when its client goes away)."""

    def __init__(self, loop: EngineLoop, stream: RequestStream, tokenizer: Any, *,
                 stops: list[str], prompt_ids: list[int],
                 is_disconnected: Callable[[], Awaitable[bool]] | None = None):
        self.loop, self.stream = loop, stream
        self.detok = IncrementalDetokenizer(tokenizer.decode)
        self.stops = StopStrings(stops)
        self.prompt_ids = prompt_ids
        self.is_disconnected = is_disconnected
        self.ids: list[int] = []
        self.cached_tokens = 0
        self.finished = False

    def usage(self) -> dict[str, Any]:
        return usage(len(self.prompt_ids), len(self.ids), self.cached_tokens)

    async def _next(self):
        if self.is_disconnected is None:
            return await self.stream.next()
        while True:
            try:
                return await asyncio.wait_for(self.stream.next(), DISCONNECT_POLL_S)
            except TimeoutError:
                if await self.is_disconnected():
                    raise ClientGone("client disconnected") from None

    async def pieces(self) -> AsyncIterator[Piece]:
        try:
            while not self.finished:
                delta = await self._next()
                yield self._piece(delta)
        finally:
            if not self.finished:
                self.loop.abort(self.stream)

    def _piece(self, delta) -> Piece:
        out = delta.output
        self.ids += delta.ids
        self.cached_tokens = delta.cached_tokens
        if out is not None and out.finish_reason == "error":
            self.finished = True
            raise ApiError(f"generation failed: {out.error}", status=500, type="server_error")
        text = self.detok.add(delta.ids)
        if out is not None:
            text += self.detok.flush()
        released = self.stops.add(text, final=out is not None)
        reason = out.finish_reason if out is not None else None
        if self.stops.stopped is not None:
            reason = "stop"
            if out is None:
                self.loop.abort(self.stream)
        self.finished = reason is not None
        return Piece(released, list(delta.ids), list(delta.logprobs), reason)
