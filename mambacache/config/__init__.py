"""The engine configuration: frozen dataclasses, one per TOML section.

``sections.py`` holds the sections and ``EngineConfig`` (TOML, dotted overrides), ``cache.py`` the
``[cache]`` section, ``checks.py`` the ``ValueError`` helpers. Import from here:
``from mambacache.config import EngineConfig``.
"""

from mambacache.config.cache import CacheConfig
from mambacache.config.sections import (
    DTYPES,
    KERNELS,
    MAX_COMPILE_THREADS,
    MAX_DECODE_STEPS,
    MAX_DRAFT_BRANCHES,
    MAX_DRAFT_TOKENS,
    SPEC_METHODS,
    CompileConfig,
    EngineConfig,
    ModelSection,
    ParallelConfig,
    SchedulerConfig,
    ServeConfig,
    SpeculativeConfig,
    apply_overrides,
    build_sections,
    parse_set_args,
    read_toml,
)

__all__ = [
    "DTYPES", "KERNELS", "SPEC_METHODS", "MAX_DRAFT_TOKENS", "MAX_DRAFT_BRANCHES",
    "MAX_DECODE_STEPS", "MAX_COMPILE_THREADS", "ModelSection", "SchedulerConfig",
    "ParallelConfig", "SpeculativeConfig", "ServeConfig", "CompileConfig", "EngineConfig",
    "read_toml", "build_sections", "apply_overrides", "parse_set_args", "CacheConfig",
]
