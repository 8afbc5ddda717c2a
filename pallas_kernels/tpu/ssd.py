"""TPU (Mosaic) Mamba2 SSD kernels: chunked ragged prefill with snapshots at any offset, and the
recurrent decode step; pools updated in place.

Same contract as ``reference.ssd`` (state ``[H, N, P]`` per slot; math in ``docs/kernels.md``).
Prefill layout (built by ``ssd_extend``): every sequence is cut into chunks of ``BT`` tokens
that never span two sequences (zero rows past its end: ``dt = 0`` leaves the state unchanged).
Grid ``(H, NC)``: heads in parallel, chunks in order, the running state in VMEM scratch. Per
chunk, with ``g`` the in-chunk cumulative ``dt * A``, ``u = dt * x`` and ``S0`` the chunk-start
state: ``y = exp(g) (C S0) + (exp(g_i - g_j) [j <= i] * C B^T) u`` and the state after ``r``
rows ``S_r = exp(g_r) S0 + B^T (exp(g_r - g_j) [j < r] * u)``, written for every target of the
chunk (finals and snapshots, per request). ``D x`` is added by the wrapper.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._common import (
    check_chunk_size,
    chunk_layout,
    extend_targets,
    max_chunks,
    token_seq_ids,
)
from pallas_kernels.reference.ssd import check_ssd, expand_groups
from pallas_kernels.tpu._targets import decayed_state_after, write_state_targets

_F32 = jnp.float32


def _dot(a, b, *, trans_a=False, trans_b=False):
    dims = (((0,) if trans_a else (1,)), ((1,) if trans_b else (0,)))
    return jax.lax.dot_general(a, b, (dims, ((), ())), preferred_element_type=_F32)


def _ssd_chunk_kernel(first_ref, read_ref, tstart_ref, trow_ref, tslot_ref,  # SMEM scalars
                      c_ref,      # [BT, N] C of this chunk (group h // (H / G))
                      b_ref,      # [BT, N] B
                      x_ref,      # [BT, P] x
                      dt_ref,     # [BT, 1] f32 dt (0 on zero rows)
                      gcol_ref,   # [BT, 1] f32 in-chunk cumulative dt * A
                      grow_ref,   # [1, BT] f32 the same as a row
                      pool_ref,   # [S, H, N, P] f32 HBM: initial states (alias of pool_out)
                      y_ref,      # [BT, P] f32 output without the D x term
                      pool_out,   # [S, H, N, P] f32 HBM: final states, snapshots
                      state_ref,  # [N, P] f32 scratch: state at this chunk's start
                      snap_ref):  # [N, P] f32 scratch: staging for DMA to the pool
    h, c = pl.program_id(0), pl.program_id(1)
    bt = x_ref.shape[0]

    @pl.when(first_ref[c] == 1)
    def _load_initial():
        pltpu.sync_copy(pool_ref.at[read_ref[c], h], state_ref)

    cm, bm = c_ref[...].astype(_F32), b_ref[...].astype(_F32)
    u = dt_ref[...] * x_ref[...].astype(_F32)                            # [BT, P]
    gc, gr = gcol_ref[...], grow_ref[...]
    rows = jax.lax.broadcasted_iota(jnp.int32, (bt, bt), 0)
    decay = jnp.exp(jnp.where(rows >= jax.lax.broadcasted_iota(jnp.int32, (bt, bt), 1),
                              gc - gr, -jnp.inf))                         # exp(g_i - g_j), j<=i
    s0 = state_ref[...]
    y_ref[...] = jnp.exp(gc) * _dot(cm, s0) + _dot(decay * _dot(cm, bm, trans_b=True), u)
    write_state_targets(decayed_state_after(s0, bm, u, gc, gr, _dot), h=h, c=c, bt=bt,
                        tstart_ref=tstart_ref, trow_ref=trow_ref, tslot_ref=tslot_ref,
                        snap_ref=snap_ref, pool_out=pool_out, state_ref=state_ref)


@functools.partial(jax.jit, static_argnames=("interpret",), donate_argnames=("ssm_pool",))
def ssd_chunk_call(first, read, tstart, trow, tslot, cg, bg, x, dt, gcol, grow, ssm_pool, *,
                   interpret: bool = False):
    """Run the kernel on chunked inputs. cg, bg ``[G, NC, BT, N]``; x ``[H, NC, BT, P]``; dt,
    gcol ``[H, NC, BT, 1]``; grow ``[H, NC, 1, BT]``; per-chunk ``first, read [NC]``; targets
    CSR ``tstart [NC+1]``, ``trow, tslot [J]``. Returns ``(y [H, NC, BT, P] f32, pool)``."""
    num_heads, num_chunks, bt, p = x.shape
    n = cg.shape[-1]
    group = num_heads // cg.shape[0]
    sq = pl.Squeezed()

    def blk(last2, by_group=False):
        if by_group:
            return pl.BlockSpec((sq, sq) + last2,
                                lambda h, c, *_: (jax.lax.div(h, group), c, 0, 0))
        return pl.BlockSpec((sq, sq) + last2, lambda h, c, *_: (h, c, 0, 0))

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=5, grid=(num_heads, num_chunks),
        in_specs=[blk((bt, n), True), blk((bt, n), True), blk((bt, p)), blk((bt, 1)),
                  blk((bt, 1)), blk((1, bt)), pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=[blk((bt, p)), pl.BlockSpec(memory_space=pl.ANY)],
        scratch_shapes=[pltpu.VMEM((n, p), _F32), pltpu.VMEM((n, p), _F32)])
    return pl.pallas_call(
        _ssd_chunk_kernel, grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct((num_heads, num_chunks, bt, p), _F32),
                   jax.ShapeDtypeStruct(ssm_pool.shape, ssm_pool.dtype)],
        input_output_aliases={5 + 6: 1}, interpret=interpret,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
    )(first, read, tstart, trow, tslot, cg, bg, x, dt, gcol, grow, ssm_pool)


@functools.partial(jax.jit, static_argnames=("chunk_size", "interpret"),
                   donate_argnames=("ssm_pool",))
def ssd_extend(x, dt, a, b, c, d, ssm_pool, cu_seqlens, read_slot, write_slot, snap_seq,
               snap_offset, snap_slot, *, chunk_size: int = 64, interpret: bool = False):
    """Pallas chunked prefill; same contract as ``ssd_extend_reference``. Returns ``(y, pool)``."""
    check_ssd(x, dt, a, b, c, d, ssm_pool)
    check_chunk_size(chunk_size)
    num_tokens = x.shape[0]
    num_seqs = read_slot.shape[0]
    num_chunks = max_chunks(num_tokens, chunk_size, num_seqs)
    gather, cseq, first, chunk_off = chunk_layout(cu_seqlens, num_tokens, chunk_size,
                                                   num_chunks)
    ssm_pool, tstart, trow, tslot = extend_targets(
        ssm_pool, cu_seqlens, read_slot, write_slot, snap_seq, snap_offset, snap_slot,
        chunk_off, chunk_size, num_chunks)

    def chunked(v):  # [T, H, ...] -> [H, NC, BT, ...] with zero rows
        v = jnp.concatenate([v, jnp.zeros((1,) + v.shape[1:], v.dtype)])[gather]
        return jnp.moveaxis(v, 2, 0)

    dt_c = chunked(dt.astype(_F32))                                       # [H, NC, BT]
    gcum = jnp.cumsum(dt_c * a.astype(_F32)[:, None, None], axis=-1)
    y_c, ssm_pool = ssd_chunk_call(
        first, read_slot[cseq], tstart, trow, tslot, chunked(c), chunked(b), chunked(x),
        dt_c[..., None], gcum[..., None], gcum[:, :, None, :], ssm_pool, interpret=interpret)
    seq, valid = token_seq_ids(cu_seqlens, num_tokens)
    local = jnp.arange(num_tokens) - cu_seqlens[seq]
    y = jnp.moveaxis(y_c[:, chunk_off[seq] + local // chunk_size, local % chunk_size], 0, 1)
    y = y + d.astype(_F32)[:, None] * x.astype(_F32)
    return jnp.where(valid[:, None, None], y, 0.0).astype(x.dtype), ssm_pool


def _ssd_decode_kernel(read_ref, write_ref,  # SMEM [B] slots
                       x_ref,      # [HB, 1, P]
                       dt_ref,     # [HB, 1, 1] f32
                       a_ref,      # [HB, 1, 1] f32
                       b_ref,      # [HB, N, 1] f32 (group-expanded)
                       c_ref,      # [HB, N, 1] f32
                       d_ref,      # [HB, 1, 1] f32
                       pool_ref,   # [S, H, N, P] f32 HBM: initial states (alias of pool_out)
                       y_ref,      # [HB, 1, P]
                       pool_out,   # [S, H, N, P] f32 HBM: new states
                       state_ref):  # [HB, N, P] f32 scratch
    i, hb = pl.program_id(0), pl.program_id(1)
    heads = pl.ds(hb * state_ref.shape[0], state_ref.shape[0])
    pltpu.sync_copy(pool_ref.at[read_ref[i], heads], state_ref)
    x, dt = x_ref[...].astype(_F32), dt_ref[...]
    state = jnp.exp(dt * a_ref[...]) * state_ref[...] + (dt * b_ref[...]) * x
    y_ref[...] = (jnp.sum(state * c_ref[...], axis=1, keepdims=True)
                  + d_ref[...] * x).astype(y_ref.dtype)
    state_ref[...] = state

    @pl.when(write_ref[i] > 0)
    def _write():
        pltpu.sync_copy(state_ref, pool_out.at[write_ref[i], heads])


def decode_head_block(num_heads: int, limit: int = 8) -> int:
    """Heads per decode grid step: the largest divisor of ``num_heads`` up to ``limit`` (a
    ``[HB, N, P]`` f32 state block: 256 KiB at Nemotron-H's N=128, P=64 and HB=8)."""
    return max(hb for hb in range(1, min(limit, num_heads) + 1) if num_heads % hb == 0)


@functools.partial(jax.jit, static_argnames=("head_block", "interpret"),
                   donate_argnames=("ssm_pool",))
def ssd_decode(x, dt, a, b, c, d, ssm_pool, read_slot, write_slot, *, head_block: int = 8,
               interpret: bool = False):
    """Pallas decode, grid ``(B, H / HB)``: a block of ``HB = decode_head_block(H, head_block)``
    heads' ``[N, P]`` states per step (elementwise + reductions: a decode step is memory-bound;
    the whole ``[H, N, P]`` state of Nemotron-H, 8 MiB, overflows VMEM); same contract as
    ``ssd_decode_reference``. Returns ``(y [B, H, P] in x.dtype, ssm_pool)``."""
    num_heads, p, _, n = check_ssd(x, dt, a, b, c, d, ssm_pool)
    num_seqs, hb = x.shape[0], decode_head_block(num_heads, head_block)
    vec = lambda v: jnp.broadcast_to(v.astype(_F32).reshape(1, num_heads, 1, 1),
                                     (num_seqs, num_heads, 1, 1))
    sq = pl.Squeezed()
    spec = lambda *last: pl.BlockSpec((sq, hb) + last, lambda i, j, *_: (i, j, 0, 0))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2, grid=(num_seqs, num_heads // hb),
        in_specs=[spec(1, p), spec(1, 1), spec(1, 1), spec(n, 1), spec(n, 1), spec(1, 1),
                  pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=[spec(1, p), pl.BlockSpec(memory_space=pl.ANY)],
        scratch_shapes=[pltpu.VMEM((hb, n, p), _F32)])
    y, ssm_pool = pl.pallas_call(
        _ssd_decode_kernel, grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct((num_seqs, num_heads, 1, p), x.dtype),
                   jax.ShapeDtypeStruct(ssm_pool.shape, ssm_pool.dtype)],
        input_output_aliases={2 + 6: 1}, interpret=interpret,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary", "arbitrary")),
    )(read_slot, write_slot, x[:, :, None, :], dt.astype(_F32)[..., None, None],
      vec(a), expand_groups(b, num_heads)[..., None], expand_groups(c, num_heads)[..., None],
      vec(d), ssm_pool)
    return y[:, :, 0, :], ssm_pool
