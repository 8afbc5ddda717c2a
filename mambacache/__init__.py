"""mambacache: prefix caching for hybrid (Gated DeltaNet + attention) LLMs in JAX."""

from __future__ import annotations

from mambacache.config import (
    CacheConfig,
    EngineConfig,
    ModelSection,
    ParallelConfig,
    SchedulerConfig,
    ServeConfig,
    SpeculativeConfig,
)
from mambacache.engine.request import RequestOutput
from mambacache.engine.sampling.params import SamplingParams


def __getattr__(name: str):
    # The engine pulls in JAX and the model; import it lazily so that the host-only pieces
    # (config, radix cache, simulator) stay importable without touching a device.
    if name == "Engine":
        from mambacache.engine.engine import Engine

        return Engine
    raise AttributeError(f"module 'mambacache' has no attribute {name!r}")


__all__ = ["CacheConfig", "Engine", "EngineConfig", "ModelSection", "ParallelConfig",
           "RequestOutput", "SamplingParams", "SchedulerConfig", "ServeConfig",
           "SpeculativeConfig"]
