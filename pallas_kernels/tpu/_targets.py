"""In-kernel helpers shared by the TPU chunked recurrences (gated delta rule, SSD, KDA): the
state after any row of a chunk, and the write of a chunk's state targets (the CSR table that
``_common.extend_targets`` builds: finals and snapshots, per request) to the pool by DMA."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu


def decayed_state_after(s0, keys, u, gc, gr, dot) -> Callable:
    """``r -> S_r = exp(g_r) S0 + keys^T (exp(g_r - g_j) [j < r] * u)``, the state after the
    first ``r`` rows (0..BT) of a chunk with a scalar decay per row.

    s0 ``[Dk, Dv]`` f32 chunk-start state; keys ``[BT, Dk]``; u ``[BT, Dv]`` the values each row
    writes; gc ``[BT, 1]`` / gr ``[1, BT]`` the in-chunk cumulative log-decay as a column / row.
    """
    bt = keys.shape[0]
    lane = jax.lax.broadcasted_iota(jnp.int32, (1, bt), 1)
    row = jax.lax.broadcasted_iota(jnp.int32, (bt, 1), 0)

    def state_after(r):
        g_r = jnp.sum(jnp.where(lane == r - 1, gr, 0.0), axis=1, keepdims=True)  # [1, 1]
        w = jnp.where(row < r, jnp.exp(g_r - gc), 0.0)                       # [BT, 1]
        return jnp.exp(g_r) * s0 + dot(keys, w * u, trans_a=True)

    return state_after


def write_state_targets(state_after: Callable, *, h, c, bt: int, tstart_ref, trow_ref,
                        tslot_ref, snap_ref, pool_out, state_ref) -> None:
    """For each target ``j`` of chunk ``c`` (``tstart[c] <= j < tstart[c + 1]``), DMA the state
    after ``trow[j]`` rows to ``pool_out[tslot[j], h]`` (slot 0: dropped); then carry the state
    after the whole chunk in ``state_ref``. snap_ref ``[Dk, Dv]`` f32 VMEM staging."""

    def write_target(j, carry):
        slot = tslot_ref[j]

        @pl.when(slot > 0)
        def _write():
            snap_ref[...] = state_after(trow_ref[j])
            pltpu.sync_copy(snap_ref, pool_out.at[slot, h])

        return carry

    jax.lax.fori_loop(tstart_ref[c], tstart_ref[c + 1], write_target, 0)
    state_ref[...] = state_after(bt)
