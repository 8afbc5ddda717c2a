"""Pallas Triton (GPU) Mamba2 SSD prefill, the state side: the sequential inter-chunk pass and
the written targets (finals and snapshots at any offset), plus the dot helpers the SSD kernels
share. The parallel kernels and the wrapper are in ``gpu/ssd.py``.

``state_pass`` runs two launches:

1. ``_state_pass_kernel``, grid ``(B, H, P / BPS)``: walks a sequence's chunks carrying a
   ``[N, BPS]`` f32 tile, ``S <- exp(g_last) S + dS`` (elementwise: no product on the
   sequential path, few registers), stores the chunk's start state ``S0`` and serves the CSR
   targets of the chunk: row 0 gets ``S0``, rows >= the chunk's count (finals, chunk-end
   snapshots) the next state; a target inside the chunk gets ``S0`` in f32, which
2. ``_target_kernel``, grid ``(J, H, P / BP)`` (parallel over targets), completes in place:
   ``S_r = exp(g_r) S0 + B^T (exp(g_r - g) dt x)[:r]``.

Invariant: target slots are distinct and never read by the same call (the scheduler's rule,
see docs/kernels.md), so both launches write them without ordering between programs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels.gpu.gated_delta_rule import padded_ds

_F32 = jnp.float32


def _dot(a, b, precision, *, trans_a=False, trans_b=False):
    dims = (((0,) if trans_a else (1,)), ((1,) if trans_b else (0,)))
    return jax.lax.dot_general(a, b, (dims, ((), ())), precision=precision,
                               preferred_element_type=_F32)


def mm(a, b, f32_dot, **kw):
    """``a @ b`` f32-accumulated: narrow operands as they are, f32 ones at ``f32_dot``."""
    return _dot(a, b, None if a.dtype != _F32 else f32_dot, **kw)


def weighted_bt_x(bm, w, x, f32_dot):
    """``(B * w[:, None])^T x`` ``[N, BP]`` f32. bm ``[BT, N]``, x ``[BT, BP]`` in the input
    dtype, w ``[BT]`` f32; narrow inputs: the scaled B as two narrow terms ``hi + lo``."""
    bw = bm.astype(_F32) * w[:, None]
    if x.dtype == _F32:
        return _dot(bw, x, f32_dot, trans_a=True)
    hi = bw.astype(x.dtype)
    lo = (bw - hi.astype(_F32)).astype(x.dtype)
    return _dot(hi, x, None, trans_a=True) + _dot(lo, x, None, trans_a=True)


def last(v, lane, r):
    """``v[r - 1]`` of a ``[BT]`` vector (0 for r = 0) by a masked sum (no scalar extract)."""
    return jnp.sum(jnp.where(lane == r - 1, v, 0.0))


def load_chunk(b_ref, dt_ref, tok0, count, h, grp, a_h, *, bt, block_n, state_size):
    """B ``[BT, block_n]`` (input dtype), dt and the in-chunk cumulative log decay ``g``
    ``[BT]`` f32 of one chunk; rows >= count are zero (g flat there)."""
    lane = jnp.arange(bt)
    rmask = lane < count
    nmask = jnp.arange(block_n) < state_size
    tidx = pl.ds(tok0, bt)
    bm = pltr.load(b_ref.at[tidx, grp, padded_ds(block_n)], mask=rmask[:, None] & nmask[None, :],
                   other=0.0)
    dt = pltr.load(dt_ref.at[tidx, h], mask=rmask, other=0.0)
    return bm, dt, jnp.cumsum(dt * a_h), rmask


def _state_pass_kernel(cu_ref,      # [B+1] i32 packed sequence starts
                       read_ref,    # [B] i32 initial-state slot
                       coff_ref,    # [B+1] i32 first chunk of each sequence (targets CSR row)
                       tstart_ref,  # [NC+1] i32 targets CSR offsets per chunk
                       trow_ref,    # [J] i32 state after this many chunk rows (0..BT)
                       tslot_ref,   # [J] i32 destination slot (0 = dropped)
                       dt_ref,      # [T, H] f32
                       a_ref,       # [H] f32
                       states_ref,  # [NC, H, N, P] f32 dS (f32 inputs: alias of states_out)
                       pool_ref,    # [S, H, N, P] f32 initial states (alias of pool_out)
                       states_out,  # [NC, H, N, P] out: chunk start states S0 (input dtype)
                       pool_out,    # [S, H, N, P] f32 targets (inside a chunk: its S0)
                       *, bt: int, block_n: int, block_p: int, state_size: int):
    b, h, pt = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    start, end = cu_ref[b], cu_ref[b + 1]
    pmask = (pt * block_p + jnp.arange(block_p)) < pool_ref.shape[3]
    smask = (jnp.arange(block_n) < state_size)[:, None] & pmask[None, :]
    nidx, pidx = padded_ds(block_n), pl.ds(pt * block_p, block_p)
    a_h, lane = a_ref[h], jnp.arange(bt)
    state0 = pltr.load(pool_ref.at[read_ref[b], h, nidx, pidx], mask=smask, other=0.0)

    def chunk(c, s0):  # s0 [block_n, block_p] f32: the state at the chunk start
        tok0, cid = start + c * bt, coff_ref[b] + c
        count = jnp.minimum(end - tok0, bt)
        dt = pltr.load(dt_ref.at[pl.ds(tok0, bt), h], mask=lane < count, other=0.0)
        g_last = last(jnp.cumsum(dt * a_h), lane, bt)
        s_next = jnp.exp(g_last) * s0 + pltr.load(states_ref.at[cid, h, nidx, pidx], mask=smask,
                                                  other=0.0)
        pltr.store(states_out.at[cid, h, nidx, pidx], s0.astype(states_out.dtype), mask=smask)

        def write_target(j, carry):
            slot = tslot_ref[j]
            at_end = trow_ref[j] >= count

            @pl.when((slot > 0) & at_end)
            def _end():
                pltr.store(pool_out.at[slot, h, nidx, pidx], s_next, mask=smask)

            @pl.when((slot > 0) & jnp.logical_not(at_end))
            def _start():  # row 0 is S0 itself; inside the chunk _target_kernel completes it
                pltr.store(pool_out.at[slot, h, nidx, pidx], s0, mask=smask)

            return carry

        jax.lax.fori_loop(tstart_ref[cid], tstart_ref[cid + 1], write_target, 0)
        return s_next

    jax.lax.fori_loop(0, jax.lax.div(end - start + bt - 1, bt), chunk, state0)


def _target_kernel(tchunk_ref,  # [J] i32 chunk of each target (NC: none, done in XLA)
                   trow_ref,    # [J] i32 state after this many chunk rows (0..BT)
                   tslot_ref,   # [J] i32 destination slot (0 = dropped)
                   cstart_ref,  # [NC] i32 first token of each chunk
                   clen_ref,    # [NC] i32 tokens in each chunk
                   x_ref,       # [T, H, P]
                   dt_ref,      # [T, H] f32
                   a_ref,       # [H] f32
                   b_ref,       # [T, G, N]
                   pool_ref,    # [S, H, N, P] f32 (alias of pool_out): S0 at inner targets
                   pool_out,    # [S, H, N, P] f32
                   *, bt: int, block_n: int, block_p: int, state_size: int, group: int,
                   f32_dot):
    j, h, pt = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    num_chunks = cstart_ref.shape[0]
    c = jnp.minimum(tchunk_ref[j], num_chunks - 1)
    slot, r = tslot_ref[j], trow_ref[j]

    @pl.when((slot > 0) & (tchunk_ref[j] < num_chunks) & (r > 0) & (r < clen_ref[c]))
    def _inside():
        tok0 = cstart_ref[c]
        bm, dt, g, rmask = load_chunk(b_ref, dt_ref, tok0, r, h, jax.lax.div(h, group),
                                      a_ref[h], bt=bt, block_n=block_n, state_size=state_size)
        pmask = (pt * block_p + jnp.arange(block_p)) < x_ref.shape[2]
        smask = (jnp.arange(block_n) < state_size)[:, None] & pmask[None, :]
        nidx, pidx = padded_ds(block_n), pl.ds(pt * block_p, block_p)
        x = pltr.load(x_ref.at[pl.ds(tok0, bt), h, pidx], mask=rmask[:, None] & pmask[None, :],
                      other=0.0)
        s0 = pltr.load(pool_ref.at[slot, h, nidx, pidx], mask=smask, other=0.0)
        g_r = last(g, jnp.arange(bt), r)
        s_r = jnp.exp(g_r) * s0 + weighted_bt_x(bm, jnp.exp(g_r - g) * dt, x, f32_dot)
        pltr.store(pool_out.at[slot, h, nidx, pidx], s_r, mask=smask)


def state_pass(cu_seqlens, read_slot, chunk_off, cstart, clen, tstart, trow, tslot, x, dt, a, b,
               states, ssm_pool, *, chunk_size: int, block_n: int, block_p: int,
               block_p_state: int, group: int, f32_dot, params, interpret: bool):
    """Chunk start states ``[NC, H, N, P]`` (x's dtype; over ``states`` when that is f32) and
    the pool with every target written. ``states`` holds each chunk's dS (f32)."""
    num_heads, p, n = x.shape[1], x.shape[2], b.shape[2]
    sds = jax.ShapeDtypeStruct
    starts, ssm_pool = pl.pallas_call(
        functools.partial(_state_pass_kernel, bt=chunk_size, block_n=block_n,
                          block_p=block_p_state, state_size=n),
        grid=(read_slot.shape[0], num_heads, pl.cdiv(p, block_p_state)), interpret=interpret,
        out_shape=[sds(states.shape, x.dtype), sds(ssm_pool.shape, ssm_pool.dtype)],
        input_output_aliases={8: 0, 9: 1} if x.dtype == _F32 else {9: 1},
        compiler_params=params,
    )(cu_seqlens, read_slot, chunk_off, tstart, trow, tslot, dt, a, states, ssm_pool)
    num_targets = trow.shape[0]
    tchunk = (jnp.searchsorted(tstart, jnp.arange(num_targets), side="right") - 1)
    ssm_pool = pl.pallas_call(
        functools.partial(_target_kernel, bt=chunk_size, block_n=block_n, block_p=block_p,
                          state_size=n, group=group, f32_dot=f32_dot),
        grid=(num_targets, num_heads, pl.cdiv(p, block_p)), interpret=interpret,
        out_shape=sds(ssm_pool.shape, ssm_pool.dtype), input_output_aliases={9: 0},
        compiler_params=params,
    )(tchunk.astype(jnp.int32), trow, tslot, cstart, clen, x, dt, a, b, ssm_pool)
    return starts, ssm_pool
