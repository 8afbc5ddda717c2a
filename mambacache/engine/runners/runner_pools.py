"""``RunnerPools``, the ``ModelRunner``'s operations on its pools between steps: slot and page
copies, host-tier transfers (``host_pools.py``), the device split's resize, loss and reset.

Each is dispatched like a step (ordered by the pools' data dependency) and counted in the runner's
compile counters; a mixin, so the runner's ``Runner`` protocol methods keep their names.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mambacache.engine.runners.compiles import CompileCounter
from mambacache.engine.runners.pools import PoolState, pool_fields, resize_layerwise
from mambacache.engine.runners.step_program import copy_pages_fn, copy_slots_fn
from mambacache.engine.step.buckets import bucket


class RunnerPools:
    """Mixin of ``ModelRunner``: its pools outside the step programs (module docstring)."""

    pools: PoolState
    future: Any  # the device carry of the last step (``ModelRunner.future``)
    max_seqs: int
    copy_back: bool
    host_pools: Any  # [host tier] ``HostPools``, made on first use
    compiles: CompileCounter
    warm_compiles: CompileCounter

    def copy_slots(self, pairs: Sequence[tuple[int, int]]) -> None:
        """[speculative] ``pools[dst] <- pools[src]`` for every (src, dst) state slot pair, conv
        and SSM of every linear layer (a scratch end state into the running slot the tree
        adopts). Dispatched like a step: ordered by the pools' data dependency."""
        self._copy(copy_slots_fn(), pairs)

    def copy_pages(self, pairs: Sequence[tuple[int, int]]) -> None:
        """[speculative tree, page size > 1] ``pages[dst] <- pages[src]`` for every (src, dst)
        KV page pair, K and V of every attention layer (a branch row's first page gets the
        verified tokens before its start: ``engine/speculative/tree.py``). Dispatched like a
        step."""
        self._copy(copy_pages_fn(), pairs)

    def _copy(self, fn: Any, pairs: Sequence[tuple[int, int]]) -> None:
        """Run the donated copy program ``fn(pools, src, dst)`` over ``pairs`` padded to a
        bucket (pads copy slot / page 0 onto itself); no pairs: the warm-up's compile."""
        width = bucket(len(pairs), self.max_seqs)
        idx = np.zeros((2, width), np.int32)
        if pairs:
            idx[:, :len(pairs)] = np.asarray(pairs, np.int32).T
        counter = self.compiles if pairs else self.warm_compiles
        with counter.track():
            if self.host_pools is not None:  # [host tier] demotions read before the copy writes
                self.host_pools.flush(self.pools)
            self.pools = fn(self.pools, idx[0], idx[1])

    def transfer(self, t: Any, in_use: Any = None) -> None:
        """[host tier] Issue one ``cache.host_tier.Transfer`` (``engine/runners/host_pools.py``): a
        demotion is gathered before the next write of the pools, a promotion starts its load
        (``finish_load`` scatters it). Never waits for the device."""
        with self.compiles.track():
            self._host_pools().transfer(self.pools, t, in_use)

    def _host_pools(self) -> Any:
        """[host tier] The host pools, made on first use (host rows of the pools' device's
        memory kind: ``host_pools.host_memory_kind``)."""
        if self.host_pools is None:
            from mambacache.engine.runners.host_pools import HostPools, host_memory_kind

            leaf = jax.tree_util.tree_leaves(self.pools)[0]
            self.host_pools = HostPools(host_memory_kind(next(iter(leaf.devices()))),
                                        copy_back=self.copy_back)
        return self.host_pools

    def load_ready(self, device_slot: int) -> bool:
        """[host tier] Whether the load into ``device_slot`` has landed (no wait)."""
        return self.host_pools.load_ready(device_slot)

    def finish_load(self, device_slot: int) -> None:
        """[host tier] Scatter the load into ``device_slot`` into the pools (dispatched like a
        step: ordered before every later step by the pools)."""
        with self.compiles.track():
            self.pools = self.host_pools.finish_load(self.pools, device_slot)

    def warm_transfers(self, max_pages: int) -> None:
        """[host tier] Compile the tier's gather / scatter programs up to ``max_pages`` pages
        (``host_pools.warm``; no cached row changes)."""
        from mambacache.engine.runners.host_pools import warm

        with self.warm_compiles.track():
            self.pools = warm(self.pools, max_pages)
        self._host_pools().max_batch_pages = max_pages

    def resize_pools(self, num_pages: int, num_slots: int, *, warm: bool = False) -> None:
        """[rebalance] Pools of ``num_pages`` pages and ``num_slots`` slots from now on, one
        layer at a time (``pools.resize_layerwise``), ordered after every dispatched step by
        the pools' data dependency. ``warm``: the warm-up's (compiles counted there)."""
        fields = pool_fields(self.pools)
        self.pools = None  # the old arrays go as their new ones are made
        with (self.warm_compiles if warm else self.compiles).track():
            self.pools = resize_layerwise(fields, num_pages, num_slots)

    def pools_lost(self) -> bool:
        """True if a failed step consumed the donated pools (they must be rebuilt)."""
        leaves = jax.tree_util.tree_leaves((self.pools, self.future))
        return any(getattr(x, "is_deleted", lambda: False)() for x in leaves)

    def reset_pools(self) -> None:
        """Pools and carry of zeros, same shapes and shardings (after ``pools_lost``); the host
        pools emptied too."""
        shape_dtype = [(x.shape, x.dtype) for x in jax.tree_util.tree_leaves(self.pools)]
        treedef = jax.tree_util.tree_structure(self.pools)
        self.pools = jax.tree_util.tree_unflatten(
            treedef, [jax.numpy.zeros(s, d, device=x.sharding)  # [parallel] created sharded
                      for (s, d), x in zip(shape_dtype, jax.tree_util.tree_leaves(self.pools),
                                           strict=True)])
        self.future = jax.tree_util.tree_map(
            lambda x: jnp.zeros(x.shape, jnp.int32, device=x.sharding), self.future)
        if self.host_pools is not None:  # the cache (host tier included) starts empty too
            self.host_pools.reset()
