"""Device-side pools: KV pages per full-attention layer, conv and SSM state slots per linear layer.

``PoolState`` is an immutable pytree. Jitted steps take it with ``donate_argnums`` and return the
updated one; the data dependency orders every write before every later read.

Reserved ids (host allocators never hand them out):
  * KV page 0 is the dump page: padding tokens write their K/V there; nothing reads it as valid.
  * State slot 0 is the zero state: it stays all zeros; a write aimed at slot 0 is dropped.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from absl import logging


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PoolState:
    """KV pages and recurrent-state slots, one array per layer of each kind.

    Attributes:
      k_pages, v_pages: per full-attention layer, ``[num_pages + 1, page_size, num_kv_heads,
        head_dim]`` in the model dtype (page 0 = dump page). MLA layers (Kimi Linear) keep one
        latent row per token in ``k_pages`` (``[..., 1, kv_lora_rank + qk_rope_head_dim]``) and
        have no ``v_pages``: a layer kind brings its row shape, pages and tree are shared.
      conv: per linear layer, ``[num_slots + 1, conv_kernel_size - 1, conv_dim]`` in the model
        dtype: the last ``kernel - 1`` inputs of the causal conv, oldest first (slot 0 = zeros).
      ssm: per linear layer, ``[num_slots + 1, num_v_heads, head_k_dim, head_v_dim]`` float32:
        the delta-rule state S with ``o_t = S_t^T q_t`` (slot 0 = zeros).
    """

    k_pages: tuple[jax.Array, ...]
    v_pages: tuple[jax.Array, ...]
    conv: tuple[jax.Array, ...]
    ssm: tuple[jax.Array, ...]

    @property
    def num_pages(self) -> int:
        """Pages per layer, the reserved page 0 included."""
        return int(self.k_pages[0].shape[0]) if self.k_pages else 0

    @property
    def num_slots(self) -> int:
        """State slots per layer, the reserved slot 0 included."""
        return int(self.ssm[0].shape[0]) if self.ssm else 0

    def replace(self, **changes: Any) -> PoolState:
        return dataclasses.replace(self, **changes)

    @classmethod
    def create(cls, model_cfg: Any, num_pages: int, page_size: int, num_slots: int,
               dtype: Any = jnp.float32,
               sharding: Callable[[str], Any] | None = None,
               extra_kv_layers: int = 0) -> PoolState:
        """Zero pools for ``model_cfg`` with ``num_pages`` usable pages and ``num_slots`` slots.

        ``model_cfg`` needs ``num_full_layers``, ``num_linear_layers``, ``kv_row_shape`` (a
        layer kind's KV row: ``(Hkv, head_dim)``, or MLA's one latent row ``(1, R + dr)``),
        ``kv_arrays_per_layer`` (2: K and V; 1: MLA, ``v_pages`` empty),
        ``linear_conv_kernel_dim``, ``linear_conv_dim``, ``linear_num_value_heads``,
        ``linear_key_head_dim`` and ``linear_value_head_dim`` (see ``models.config.ModelConfig``).
        ``sharding``: (field name, shape) -> ``jax.sharding.Sharding``
        (``parallel.pool_field_sharding``);
        each device then allocates only its shard (no whole pool on one device). ``None``: the
        default device. ``extra_kv_layers``: KV layers after the model's (the MTP head's: the
        last ``k_pages`` / ``v_pages``; ``models/mtp.py``).
        """
        c = model_cfg
        kv_shape = (num_pages + 1, page_size, *c.kv_row_shape)
        num_kv = c.num_full_layers + extra_kv_layers
        num_v = num_kv if c.kv_arrays_per_layer == 2 else 0
        conv_shape = (num_slots + 1, c.linear_conv_kernel_dim - 1, c.linear_conv_dim)
        ssm_shape = (num_slots + 1, c.linear_num_value_heads, c.linear_key_head_dim,
                     c.linear_value_head_dim)

        def zeros(field: str, shape: tuple[int, ...], dt: Any, count: int) -> tuple:
            device = sharding(field, shape) if sharding is not None else None
            return tuple(jnp.zeros(shape, dt, device=device) for _ in range(count))

        return cls(
            k_pages=zeros("k_pages", kv_shape, dtype, num_kv),
            v_pages=zeros("v_pages", kv_shape, dtype, num_v),
            conv=zeros("conv", conv_shape, dtype, c.num_linear_layers),
            ssm=zeros("ssm", ssm_shape, jnp.float32, c.num_linear_layers),
        )

    def resized(self, num_pages: int, num_slots: int) -> PoolState:
        """The pools with ``num_pages`` usable pages and ``num_slots`` slots (reserved rows
        apart): rows ``[0, min(old, new))`` copied, new rows zero, rows past a shrink dropped
        (the caller frees those ids first). The building block of a rebalance between steps:
        one copy per array, and the step recompiles for the new row counts."""
        if num_pages < 1 or num_slots < 1:
            raise ValueError(f"resized needs >= 1 page and slot, got {num_pages}, {num_slots}")

        def rows(arrays: tuple, n: int) -> tuple:
            out = []
            for a in arrays:
                keep = min(n, a.shape[0])
                fresh = jnp.zeros((n, *a.shape[1:]), a.dtype, device=a.sharding)
                out.append(jax.lax.dynamic_update_slice_in_dim(fresh, a[:keep], 0, 0))
            return tuple(out)

        return PoolState(k_pages=rows(self.k_pages, num_pages + 1),
                         v_pages=rows(self.v_pages, num_pages + 1),
                         conv=rows(self.conv, num_slots + 1), ssm=rows(self.ssm, num_slots + 1))

    def device_nbytes(self) -> dict[str, int]:
        """``nbytes`` on one device (a tensor-parallel pool's shard: the budget is per device)."""
        def one(arrays: tuple) -> int:
            return sum(int(a.addressable_shards[0].data.nbytes) for a in arrays)

        return {"full": one(self.k_pages + self.v_pages), "mamba": one(self.conv + self.ssm)}

    def nbytes(self) -> dict[str, int]:
        """Bytes held by the KV pages (``full``) and by the state slots (``mamba``)."""
        full = sum(a.nbytes for a in self.k_pages + self.v_pages)
        mamba = sum(a.nbytes for a in self.conv + self.ssm)
        return {"full": int(full), "mamba": int(mamba)}


# ------------------------------------------------------------------------------- moving
_POOL_FIELDS = ("k_pages", "v_pages", "conv", "ssm")


def resize_layerwise(fields: dict[str, list], num_pages: int, num_slots: int) -> PoolState:
    """The pools of ``fields`` (``{field: [array per layer]}``, taken from a ``PoolState``
    the caller no longer holds) with ``num_pages`` pages and ``num_slots`` slots (reserved
    rows apart), resized one layer at a time, the shrinking pool's layers first: each old
    array is dropped as its new one is made, so the peak is the pools plus one layer's new
    array. Rows ``[0, min(old, new))`` copied, new rows zero (FREE ids: written before read).
    One small program per (array shape, rows), compiled by the engine's warm-up."""
    if num_pages < 1 or num_slots < 1:
        raise ValueError(f"resize needs >= 1 page and slot, got {num_pages}, {num_slots}")
    rows = {"k_pages": num_pages + 1, "v_pages": num_pages + 1, "conv": num_slots + 1,
            "ssm": num_slots + 1}

    def grows(f: str) -> bool:
        return bool(fields[f]) and rows[f] > fields[f][0].shape[0]

    for f in sorted(_POOL_FIELDS, key=grows):  # shrinking (and unchanged) fields first
        arrays = fields[f]
        for i in range(len(arrays)):
            if arrays[i].shape[0] != rows[f]:
                arrays[i] = _resize_fn(rows[f])(arrays[i])  # the old array's last reference
    return PoolState(**{f: tuple(fields[f]) for f in _POOL_FIELDS})


def _resize_rows(a: jax.Array, *, rows: int) -> jax.Array:
    keep = min(rows, a.shape[0])
    return jnp.zeros((rows, *a.shape[1:]), a.dtype).at[:keep].set(a[:keep])


@functools.cache
def _resize_fn(rows: int):
    return jax.jit(functools.partial(_resize_rows, rows=rows))


def pool_fields(pools: PoolState) -> dict[str, list]:
    """``{field: [array per layer]}`` of ``pools`` (for ``resize_layerwise``)."""
    return {f: list(getattr(pools, f)) for f in _POOL_FIELDS}


# ------------------------------------------------------------------------------- sizing
def model_byte_sizes(cfg: Any, model_cfg: Any) -> tuple[int, int]:
    """``(state_bytes, kv_bytes_per_token)`` for ``cfg`` (an ``EngineConfig``): the cache
    section's overrides, else ``models.sizes`` of ``model_cfg`` in the model dtype (at least 1
    byte each, so a model without linear or attention layers still has a unit)."""
    state, kv = cfg.cache.state_bytes, cfg.cache.kv_bytes_per_token
    if not (state and kv):
        if not hasattr(model_cfg, "num_linear_layers"):
            raise ValueError(
                "a byte budget needs cache.state_bytes and cache.kv_bytes_per_token for a runner "
                f"without a model ({type(model_cfg).__name__}), got {state} and {kv}")
        from models.sizes import kv_bytes_per_token, state_bytes_per_slot

        dtype = jnp.dtype(cfg.model.dtype)
        state = state or state_bytes_per_slot(model_cfg, dtype)
        if not kv:
            kv = kv_bytes_per_token(model_cfg, dtype)
            layers = model_cfg.num_full_layers
            if cfg.speculative.method == "mtp" and layers:  # the MTP head's own KV layer
                kv = kv * (layers + 1) // layers
    return max(int(state), 1), max(int(kv), 1)


def size_pools(cfg: Any, model_cfg: Any, *, memory_bytes: int | None = None,
               physical: bool = False, context_len: int | None = None,
               device_sizes: tuple[int, int] | None = None) -> tuple[Any, Any]:
    """``(cfg, plan)``: ``cfg`` with the cache section's pools derived from its byte budget
    (``cache/budget.py``: ``plan_pools``) and the byte sizes filled in; unchanged without a
    budget. ``memory_bytes``: the budget when the config gives a fraction (measured on the
    device: ``parallel.sizing.device_cache_budget``). ``physical``: pools that are device
    arrays (the model runner): a shared budget is split there at ``device_state_share`` of
    the bytes for states (a state with the KV of ``DEVICE_TOKENS_PER_STATE`` tokens; at least
    two slots per running request; never beyond the budget); the host-only runners (shadow,
    simulator) share it. ``cache.rebalance``: split as the device's pools are, on any runner,
    and ``cache.device_splits`` set (``cache/rebalance.py``: the formula's split and its
    neighbours; the pools start at the formula's and move: ``engine/runners/rebalance.py``).
    ``device_sizes``: ``(state_bytes, kv_bytes_per_token)`` per device as the mesh lays the
    pools out (tensor parallelism shards
    them: ``parallel.sizing.unit_bytes``); the budget is per device."""
    from mambacache.cache.budget import device_state_share, plan_pools

    cc = cfg.cache
    sized = cc.num_kv_tokens and cc.num_mamba_slots and cc.state_bytes and cc.kv_bytes_per_token
    if not cc.has_budget or (sized and cc.memory_bytes and memory_bytes is None):
        # no budget, or sized already (a config this function returned): the pools it names
        page, state = cc.kv_bytes_per_token * cc.page_size or 1, cc.state_bytes or 1
        return cfg, plan_pools(cc, page, state, context_len=1, max_running=1, memory_bytes=0)
    physical = physical or cc.rebalance  # a moving split is a split of device-like pools
    limit = memory_bytes if memory_bytes is not None else cc.memory_bytes
    if not limit:
        raise ValueError(f"cache.memory_fraction ({cc.memory_fraction}) needs the device's "
                         "measured memory (parallel.sizing.device_cache_budget); on CPU set "
                         "cache.memory_bytes")
    state, kv = device_sizes if device_sizes is not None else model_byte_sizes(cfg, model_cfg)
    ctx = context_len or getattr(model_cfg, "max_position_embeddings", 0) or 4096
    usable = int(limit)
    if physical:  # the reserved page 0 and slot 0, speculative scratch slots: device rows too
        from mambacache.engine.speculative.verify import num_state_slots

        scratch = num_state_slots(cfg) - cc.num_mamba_slots
        usable -= kv * cc.page_size + (1 + scratch) * state
    running = cfg.scheduler.max_running_requests
    share = 0.0
    if physical:  # at least two slots per running request (its running slot + a snapshot)
        share = min(0.9, max(device_state_share(state, kv * cc.page_size, cc.page_size),
                             2 * running * state / max(usable, 1)))
    plan = plan_pools(cc, kv * cc.page_size, state, context_len=ctx, max_running=running,
                      memory_bytes=usable, state_share=share)
    logging.info("cache pools from the byte budget (%d bytes per device): %s", limit,
                 plan.describe())
    splits: tuple = ()
    if cc.rebalance and not (cc.num_kv_tokens_set or cc.num_mamba_slots_set):
        from mambacache.cache.rebalance import device_splits

        splits, _ = device_splits(usable, kv * cc.page_size, state, share,
                                  min_pages=-(-ctx // cc.page_size), min_slots=2 * running)
        logging.info("device splits (pages, slots) the pools move between: %s", splits)
    sized = cfg.replace(**{"cache.memory_bytes": int(limit), "cache.memory_fraction": 0.0,
                           "cache.state_bytes": state, "cache.kv_bytes_per_token": kv,
                           "cache.num_kv_tokens": plan.num_pages * cc.page_size,
                           "cache.num_mamba_slots": plan.num_slots,
                           "cache.device_splits": splits})
    return sized, plan
