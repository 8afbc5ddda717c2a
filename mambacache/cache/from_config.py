"""A cache from a ``mambacache.config.CacheConfig``: the radix tree (or the disabled cache) with
its byte budget, and the host tier behind it when ``host_memory_bytes`` is set. Above both
``radix.py`` and ``host_tier.py`` (which builds its host tree from ``radix.py``), so neither
imports the other back."""

from __future__ import annotations

from typing import Any

from mambacache.cache.base import CacheBase
from mambacache.cache.budget import ByteBudget
from mambacache.cache.host_tier import attach_host_tier
from mambacache.cache.radix import make_cache


def config_budget(cache_cfg: Any) -> ByteBudget | None:
    """The byte budget of a resolved ``CacheConfig`` (``memory_bytes`` and both byte sizes
    set: ``budget.resolve_cache_config``), else ``None``."""
    limit = getattr(cache_cfg, "memory_bytes", 0)
    kv, state = getattr(cache_cfg, "kv_bytes_per_token", 0), getattr(cache_cfg, "state_bytes", 0)
    if not (limit and kv and state):
        return None
    return ByteBudget(limit, kv * cache_cfg.page_size, state,
                      float(getattr(cache_cfg, "running_share", 1.0)))


def make_cache_from_config(cache_cfg: Any, **policy_kwargs: Any) -> CacheBase:
    """``make_cache`` from a ``mambacache.config.CacheConfig`` (all of its cache keys; a host
    tier behind it when ``host_memory_bytes`` is set: ``cache/host_tier.py``)."""
    cache = make_cache(cache_cfg.enable, getattr(cache_cfg, "max_pages", cache_cfg.num_pages),
                       getattr(cache_cfg, "max_slots", cache_cfg.num_mamba_slots),
                       cache_cfg.page_size, cache_cfg.eviction,
                       speculative_states=getattr(cache_cfg, "speculative_states", True),
                       budget=config_budget(cache_cfg), **policy_kwargs)
    attach_host_tier(cache, getattr(cache_cfg, "host_memory_bytes", 0),
                     cache_cfg.kv_bytes_per_token * cache_cfg.page_size, cache_cfg.state_bytes)
    return cache
