"""``owned``: the engine is driven by one thread at a time; a call from a second thread while
the first is inside the engine is a ``RuntimeError``, never an interleaving.

The engine's host state (queues, leases, allocators, the radix tree) and its donated device pools
are not thread-safe: two threads stepping at once consumed each other's donated buffers and
scheduled against each other's page counts. The guard is a non-blocking re-entrant lock per
engine: the thread inside may call further guarded methods (``generate`` calls ``add_request``
and ``step``); another thread is refused at once (no waiting, so a deadlock or a silent stall
cannot arise), with the method and both threads named. Calls from another thread while the engine
is idle are allowed: ownership is per call, not for life (the server's ``EngineLoop`` makes every
call from its one engine thread anyway).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


class ThreadGuard:
    """A non-blocking re-entrant lock that remembers the thread and the call holding it."""

    def __init__(self, owner: str):
        self.owner = owner
        self._lock = threading.RLock()
        self._holder: tuple[str, str] | None = None  # (thread name, method) of the outermost call
        self._depth = 0

    def enter(self, method: str) -> None:
        if not self._lock.acquire(False):  # non-blocking (by position: no keyword parsing)
            thread, held_by = self._holder or ("?", "?")
            raise RuntimeError(
                f"{self.owner}.{method} called from thread {threading.current_thread().name!r} "
                f"while thread {thread!r} is inside {self.owner}.{held_by}: the engine is "
                "single-threaded; drive it from one thread (the server's EngineLoop does)")
        if self._depth == 0:
            self._holder = (threading.current_thread().name, method)
        self._depth += 1

    def exit(self) -> None:
        self._depth -= 1
        if self._depth == 0:
            self._holder = None
        self._lock.release()


def owned(method: F) -> F:
    """Run ``method`` holding ``self._thread_guard`` (created on first use)."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        guard = self.__dict__.get("_thread_guard")
        if guard is None:
            guard = self.__dict__.setdefault("_thread_guard", ThreadGuard(type(self).__name__))
        guard.enter(method.__name__)
        try:
            return method(self, *args, **kwargs)
        finally:
            guard.exit()

    return wrapper  # type: ignore[return-value]
