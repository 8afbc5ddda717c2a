"""One byte budget for KV pages and state slots: the sizes, the arithmetic, the pool plan.

``ByteBudget(limit_bytes, page_bytes, slot_bytes)``: KV pages (``page_bytes`` each: the KV of
``page_size`` tokens over every attention layer) and state slots (``slot_bytes`` each: conv +
recurrent state of every linear layer) draw on the same ``limit_bytes``. The cache
(``CacheBase`` with ``budget=``) keeps the invariant

    (pages held + pages in the tree) * page_bytes + (slots held + in the tree) * slot_bytes
        <= limit_bytes

at every allocation and evicts KV and states in one order to keep it (``eviction.py``); so the
split between the two follows the workload. The id ranges of the two allocators are what each
could hold alone next to one of the other (a request always holds one slot and one page):
``num_pages = (limit - slot_bytes) // page_bytes``, ``num_slots = (limit - page_bytes) //
slot_bytes``.

``budget_from_fraction``: ``cache.memory_fraction`` of what the device has left after the
weights and the step's peak temporaries (the numbers come from the plan / a measured step).
``plan_pools``: a ``CacheConfig`` + the model's byte sizes -> ``PoolPlan`` (explicit counts
override the budget; a budget that cannot hold one request of the context plus the running
slots is a ``ValueError`` with the numbers; a budget that both explicit counts cap below its
bytes is logged as a warning naming the cap). Host only: no JAX.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mambacache.config import CacheConfig

logger = logging.getLogger(__name__)

GIB = 2**30
#: device pools are two fixed arrays (not rebalanced between steps): a budget is split so that
#: each state comes with the KV of this many tokens (``device_state_share``). The best fixed
#: splits of issue 25's table sit there: a state = the KV of 409 tokens (7B mapping) -> 0.2-0.4
#: to states, 3,144 tokens (Qwen3-Next-80B-A3B) -> 0.6-0.8 (docs/bench.md 2026-12-02)
DEVICE_TOKENS_PER_STATE = 900
DEVICE_STATE_SHARE_RANGE = (0.1, 0.9)


def device_state_share(slot_bytes: int, page_bytes: int, page_size: int) -> float:
    """The states' share of a budget split into two fixed device pools: ``s / (s +
    DEVICE_TOKENS_PER_STATE)`` with ``s`` = a state's bytes in tokens of KV, within
    ``DEVICE_STATE_SHARE_RANGE``."""
    state_tokens = slot_bytes * page_size / page_bytes
    lo, hi = DEVICE_STATE_SHARE_RANGE
    return min(hi, max(lo, state_tokens / (state_tokens + DEVICE_TOKENS_PER_STATE)))


@dataclasses.dataclass(frozen=True)
class ByteBudget:
    """A shared byte budget (see the module docstring); every field in bytes."""

    limit_bytes: int
    page_bytes: int
    slot_bytes: int
    running_share: float = 1.0  # 1.0: no admission cap

    def __post_init__(self):
        for name in ("limit_bytes", "page_bytes", "slot_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ByteBudget.{name} must be a positive int, got {value!r}")
        if not 0 < self.running_share <= 1:
            raise ValueError(f"ByteBudget.running_share must be in (0, 1], got "
                             f"{self.running_share!r}")
        if self.limit_bytes < self.page_bytes + self.slot_bytes:
            raise ValueError(
                f"a budget of {self.limit_bytes} bytes cannot hold one KV page "
                f"({self.page_bytes} bytes) and one state slot ({self.slot_bytes} bytes)")

    @property
    def num_pages(self) -> int:
        """Page ids: as many pages as fit next to one state slot."""
        return (self.limit_bytes - self.slot_bytes) // self.page_bytes

    @property
    def num_slots(self) -> int:
        """Slot ids: as many slots as fit next to one KV page."""
        return (self.limit_bytes - self.page_bytes) // self.slot_bytes

    def request_bytes(self, num_pages: int) -> int:
        """Bytes a running request holds of its own: ``num_pages`` pages and its running slot."""
        return num_pages * self.page_bytes + self.slot_bytes

    def admits(self, running_bytes: int, new_bytes: int) -> bool:
        """Whether a request of ``new_bytes`` (``request_bytes``) may start next to running
        requests holding ``running_bytes`` (call it only while some run): within
        ``running_share`` of the budget."""
        return running_bytes + new_bytes <= self.running_share * self.limit_bytes


def budget_from_fraction(device_bytes: int, weight_bytes: int, peak_step_bytes: int,
                         fraction: float) -> int:
    """Cache bytes per device: ``fraction`` of ``device_bytes - weight_bytes - peak_step_bytes``
    (the step's peak temporaries, measured on the largest bucket). ``ValueError`` if nothing is
    left."""
    if not 0 < fraction <= 1:
        raise ValueError(f"cache.memory_fraction must be in (0, 1], got {fraction!r}")
    left = int(device_bytes) - int(weight_bytes) - int(peak_step_bytes)
    if left <= 0:
        raise ValueError(
            f"device memory {device_bytes} bytes - weights {weight_bytes} - step peak "
            f"{peak_step_bytes} = {left} bytes: nothing is left for the cache")
    return int(left * fraction)


@dataclasses.dataclass(frozen=True)
class PoolPlan:
    """Pool sizes for one device. ``budget`` is set when KV and states share the bytes."""

    num_pages: int
    num_slots: int
    page_bytes: int
    slot_bytes: int
    budget: ByteBudget | None = None

    @property
    def pool_bytes(self) -> int:
        """Bytes the two id ranges would take as separate pools (the budget's limit if shared)."""
        if self.budget is not None:
            return self.budget.limit_bytes
        return self.num_pages * self.page_bytes + self.num_slots * self.slot_bytes

    def describe(self) -> str:
        mode = f"shared budget {self.budget.limit_bytes / GIB:.3f} GiB" if self.budget else \
            f"fixed pools {self.pool_bytes / GIB:.3f} GiB"
        return (f"{mode}: up to {self.num_pages} KV pages of {self.page_bytes} bytes, up to "
                f"{self.num_slots} state slots of {self.slot_bytes} bytes")


def plan_pools(cache_cfg: CacheConfig, page_bytes: int, slot_bytes: int, *, context_len: int,
               max_running: int, memory_bytes: int | None = None,
               state_share: float = 0.0) -> PoolPlan:
    """Pool sizes from ``cache_cfg`` (a ``CacheConfig``) and the model's byte sizes.

    ``memory_bytes`` (else ``cache_cfg.memory_bytes``; 0 = none): the per-device budget. Without
    one, the explicit ``num_kv_tokens`` / ``num_mamba_slots`` are the pools. With one and no
    explicit count, KV and states share it (``ByteBudget``), or with ``state_share`` in (0, 1) it
    is split into two fixed pools at that share; with one explicit count the other pool gets the
    rest; both explicit cap their pools inside the budget. ``ValueError`` (with the numbers)
    when the budget cannot hold one request of ``context_len`` tokens plus ``max_running``
    running slots.
    """
    ps = cache_cfg.page_size
    limit = int(memory_bytes if memory_bytes is not None else cache_cfg.memory_bytes)
    explicit_kv = cache_cfg.num_kv_tokens_set
    explicit_slots = cache_cfg.num_mamba_slots_set
    if limit <= 0:
        return PoolPlan(cache_cfg.num_kv_tokens // ps, cache_cfg.num_mamba_slots, page_bytes,
                        slot_bytes)
    need_pages = -(-context_len // ps)
    need = need_pages * page_bytes + max_running * slot_bytes
    if limit < need:
        raise ValueError(
            f"cache budget {limit} bytes cannot hold one request of the context ({context_len} "
            f"tokens = {need_pages} pages x {page_bytes} bytes) plus {max_running} running "
            f"state slots x {slot_bytes} bytes = {need} bytes")
    budget = ByteBudget(limit, page_bytes, slot_bytes)
    if explicit_kv and explicit_slots:  # caps inside the shared budget
        warn_if_capped(cache_cfg, page_bytes, slot_bytes, limit)
        return PoolPlan(cache_cfg.num_kv_tokens // ps, cache_cfg.num_mamba_slots, page_bytes,
                        slot_bytes, budget)
    if not explicit_kv and not explicit_slots and 0 < state_share < 1:
        slots = int(limit * state_share) // slot_bytes
        pages = (limit - slots * slot_bytes) // page_bytes
        return _checked(PoolPlan(pages, slots, page_bytes, slot_bytes), max_running, need_pages)
    if explicit_kv:
        pages = cache_cfg.num_kv_tokens // ps
        slots = (limit - pages * page_bytes) // slot_bytes
        return _checked(PoolPlan(pages, slots, page_bytes, slot_bytes), max_running, need_pages)
    if explicit_slots:
        slots = cache_cfg.num_mamba_slots
        pages = (limit - slots * slot_bytes) // page_bytes
        return _checked(PoolPlan(pages, slots, page_bytes, slot_bytes), max_running, need_pages)
    return PoolPlan(budget.num_pages, budget.num_slots, page_bytes, slot_bytes, budget)


def warn_if_capped(cache_cfg: CacheConfig, page_bytes: int, slot_bytes: int,
                   limit: int) -> None:
    """Log a warning when both explicit pool sizes of ``cache_cfg`` hold fewer bytes than the
    budget ``limit``: the cache can use only what the two id ranges hold (a user who set a
    budget would get a fraction of it without a word)."""
    if not (cache_cfg.num_kv_tokens_set and cache_cfg.num_mamba_slots_set and limit):
        return
    cap = (cache_cfg.num_kv_tokens // cache_cfg.page_size * page_bytes
           + cache_cfg.num_mamba_slots * slot_bytes)
    if cap < limit:
        logger.warning(
            "cache budget %d bytes is capped at %d bytes (%.1f%%) by the explicit pool sizes "
            "cache.num_kv_tokens = %d and cache.num_mamba_slots = %d; unset both (0) to derive "
            "the pools from the budget", limit, cap, 100.0 * cap / limit,
            cache_cfg.num_kv_tokens, cache_cfg.num_mamba_slots)


def _checked(plan: PoolPlan, max_running: int, need_pages: int) -> PoolPlan:
    if plan.num_slots < max_running or plan.num_pages < need_pages:
        raise ValueError(
            f"the budget left {plan.num_pages} KV pages (a request of the context needs "
            f"{need_pages}) and {plan.num_slots} state slots ({max_running} running requests "
            f"need one each) after the explicit pool size")
    return plan
