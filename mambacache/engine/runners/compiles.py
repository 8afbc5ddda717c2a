"""Compiles counted where JAX makes them: ``jax.monitoring``'s compile events, per thread scope.

JAX reports every jit compile as duration events (``jax._src.dispatch``): the trace to a jaxpr
(``/jax/core/compile/jaxpr_trace_duration``), the lowering to MLIR
(``.../jaxpr_to_mlir_module_duration``) and the XLA backend compile
(``.../backend_compile_duration``, also emitted for a persistent-cache hit). One process-wide
listener, registered on first use, hands each event to the ``CompileCounter``s tracking on the
calling thread (a compile runs in the thread that dispatched the call), so an engine stepping in
its own thread counts its own compiles and nested scopes (a bench pass around engine steps) all
see them. No engine key can miss a program: a shape, a dtype, a sharding or a jnp op outside
``jit`` that compiles is counted the same way.

A program loaded from JAX's persistent compile cache (``engine/runners/compile_cache.py``) is a
``cache_hits`` event inside its backend-compile span: it counts as a cache hit, not a compile.

Invariant: ``CompileCounter.compiles`` counts backend compiles (one per XLA executable built),
``cache_hits`` the executables loaded from the persistent cache instead; ``seconds`` sums
trace + lowering + backend time (a hit's load included); ``by_function`` counts compiles by
JAX's function name (``jit(_step)``, ``jit(_copy_slots)``, ``jit(broadcast_in_dim)``...).
Counters are safe to share between threads (the warm-up's compile pool tracks one counter in
each of its threads).
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Iterator
from typing import Any

from jax import monitoring

TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"
LOWER_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"
BACKEND_EVENT = "/jax/core/compile/backend_compile_duration"
EVENTS = (TRACE_EVENT, LOWER_EVENT, BACKEND_EVENT)
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"

_local = threading.local()
_lock = threading.Lock()
_registered = False


def _active() -> list[CompileCounter]:
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


def _on_duration(event: str, duration_s: float, **kwargs: Any) -> None:
    if event not in EVENTS:
        return
    hit = False
    if event == BACKEND_EVENT and getattr(_local, "hits", 0):  # its span held a cache hit
        _local.hits -= 1
        hit = True
    for counter in _active():
        counter.record(event, duration_s, str(kwargs.get("fun_name", "?")), cache_hit=hit)


def _on_event(event: str, **kwargs: Any) -> None:
    if event == CACHE_HIT_EVENT:
        _local.hits = getattr(_local, "hits", 0) + 1


def _ensure_listener() -> None:
    global _registered
    with _lock:
        if not _registered:
            monitoring.register_event_duration_secs_listener(_on_duration)
            monitoring.register_event_listener(_on_event)
            _registered = True


class CompileCounter:
    """Compiles seen while ``track()`` is open on some thread (cumulative over scopes)."""

    def __init__(self) -> None:
        _ensure_listener()
        self.compiles = 0
        self.cache_hits = 0
        self.seconds = 0.0
        self.by_function: collections.Counter[str] = collections.Counter()
        # trace + lowering + backend seconds by JAX's function name (compiles and hits)
        self.seconds_by_function: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()

    def record(self, event: str, duration_s: float, fun_name: str,
               cache_hit: bool = False) -> None:
        with self._lock:
            self.seconds += duration_s
            self.seconds_by_function[fun_name] += duration_s
            if event == BACKEND_EVENT and cache_hit:
                self.cache_hits += 1
            elif event == BACKEND_EVENT:
                self.compiles += 1
                self.by_function[fun_name] += 1

    @contextlib.contextmanager
    def track(self) -> Iterator[CompileCounter]:
        """Count the compiles of the calling thread until the block exits (nesting allowed;
        a counter already tracking on this thread is not counted twice)."""
        stack = _active()
        if self in stack:
            yield self
            return
        stack.append(self)
        try:
            yield self
        finally:
            stack.remove(self)

    def snapshot(self) -> tuple[int, float]:
        return self.compiles, self.seconds

    def as_dict(self) -> dict[str, Any]:
        return {"compiles": self.compiles, "cache_hits": self.cache_hits,
                "compile_s": self.seconds, "compiled_functions": dict(self.by_function)}


@contextlib.contextmanager
def count_compiles() -> Iterator[CompileCounter]:
    """``with count_compiles() as c: ...`` then ``c.compiles``, ``c.seconds``."""
    counter = CompileCounter()
    with counter.track():
        yield counter
