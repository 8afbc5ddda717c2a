"""TPU (Mosaic) KDA kernels: chunked prefill over ragged sequences (pool read/write, snapshots at
any offset) and decode.

Same contracts as ``reference.kda.kda_extend_reference`` / ``kda_decode_reference``. The prefill
layout is the gated delta rule's (``tpu/gated_delta_rule.py``): chunks of ``BT`` tokens that
never span two sequences, grid ``(H, NC)`` with heads parallel and chunks in order, the running
state ``[Dk, Dv]`` in VMEM scratch; the per-channel chunk math is ``kda_chunk.py``'s. Decode
walks (sequence, head) pairs, one state DMA in and out per step.
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
from pallas_kernels.kda_chunk import SUB, chunk_output, state_after
from pallas_kernels.reference.kda import check_kda
from pallas_kernels.tpu._targets import write_state_targets
from pallas_kernels.tpu.gated_delta_rule import unit_lower_inverse

_F32 = jnp.float32


def _l2norm(x):
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-6)


def _inverse(lower):
    """``(I + L)^-1`` of one chunk's strictly lower ``L [BT, BT]`` f32: the GDR inverse takes
    chunks in pairs side by side in lanes; the partner here is zero (full lanes at BT 64)."""
    return unit_lower_inverse(jnp.stack([lower, jnp.zeros_like(lower)]))[0]


def _kda_chunk_kernel(first_ref, read_ref, tstart_ref, trow_ref, tslot_ref,  # SMEM scalars
                      q_ref,      # [BT, Dk] raw q of this chunk and head
                      k_ref,      # [BT, Dk] raw k
                      v_ref,      # [BT, Dv]
                      g_ref,      # [BT, Dk] f32 in-chunk cumulative log-decay per channel
                      beta_ref,   # [BT, 1] f32
                      pool_ref,   # [N, H, Dk, Dv] f32 HBM: initial states (alias of pool_out)
                      o_ref,      # [BT, Dv] output
                      pool_out,   # [N, H, Dk, Dv] f32 HBM: final states, snapshots
                      state_ref,  # [Dk, Dv] f32 scratch: state at this chunk's start
                      snap_ref):  # [Dk, Dv] f32 scratch: staging for DMA to the pool
    h, c = pl.program_id(0), pl.program_id(1)
    bt, dk = k_ref.shape

    @pl.when(first_ref[c] == 1)
    def _load_initial():
        pltpu.sync_copy(pool_ref.at[read_ref[c], h], state_ref)

    q = _l2norm(q_ref[...].astype(_F32)) * (dk ** -0.5)
    k = _l2norm(k_ref[...].astype(_F32))
    gcum = g_ref[...]
    s0 = state_ref[...]
    o, u = chunk_output(q, k, v_ref[...].astype(_F32), gcum, beta_ref[...], s0, _inverse)
    o_ref[...] = o.astype(o_ref.dtype)

    write_state_targets(lambda r: state_after(r, k, gcum, u, s0), h=h, c=c, bt=bt,
                        tstart_ref=tstart_ref, trow_ref=trow_ref, tslot_ref=tslot_ref,
                        snap_ref=snap_ref, pool_out=pool_out, state_ref=state_ref)


@functools.partial(jax.jit, static_argnames=("interpret",), donate_argnames=("ssm_pool",))
def kda_chunk_call(first, read, tstart, trow, tslot, q, k, v, gcum, beta, ssm_pool, *,
                   interpret: bool = False):
    """Run the kernel on chunked inputs. q, k, gcum ``[H, NC, BT, Dk]``; v ``[H, NC, BT, Dv]``;
    beta ``[H, NC, BT, 1]``; per-chunk ``first, read [NC]``; targets CSR ``tstart [NC+1]``,
    ``trow, tslot [J]``. Returns ``(o [H, NC, BT, Dv], pool)``."""
    num_heads, num_chunks, bt, dv = v.shape
    dk = q.shape[-1]
    sq = pl.Squeezed()

    def blk(last2):
        return pl.BlockSpec((sq, sq) + last2, lambda h, c, *_: (h, c, 0, 0))

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=5, grid=(num_heads, num_chunks),
        in_specs=[blk((bt, dk)), blk((bt, dk)), blk((bt, dv)), blk((bt, dk)), blk((bt, 1)),
                  pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=[blk((bt, dv)), pl.BlockSpec(memory_space=pl.ANY)],
        scratch_shapes=[pltpu.VMEM((dk, dv), _F32), pltpu.VMEM((dk, dv), _F32)])
    return pl.pallas_call(
        _kda_chunk_kernel, grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct((num_heads, num_chunks, bt, dv), v.dtype),
                   jax.ShapeDtypeStruct(ssm_pool.shape, ssm_pool.dtype)],
        input_output_aliases={5 + 5: 1}, interpret=interpret,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
    )(first, read, tstart, trow, tslot, q, k, v, gcum, beta, ssm_pool)


@functools.partial(jax.jit, static_argnames=("chunk_size", "interpret"),
                   donate_argnames=("ssm_pool",))
def kda_extend(q, k, v, g, beta, ssm_pool, cu_seqlens, read_slot, write_slot, snap_seq,
               snap_offset, snap_slot, *, chunk_size: int = 64, interpret: bool = False):
    """Pallas chunked KDA prefill; the contract of ``kda_extend_reference`` (``chunk_size`` a
    multiple of 16). Returns ``(o [T, H, Dv] in v.dtype, ssm_pool)``."""
    check_kda(q, k, v, g, beta, ssm_pool)
    check_chunk_size(chunk_size)
    if chunk_size % SUB:
        raise ValueError(f"chunk_size {chunk_size} must be a multiple of {SUB} for KDA")
    num_tokens = v.shape[0]
    num_seqs = read_slot.shape[0]
    num_chunks = max_chunks(num_tokens, chunk_size, num_seqs)
    gather, cseq, first, chunk_off = chunk_layout(cu_seqlens, num_tokens, chunk_size,
                                                   num_chunks)
    ssm_pool, tstart, trow, tslot = extend_targets(
        ssm_pool, cu_seqlens, read_slot, write_slot, snap_seq, snap_offset, snap_slot,
        chunk_off, chunk_size, num_chunks)

    def chunked(x):  # [T, H, ...] -> [H, NC, BT, ...] with zero rows
        x = jnp.concatenate([x, jnp.zeros((1,) + x.shape[1:], x.dtype)])[gather]
        return jnp.moveaxis(x, 2, 0)

    gcum = jnp.cumsum(chunked(g.astype(_F32)), axis=2)                  # [H, NC, BT, Dk]
    o_c, ssm_pool = kda_chunk_call(
        first, read_slot[cseq], tstart, trow, tslot, chunked(q), chunked(k), chunked(v), gcum,
        chunked(beta.astype(_F32))[..., None], ssm_pool, interpret=interpret)
    seq, valid = token_seq_ids(cu_seqlens, num_tokens)
    local = jnp.arange(num_tokens) - cu_seqlens[seq]
    o = o_c[:, chunk_off[seq] + local // chunk_size, local % chunk_size]   # [H, T, Dv]
    o = jnp.where(valid[None, :, None], o, 0).astype(v.dtype)
    return jnp.moveaxis(o, 0, 1), ssm_pool


def _kda_decode_kernel(read_ref, write_ref,  # SMEM [B] slots
                       q_ref,      # [Dk, 1] raw q of (sequence b, head h)
                       k_ref,      # [Dk, 1] raw k
                       v_ref,      # [1, Dv]
                       g_ref,      # [Dk, 1] f32 log-decay per key channel
                       beta_ref,   # [1, 1] f32
                       pool_ref,   # [N, H, Dk, Dv] f32 HBM: initial states (alias of pool_out)
                       o_ref,      # [1, Dv]
                       pool_out,   # [N, H, Dk, Dv] f32 HBM: new states
                       state_ref):  # [Dk, Dv] f32 scratch
    b, h = pl.program_id(0), pl.program_id(1)
    dk = q_ref.shape[0]
    pltpu.sync_copy(pool_ref.at[read_ref[b], h], state_ref)
    q = q_ref[...].astype(_F32)
    k = k_ref[...].astype(_F32)
    q = q * jax.lax.rsqrt(jnp.sum(q * q, axis=0, keepdims=True) + 1e-6) * (dk ** -0.5)
    k = k * jax.lax.rsqrt(jnp.sum(k * k, axis=0, keepdims=True) + 1e-6)
    state = jnp.exp(g_ref[...]) * state_ref[...]
    u = beta_ref[...] * (v_ref[...].astype(_F32) - jnp.sum(state * k, axis=0, keepdims=True))
    state = state + k * u
    o_ref[...] = jnp.sum(state * q, axis=0, keepdims=True).astype(o_ref.dtype)
    state_ref[...] = state

    @pl.when(write_ref[b] > 0)
    def _write():
        pltpu.sync_copy(state_ref, pool_out.at[write_ref[b], h])


@functools.partial(jax.jit, static_argnames=("interpret",), donate_argnames=("ssm_pool",))
def kda_decode(q, k, v, g, beta, ssm_pool, read_slot, write_slot, *, interpret: bool = False):
    """Pallas KDA decode; the contract of ``kda_decode_reference``: q, k, g ``[B, H, Dk]``, v
    ``[B, H, Dv]``, beta ``[B, H]``. Grid ``(B, H)``: one ``[Dk, Dv]`` state per step (the whole
    ``[H, Dk, Dv]`` state of 32 heads of 128 with its lane-padded ``[H, Dk, 1]`` q, k and decay
    columns overflows v5e's scoped VMEM in fp32). Returns ``(o [B, H, Dv] in v.dtype,
    ssm_pool)``."""
    check_kda(q, k, v, g, beta, ssm_pool)
    num_seqs, num_heads, dv = v.shape
    dk = q.shape[-1]
    sq = pl.Squeezed()
    spec = lambda *last: pl.BlockSpec((sq, sq) + last, lambda b, h, *_: (b, h, 0, 0))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2, grid=(num_seqs, num_heads),
        in_specs=[spec(dk, 1), spec(dk, 1), spec(1, dv), spec(dk, 1), spec(1, 1),
                  pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=[spec(1, dv), pl.BlockSpec(memory_space=pl.ANY)],
        scratch_shapes=[pltpu.VMEM((dk, dv), _F32)])
    o, ssm_pool = pl.pallas_call(
        _kda_decode_kernel, grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct((num_seqs, num_heads, 1, dv), v.dtype),
                   jax.ShapeDtypeStruct(ssm_pool.shape, ssm_pool.dtype)],
        input_output_aliases={2 + 5: 1}, interpret=interpret,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary", "arbitrary")),
    )(read_slot, write_slot, q[..., None], k[..., None], v[:, :, None, :],
      g.astype(_F32)[..., None], beta.astype(_F32).reshape(num_seqs, num_heads, 1, 1),
      ssm_pool)
    return o[:, :, 0, :], ssm_pool
