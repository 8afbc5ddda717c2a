"""Pallas Triton (GPU) Mamba2 SSD kernels: chunked ragged prefill with snapshots at any offset,
and the recurrent decode step; pools updated in place.

Same contract as ``reference.ssd`` (state ``[H, N, P]`` per slot; math in ``docs/kernels.md``
and ``tpu/ssd.py``). Prefill grid ``(B, H, P / BP)``: one program per (sequence, head, head-dim
tile) loads the initial state tile ``[N, BP]`` of ``read_slot[b]``, walks the sequence's chunks
of ``BT`` tokens in a ``fori_loop`` carrying the state in registers, and stores every state the
targets table asks for (finals and snapshots, the state after any row of a chunk). Decode grid
``(B, H)``: one token, the whole ``[N, P]`` state of one head. N and P need not be powers of
two (masked loads and stores).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels._common import (
    check,
    check_chunk_size,
    chunk_layout,
    extend_targets,
    max_chunks,
    token_seq_ids,
)
from pallas_kernels.gpu.gated_delta_rule import pow2_at_least_16
from pallas_kernels.reference.ssd import check_ssd

_F32 = jnp.float32
_HIGHEST = (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST)  # IEEE fp32 dots
BLOCK_P = 32    # head-dim tile of the state held by one program
NUM_WARPS = 8   # BT 32, BP 32, 8 warps: 183 spill instructions at Nemotron-H sizes in the sm_90
                # gate (BT 64, BP 64, 4 warps: 35,443); fp32 dots (HIGHEST): exact, no tensor cores


def _dot(a, b, *, trans_a=False, trans_b=False):
    dims = (((0,) if trans_a else (1,)), ((1,) if trans_b else (0,)))
    return jax.lax.dot_general(a, b, (dims, ((), ())), precision=_HIGHEST,
                               preferred_element_type=_F32)


def _ssd_extend_kernel(cu_ref,      # [B+1] i32 packed sequence starts
                       read_ref,    # [B] i32 initial-state slot
                       coff_ref,    # [B+1] i32 first chunk of each sequence (targets CSR row)
                       tstart_ref,  # [NC+1] i32 targets CSR offsets per chunk
                       trow_ref,    # [J] i32 state after this many chunk rows (0..BT)
                       tslot_ref,   # [J] i32 destination slot (0 = dropped)
                       x_ref,       # [T, H, P]
                       dt_ref,      # [T, H] f32
                       a_ref,       # [H] f32
                       b_ref,       # [T, G, N]
                       c_ref,       # [T, G, N]
                       d_ref,       # [H] f32
                       pool_ref,    # [S, H, N, P] f32 initial states (alias of pool_out)
                       y_ref,       # [T, H, P] output (padding tokens left unwritten)
                       pool_out,    # [S, H, N, P] f32 finals and snapshots
                       *, chunk_size: int, state_size: int, block_n: int, block_p: int,
                       group: int):
    b, h, pt = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    bt, grp = chunk_size, jax.lax.div(h, group)
    start, end = cu_ref[b], cu_ref[b + 1]
    p0 = pt * block_p
    nmask = jnp.arange(block_n) < state_size
    pmask = (p0 + jnp.arange(block_p)) < y_ref.shape[2]
    smask = nmask[:, None] & pmask[None, :]
    nidx, pidx = pl.ds(0, block_n), pl.ds(p0, block_p)
    state0 = pltr.load(pool_ref.at[read_ref[b], h, nidx, pidx], mask=smask, other=0.0)
    a_h, d_h = a_ref[h], d_ref[h]
    lane = jnp.arange(bt)
    rows = jax.lax.broadcasted_iota(jnp.int32, (bt, bt), 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, (bt, bt), 1)

    def chunk(c, s0):  # s0 [block_n, block_p] f32: state at the chunk start
        tok0 = start + c * bt
        rmask = (tok0 + lane) < end
        tidx = pl.ds(tok0, bt)
        bc_mask, xp_mask = rmask[:, None] & nmask[None, :], rmask[:, None] & pmask[None, :]
        bm = pltr.load(b_ref.at[tidx, grp, nidx], mask=bc_mask, other=0.0).astype(_F32)
        cm = pltr.load(c_ref.at[tidx, grp, nidx], mask=bc_mask, other=0.0).astype(_F32)
        x = pltr.load(x_ref.at[tidx, h, pidx], mask=xp_mask, other=0.0).astype(_F32)
        dt = pltr.load(dt_ref.at[tidx, h], mask=rmask, other=0.0)
        gcum = jnp.cumsum(dt * a_h)                                       # [BT]
        decay = jnp.exp(jnp.where(rows >= cols, gcum[:, None] - gcum[None, :], -jnp.inf))
        u = dt[:, None] * x
        y = (jnp.exp(gcum)[:, None] * _dot(cm, s0)
             + _dot(decay * _dot(cm, bm, trans_b=True), u) + d_h * x)
        pltr.store(y_ref.at[tidx, h, pidx], y.astype(y_ref.dtype), mask=xp_mask)

        def state_after(r):  # state after the first r rows of the chunk (0..BT)
            g_r = jnp.sum(jnp.where(lane == r - 1, gcum, 0.0))
            w = jnp.where(lane < r, jnp.exp(g_r - gcum), 0.0)
            return jnp.exp(g_r) * s0 + _dot(bm, w[:, None] * u, trans_a=True)

        def write_target(j, carry):
            slot = tslot_ref[j]

            @pl.when(slot > 0)
            def _write():
                pltr.store(pool_out.at[slot, h, nidx, pidx], state_after(trow_ref[j]),
                           mask=smask)

            return carry

        cid = coff_ref[b] + c
        jax.lax.fori_loop(tstart_ref[cid], tstart_ref[cid + 1], write_target, 0)
        return state_after(bt)

    jax.lax.fori_loop(0, jax.lax.div(end - start + bt - 1, bt), chunk, state0)


@functools.partial(jax.jit, static_argnames=("chunk_size", "interpret"),
                   donate_argnames=("ssm_pool",))
def ssd_extend(x, dt, a, b, c, d, ssm_pool, cu_seqlens, read_slot, write_slot, snap_seq,
               snap_offset, snap_slot, *, chunk_size: int = 32, interpret: bool = False):
    """Pallas Triton chunked prefill; the contract of ``ssd_extend_reference``. ``chunk_size``
    must be a power of two >= 16 here (Triton tiles; 32 keeps the register tiles small).
    Returns ``(y, ssm_pool)``."""
    num_heads, p, g, n = check_ssd(x, dt, a, b, c, d, ssm_pool)
    check_chunk_size(chunk_size)
    check(chunk_size >= 16 and chunk_size & (chunk_size - 1) == 0,
          f"chunk_size {chunk_size} must be a power of two >= 16 on GPU")
    num_tokens, num_seqs = x.shape[0], read_slot.shape[0]
    num_chunks = max_chunks(num_tokens, chunk_size, num_seqs)
    _, _, _, chunk_off = chunk_layout(cu_seqlens, num_tokens, chunk_size, num_chunks)
    ssm_pool, tstart, trow, tslot = extend_targets(
        ssm_pool, cu_seqlens, read_slot, write_slot, snap_seq, snap_offset, snap_slot,
        chunk_off, chunk_size, num_chunks)
    block_p = min(BLOCK_P, pow2_at_least_16(p))
    kernel = functools.partial(_ssd_extend_kernel, chunk_size=chunk_size, state_size=n,
                               block_n=pow2_at_least_16(n), block_p=block_p,
                               group=num_heads // g)
    i32 = lambda v: jnp.asarray(v, jnp.int32)
    y, ssm_pool = pl.pallas_call(
        kernel, grid=(num_seqs, num_heads, pl.cdiv(p, block_p)),
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype),
                   jax.ShapeDtypeStruct(ssm_pool.shape, ssm_pool.dtype)],
        input_output_aliases={12: 1}, interpret=interpret,
        compiler_params=pltr.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
    )(i32(cu_seqlens), i32(read_slot), chunk_off, tstart, trow, tslot, x, dt.astype(_F32),
      a.astype(_F32), b, c, d.astype(_F32), ssm_pool)
    _, valid = token_seq_ids(cu_seqlens, num_tokens)
    return jnp.where(valid[:, None, None], y, 0).astype(x.dtype), ssm_pool


def _ssd_decode_kernel(read_ref,   # [B] i32
                       write_ref,  # [B] i32 (0 = dropped)
                       x_ref,      # [B, H, P]
                       dt_ref,     # [B, H] f32
                       a_ref,      # [H] f32
                       b_ref,      # [B, G, N]
                       c_ref,      # [B, G, N]
                       d_ref,      # [H] f32
                       pool_ref,   # [S, H, N, P] f32 (alias of pool_out)
                       y_ref,      # [B, H, P]
                       pool_out,   # [S, H, N, P] f32
                       *, state_size: int, head_dim: int, block_n: int, block_p: int,
                       group: int):
    i, h = pl.program_id(0), pl.program_id(1)
    grp = jax.lax.div(h, group)
    nmask, pmask = jnp.arange(block_n) < state_size, jnp.arange(block_p) < head_dim
    smask = nmask[:, None] & pmask[None, :]
    nidx, pidx = pl.ds(0, block_n), pl.ds(0, block_p)
    state = pltr.load(pool_ref.at[read_ref[i], h, nidx, pidx], mask=smask, other=0.0)
    x = pltr.load(x_ref.at[i, h, pidx], mask=pmask, other=0.0).astype(_F32)
    bv = pltr.load(b_ref.at[i, grp, nidx], mask=nmask, other=0.0).astype(_F32)
    cv = pltr.load(c_ref.at[i, grp, nidx], mask=nmask, other=0.0).astype(_F32)
    dt = dt_ref[i, h]
    state = jnp.exp(dt * a_ref[h]) * state + (dt * bv)[:, None] * x[None, :]
    y = jnp.sum(state * cv[:, None], axis=0) + d_ref[h] * x
    pltr.store(y_ref.at[i, h, pidx], y.astype(y_ref.dtype), mask=pmask)

    @pl.when(write_ref[i] > 0)
    def _write():
        pltr.store(pool_out.at[write_ref[i], h, nidx, pidx], state, mask=smask)


@functools.partial(jax.jit, static_argnames=("interpret",), donate_argnames=("ssm_pool",))
def ssd_decode(x, dt, a, b, c, d, ssm_pool, read_slot, write_slot, *, interpret: bool = False):
    """Pallas Triton decode; the contract of ``ssd_decode_reference``. Returns ``(y, pool)``."""
    num_heads, p, g, n = check_ssd(x, dt, a, b, c, d, ssm_pool)
    kernel = functools.partial(_ssd_decode_kernel, state_size=n, head_dim=p,
                               block_n=pow2_at_least_16(n), block_p=pow2_at_least_16(p),
                               group=num_heads // g)
    i32 = lambda v: jnp.asarray(v, jnp.int32)
    return pl.pallas_call(
        kernel, grid=(x.shape[0], num_heads),
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype),
                   jax.ShapeDtypeStruct(ssm_pool.shape, ssm_pool.dtype)],
        input_output_aliases={8: 1}, interpret=interpret,
        compiler_params=pltr.CompilerParams(num_warps=4, num_stages=1),
    )(i32(read_slot), i32(write_slot), x, dt.astype(_F32), a.astype(_F32), b, c,
      d.astype(_F32), ssm_pool)
