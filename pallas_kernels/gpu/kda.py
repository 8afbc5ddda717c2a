"""Pallas Triton (GPU) KDA kernels: chunked prefill over ragged sequences with snapshots at any
offset, and decode.

Same contracts as ``reference.kda``. Prefill follows ``gpu/gated_delta_rule.py``: grid
``(B, H, Dv / BV)``, each program walks its sequence's chunks of ``BT`` tokens in a
``fori_loop`` with the ``[Dk, BV]`` state tile in registers, writing the finals and snapshots
the targets table asks for into the pool in place; the per-channel chunk math is
``kda_chunk.py``'s (IEEE fp32 dots). The in-chunk cumulative decays ``[T, H, Dk]`` are summed by
the wrapper per (sequence, chunk). Dk, Dv need not be powers of two: loads and stores are masked
(padded key channels carry zero q, k and decay).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels._common import (
    check,
    chunk_layout,
    extend_targets,
    max_chunks,
    token_seq_ids,
)
from pallas_kernels.gpu.gated_delta_rule import _unit_lower_inverse, pow2_at_least_16
from pallas_kernels.kda_chunk import SUB, chunk_output, state_after
from pallas_kernels.reference.kda import check_kda

_F32 = jnp.float32
_HIGHEST = (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST)
# sm_90 compile gate, Qwen3-Next sizes, fp32, chunks of 32: 791 spill instructions with value
# tiles of 16 (1,347 with 32; 53,140 with tiles of 64 and chunks of 64). Each value tile redoes
# the chunk's grams and inverse: 8x at Dv = 128 (the price of fewer spills; no tensor cores).
BLOCK_V = 16
NUM_WARPS = 8


def _l2norm_rows(x):
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-6)


def _kda_extend_kernel(cu_ref,      # [B+1] i32 packed sequence starts
                       read_ref,    # [B] i32 initial-state slot
                       coff_ref,    # [B+1] i32 first chunk of each sequence (targets CSR row)
                       tstart_ref,  # [NC+1] i32 targets CSR offsets per chunk
                       trow_ref,    # [J] i32 state after this many chunk rows (0..BT)
                       tslot_ref,   # [J] i32 destination slot (0 = dropped)
                       q_ref,       # [T, H, Dk] raw q
                       k_ref,       # [T, H, Dk] raw k
                       v_ref,       # [T, H, Dv]
                       g_ref,       # [T, H, Dk] f32 in-chunk cumulative log-decay
                       beta_ref,    # [T, H] f32
                       pool_ref,    # [N, H, Dk, Dv] f32 initial states (alias of pool_out)
                       o_ref,       # [T, H, Dv] output (padding tokens left unwritten)
                       pool_out,    # [N, H, Dk, Dv] f32 finals and snapshots
                       *, chunk_size: int, head_k_dim: int, block_k: int, block_v: int):
    b, h, vt = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    bt = chunk_size
    start, end = cu_ref[b], cu_ref[b + 1]
    v0 = vt * block_v
    kmask = jnp.arange(block_k) < head_k_dim
    vmask = (v0 + jnp.arange(block_v)) < o_ref.shape[2]
    smask = kmask[:, None] & vmask[None, :]
    kidx, vidx = pl.ds(0, block_k), pl.ds(v0, block_v)
    state0 = pltr.load(pool_ref.at[read_ref[b], h, kidx, vidx], mask=smask, other=0.0)
    lane = jnp.arange(bt)

    def chunk(c, s0):  # s0 [block_k, block_v] f32: state at the chunk start
        tok0 = start + c * bt
        rmask = (tok0 + lane) < end
        tidx = pl.ds(tok0, bt)
        qk_mask = rmask[:, None] & kmask[None, :]
        q = pltr.load(q_ref.at[tidx, h, kidx], mask=qk_mask, other=0.0).astype(_F32)
        k = pltr.load(k_ref.at[tidx, h, kidx], mask=qk_mask, other=0.0).astype(_F32)
        v = pltr.load(v_ref.at[tidx, h, vidx], mask=rmask[:, None] & vmask[None, :],
                      other=0.0).astype(_F32)
        gcum = pltr.load(g_ref.at[tidx, h, kidx], mask=qk_mask, other=0.0)
        # rows past the sequence end take the last valid row's G (its minimum: G only falls),
        # not 0, which would make exp(G_i - G_j) overflow against a strongly decayed row j
        gcum = jnp.where(rmask[:, None], gcum, jnp.min(gcum, axis=0, keepdims=True))
        beta = pltr.load(beta_ref.at[tidx, h], mask=rmask, other=0.0)
        q = _l2norm_rows(q) * head_k_dim ** -0.5
        k = _l2norm_rows(k)
        o, u = chunk_output(q, k, v, gcum, beta[:, None], s0, _unit_lower_inverse,
                            precision=_HIGHEST)
        pltr.store(o_ref.at[tidx, h, vidx], o.astype(o_ref.dtype),
                   mask=rmask[:, None] & vmask[None, :])

        def write_target(j, carry):
            slot = tslot_ref[j]

            @pl.when(slot > 0)
            def _write():
                pltr.store(pool_out.at[slot, h, kidx, vidx],
                           state_after(trow_ref[j], k, gcum, u, s0, precision=_HIGHEST),
                           mask=smask)

            return carry

        cid = coff_ref[b] + c
        jax.lax.fori_loop(tstart_ref[cid], tstart_ref[cid + 1], write_target, 0)
        return state_after(bt, k, gcum, u, s0, precision=_HIGHEST)

    jax.lax.fori_loop(0, jax.lax.div(end - start + bt - 1, bt), chunk, state0)


def _chunk_cumsum(g, cu_seqlens, chunk_size: int, num_chunks: int):
    """``g [T, H, Dk]`` -> the cumulative sum within each (sequence, chunk) segment, f32."""
    num_tokens = g.shape[0]
    gather, _, _, chunk_off = chunk_layout(cu_seqlens, num_tokens, chunk_size, num_chunks)
    gc = jnp.concatenate([g.astype(_F32), jnp.zeros((1,) + g.shape[1:], _F32)])[gather]
    gc = jnp.cumsum(gc, axis=1)                                          # [NC, BT, H, Dk]
    seq, _ = token_seq_ids(cu_seqlens, num_tokens)
    local = jnp.arange(num_tokens) - cu_seqlens[seq]
    return gc[chunk_off[seq] + local // chunk_size, local % chunk_size], chunk_off


@functools.partial(jax.jit, static_argnames=("chunk_size", "interpret"),
                   donate_argnames=("ssm_pool",))
def kda_extend(q, k, v, g, beta, ssm_pool, cu_seqlens, read_slot, write_slot, snap_seq,
               snap_offset, snap_slot, *, chunk_size: int = 32, interpret: bool = False):
    """Pallas Triton chunked KDA prefill; the contract of ``kda_extend_reference``
    (``chunk_size`` a power of two >= 16). Returns ``(o [T, H, Dv] in v.dtype, ssm_pool)``."""
    check_kda(q, k, v, g, beta, ssm_pool)
    check(chunk_size >= SUB and chunk_size & (chunk_size - 1) == 0,
          f"chunk_size {chunk_size} must be a power of two >= {SUB} on GPU")
    num_tokens, num_heads, dv = v.shape
    dk = q.shape[-1]
    num_chunks = max_chunks(num_tokens, chunk_size, read_slot.shape[0])
    gcum, chunk_off = _chunk_cumsum(g, cu_seqlens, chunk_size, num_chunks)
    ssm_pool, tstart, trow, tslot = extend_targets(
        ssm_pool, cu_seqlens, read_slot, write_slot, snap_seq, snap_offset, snap_slot,
        chunk_off, chunk_size, num_chunks)
    block_v = min(BLOCK_V, pow2_at_least_16(dv))
    kernel = functools.partial(_kda_extend_kernel, chunk_size=chunk_size, head_k_dim=dk,
                               block_k=pow2_at_least_16(dk), block_v=block_v)
    i32 = lambda a: jnp.asarray(a, jnp.int32)
    o, ssm_pool = pl.pallas_call(
        kernel, grid=(read_slot.shape[0], num_heads, pl.cdiv(dv, block_v)),
        out_shape=[jax.ShapeDtypeStruct((num_tokens, num_heads, dv), v.dtype),
                   jax.ShapeDtypeStruct(ssm_pool.shape, ssm_pool.dtype)],
        input_output_aliases={11: 1}, interpret=interpret,
        compiler_params=pltr.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
    )(i32(cu_seqlens), i32(read_slot), chunk_off, tstart, trow, tslot, q, k, v, gcum,
      beta.astype(_F32), ssm_pool)
    _, valid = token_seq_ids(cu_seqlens, num_tokens)
    return jnp.where(valid[:, None, None], o, 0).astype(v.dtype), ssm_pool


def _kda_decode_kernel(read_ref,   # [B] i32 initial-state slot
                       write_ref,  # [B] i32 destination slot (0 = dropped)
                       q_ref,      # [B, H, Dk] raw q
                       k_ref,      # [B, H, Dk] raw k
                       v_ref,      # [B, H, Dv]
                       g_ref,      # [B, H, Dk] f32 log-decay per key channel
                       beta_ref,   # [B, H] f32
                       pool_ref,   # [N, H, Dk, Dv] f32 initial states (alias of pool_out)
                       o_ref,      # [B, H, Dv]
                       pool_out,   # [N, H, Dk, Dv] f32 new states
                       *, head_k_dim: int, block_k: int, block_v: int):
    b, h, vt = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    v0 = vt * block_v
    kmask = jnp.arange(block_k) < head_k_dim
    vmask = (v0 + jnp.arange(block_v)) < o_ref.shape[2]
    smask = kmask[:, None] & vmask[None, :]
    kidx, vidx = pl.ds(0, block_k), pl.ds(v0, block_v)
    q = pltr.load(q_ref.at[b, h, kidx], mask=kmask, other=0.0).astype(_F32)
    k = pltr.load(k_ref.at[b, h, kidx], mask=kmask, other=0.0).astype(_F32)
    v = pltr.load(v_ref.at[b, h, vidx], mask=vmask, other=0.0).astype(_F32)
    g = pltr.load(g_ref.at[b, h, kidx], mask=kmask, other=0.0)
    q = q * jax.lax.rsqrt(jnp.sum(q * q) + 1e-6) * head_k_dim ** -0.5
    k = k * jax.lax.rsqrt(jnp.sum(k * k) + 1e-6)
    state = pltr.load(pool_ref.at[read_ref[b], h, kidx, vidx], mask=smask, other=0.0)
    state = jnp.exp(g)[:, None] * state
    u = beta_ref[b, h] * (v - jnp.sum(state * k[:, None], axis=0))
    state = state + k[:, None] * u[None, :]
    pltr.store(o_ref.at[b, h, vidx], jnp.sum(state * q[:, None], axis=0).astype(o_ref.dtype),
               mask=vmask)

    @pl.when(write_ref[b] > 0)
    def _write():
        pltr.store(pool_out.at[write_ref[b], h, kidx, vidx], state, mask=smask)


@functools.partial(jax.jit, static_argnames=("interpret",), donate_argnames=("ssm_pool",))
def kda_decode(q, k, v, g, beta, ssm_pool, read_slot, write_slot, *, interpret: bool = False):
    """Pallas Triton KDA decode; the contract of ``kda_decode_reference``. Grid ``(B, H,
    Dv / BV)``, one pass over the state tile. Returns ``(o [B, H, Dv] in v.dtype, ssm_pool)``."""
    check_kda(q, k, v, g, beta, ssm_pool)
    num_seqs, num_heads, dv = v.shape
    block_v = min(32, pow2_at_least_16(dv))
    kernel = functools.partial(_kda_decode_kernel, head_k_dim=q.shape[-1],
                               block_k=pow2_at_least_16(q.shape[-1]), block_v=block_v)
    i32 = lambda a: jnp.asarray(a, jnp.int32)
    return pl.pallas_call(
        kernel, grid=(num_seqs, num_heads, pl.cdiv(dv, block_v)),
        out_shape=[jax.ShapeDtypeStruct((num_seqs, num_heads, dv), v.dtype),
                   jax.ShapeDtypeStruct(ssm_pool.shape, ssm_pool.dtype)],
        input_output_aliases={7: 1}, interpret=interpret,
        compiler_params=pltr.CompilerParams(num_warps=4, num_stages=1),
    )(i32(read_slot), i32(write_slot), q, k, v, g.astype(_F32), beta.astype(_F32), ssm_pool)
