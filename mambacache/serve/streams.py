"""One request seen from the event loop: its ``RequestStream`` of ``Delta``s (new token ids and
logprobs, the final ``RequestOutput`` last), and ``Overloaded``, the refusal of a full server.

The engine thread (``engine_loop.py``) ``put``s each delta from its thread; the HTTP handler
awaits ``next()`` on the server's event loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

from mambacache.engine.request import RequestOutput


class Overloaded(Exception):
    """More requests than ``max_running_requests + max_waiting`` are in the server."""


@dataclasses.dataclass
class Delta:
    """New tokens of one request; ``output`` is set on the last one (finished, failed)."""

    ids: list[int]
    logprobs: list[float]
    cached_tokens: int = 0  # prompt tokens the request got from the cache (once admitted)
    output: RequestOutput | None = None


class RequestStream:
    """One request seen from the event loop: ``await next()`` yields its ``Delta``s."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue[Delta] = asyncio.Queue()
        self.request_id: int | None = None
        self.submitted_s = time.perf_counter()
        self.sent = 0  # engine thread only: output ids handed over so far
        self.released = False  # its capacity given back (under EngineLoop._lock)
        self.last_token_s: float | None = None  # engine thread only

    def put(self, delta: Delta) -> None:  # from the engine thread
        self.loop.call_soon_threadsafe(self.queue.put_nowait, delta)

    async def next(self) -> Delta:
        return await self.queue.get()
