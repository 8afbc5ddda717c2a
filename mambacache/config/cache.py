"""The ``[cache]`` section of the engine's configuration (``config.py`` composes it): the prefix
cache on or off, its pools (fixed sizes or one byte budget), snapshots, eviction, the host tier and
the device split's moves."""

from __future__ import annotations

import dataclasses

from mambacache.config.checks import positive as _positive
from mambacache.config.checks import require as _require

EVICTIONS = ("auto", "lru", "flop_aware")
#: pool sizes without a byte budget when none is given
FIXED_POOL_DEFAULTS = {"num_kv_tokens": 16384, "num_mamba_slots": 64}


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """The prefix cache and the pools it manages.

    ``num_kv_tokens`` is the KV pool size in tokens (rounded down to whole pages; page 0 is
    reserved). ``num_mamba_slots`` counts usable recurrent-state slots (slot 0, the zero state, is
    extra). ``checkpoint_interval`` = 0 disables periodic snapshots (256 by default: they are
    speculative, so chat does not pay for them). ``speculative_states``: plan
    the ``prompt_len - 1`` snapshot and the checkpoints as speculative states (kept while slots are
    free or until a hit promotes them; see ``cache/snapshot_plan.py``); false keeps states only at
    branch points and request ends.

    One byte budget (``cache/budget.py``): ``memory_bytes`` (per device; 0 = none) or
    ``memory_fraction`` (share of what the device has left after the weights and the step's
    peak; 0 = none). With a budget, KV pages and states draw on the same bytes and the pool
    sizes are derived from the model's ``state_bytes`` and ``kv_bytes_per_token`` (0 = from the
    model; set them to replay another model's mapping); ``num_kv_tokens`` / ``num_mamba_slots``
    left at 0 are derived, set they cap their pool. Without a budget they default to 16384 / 64.
    ``eviction`` ``"auto"``: ``lru`` for fixed pools, tuned ``flop_aware`` with a byte budget
    (KV and states ranked together by FLOPs saved per byte: on agent traces 4-9 points above
    ``lru`` over one pool, equal on chat; ``docs/radix_cache.md``).
    ``host_memory_bytes`` (0 = off): the host tier (``cache/host_tier.py``), one byte budget in
    host memory for KV pages and states that device eviction demotes into and a match promotes
    back from.
    ``rebalance`` (needs a byte budget): the device split between KV pages and state slots
    moves with the workload between a few quantised splits (``cache/rebalance.py``,
    ``engine/runners/rebalance.py``); ``device_splits`` (derived by ``engine.pools.size_pools``, set
    to pin them): those splits as ``(pages, slots)`` pairs, ``num_kv_tokens`` /
    ``num_mamba_slots`` the one the pools start at. Off: the split is fixed at start.
    """

    enable: bool = True
    page_size: int = 1
    num_kv_tokens: int = 0
    num_mamba_slots: int = 0
    checkpoint_interval: int = 256
    eviction: str = "auto"
    speculative_states: bool = True
    memory_bytes: int = 0
    memory_fraction: float = 0.0
    state_bytes: int = 0
    kv_bytes_per_token: int = 0
    host_memory_bytes: int = 0
    running_share: float = 0.5
    rebalance: bool = False
    device_splits: tuple = ()

    def __post_init__(self):
        _positive("cache.page_size", self.page_size)
        _require(isinstance(self.running_share, int | float) and 0 < self.running_share <= 1,
                 f"cache.running_share must be in (0, 1], got {self.running_share!r}")
        for name in ("rebalance", "speculative_states"):
            value = getattr(self, name)
            _require(isinstance(value, bool), f"cache.{name} must be a bool, got {value!r}")
        _require(
            self.eviction in EVICTIONS,
            f"cache.eviction must be one of {EVICTIONS}, got {self.eviction!r}",
        )
        self._check_budget()
        self._check_pools()

    def _check_budget(self) -> None:
        """The byte budget's fields; ``rebalance`` and ``device_splits`` need one."""
        for name in ("memory_bytes", "state_bytes", "kv_bytes_per_token", "host_memory_bytes"):
            value = getattr(self, name)
            _require(isinstance(value, int) and not isinstance(value, bool) and value >= 0,
                     f"cache.{name} must be an int >= 0, got {value!r}")
        _require(isinstance(self.memory_fraction, int | float)
                 and 0 <= self.memory_fraction <= 1,
                 f"cache.memory_fraction must be in [0, 1], got {self.memory_fraction!r}")
        _require(not (self.memory_bytes and self.memory_fraction),
                 f"set one of cache.memory_bytes ({self.memory_bytes}) and "
                 f"cache.memory_fraction ({self.memory_fraction}), not both")
        _require(not self.rebalance or self.has_budget,
                 "cache.rebalance needs a byte budget (cache.memory_bytes or "
                 "cache.memory_fraction)")
        splits = tuple(tuple(int(x) for x in pair) for pair in self.device_splits)
        _require(all(len(p) == 2 and min(p) >= 1 for p in splits),
                 f"cache.device_splits must be (pages, slots) pairs >= 1, got "
                 f"{self.device_splits!r}")
        object.__setattr__(self, "device_splits", splits)

    def _check_pools(self) -> None:
        """Pool sizes: without a budget, 0 means the fixed pools' defaults (16384 / 64)."""
        if not self.has_budget:
            for name, default in FIXED_POOL_DEFAULTS.items():
                if getattr(self, name) == 0:
                    object.__setattr__(self, name, default)
        _require(isinstance(self.num_mamba_slots, int) and self.num_mamba_slots >= 0,
                 f"cache.num_mamba_slots must be an int >= 0, got {self.num_mamba_slots!r}")
        _require(
            isinstance(self.num_kv_tokens, int)
            and (self.num_kv_tokens >= self.page_size or self.num_kv_tokens == 0),
            f"cache.num_kv_tokens must be >= cache.page_size ({self.page_size}), "
            f"got {self.num_kv_tokens!r}",
        )
        _require(
            isinstance(self.checkpoint_interval, int) and self.checkpoint_interval >= 0,
            f"cache.checkpoint_interval must be >= 0, got {self.checkpoint_interval!r}",
        )

    def given(self) -> dict:
        """The section as the fields it was given (what ``EngineConfig.replace`` starts from):
        without a budget, a pool size at its fixed default is written back as 0, so that a
        budget added later derives that pool instead of capping it at the default."""
        data = dataclasses.asdict(self)
        if not self.has_budget:
            for name, default in FIXED_POOL_DEFAULTS.items():
                if data[name] == default:
                    data[name] = 0
        return data

    @property
    def num_pages(self) -> int:
        """Usable KV pages (page 0 is reserved on top of these)."""
        return self.num_kv_tokens // self.page_size

    @property
    def has_budget(self) -> bool:
        """A byte budget is set (``memory_bytes`` or ``memory_fraction``)."""
        return bool(self.memory_bytes or self.memory_fraction)

    @property
    def max_pages(self) -> int:
        """Page ids the cache hands out at most: the largest of ``device_splits``' pages."""
        return max([self.num_pages] + [p for p, _ in self.device_splits])

    @property
    def max_slots(self) -> int:
        """Slot ids the cache hands out at most: the largest of ``device_splits``' slots."""
        return max([self.num_mamba_slots] + [s for _, s in self.device_splits])

    @property
    def num_kv_tokens_set(self) -> bool:
        return self.num_kv_tokens > 0

    @property
    def num_mamba_slots_set(self) -> bool:
        return self.num_mamba_slots > 0
