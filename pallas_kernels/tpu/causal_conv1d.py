"""TPU (Mosaic) causal conv1d + SiLU: chunked ragged prefill (with window writes) and decode.

Same contract as ``reference.causal_conv1d``. Prefill layout (built by
``causal_conv1d_extend``): chunk c holds ``K - 1 + BT``
rows, the K-1 inputs before the chunk (from the sequence or its initial window) then its BT
tokens; chunks never span two sequences. No state is carried, so both grid axes are parallel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._common import (
    bias_row,
    check_chunk_size,
    chunk_layout,
    extend_targets,
    max_chunks,
    token_seq_ids,
)
from pallas_kernels.reference.causal_conv1d import check_conv

_F32 = jnp.float32


def _silu_taps(xs_ref, w_ref, b_ref, rows: int):
    """``silu(b + sum_i w[i] * xs[i : i + rows])`` in f32; xs_ref ``[rows + K - 1, BC]`` f32."""
    acc = jnp.broadcast_to(b_ref[...].astype(_F32), (rows, xs_ref.shape[1]))
    for i in range(w_ref.shape[0]):
        acc = acc + w_ref[pl.ds(i, 1), :].astype(_F32) * xs_ref[pl.ds(i, rows), :]
    return acc * jax.nn.sigmoid(acc)


def _conv_chunk_kernel(tstart_ref, trow_ref, tslot_ref,  # SMEM scalars: window targets (CSR)
                       x_ref,      # [K-1+BT, BC] inputs of this chunk, window rows first
                       w_ref,      # [K, BC]
                       b_ref,      # [1, BC]
                       pool_ref,   # [N, K-1, C] HBM, aliased to pool_out (unused: no reads)
                       y_ref,      # [BT, BC] output
                       pool_out,   # [N, K-1, C] HBM: final windows and snapshots
                       xs_ref,     # [K-1+BT rounded up to 8, + 8, BC] f32 scratch
                       win_ref):   # [K-1, BC] pool-dtype scratch: staging for the DMA
    del pool_ref
    cb, c = pl.program_id(0), pl.program_id(1)
    bt, bc = y_ref.shape
    width = w_ref.shape[0] - 1
    xs_ref[pl.ds(0, x_ref.shape[0]), :] = x_ref[...].astype(_F32)
    y_ref[...] = _silu_taps(xs_ref, w_ref, b_ref, bt).astype(y_ref.dtype)

    def write_target(j, carry):
        slot = tslot_ref[j]

        @pl.when(slot > 0)
        def _write():  # the window after r tokens: rows r .. r + K - 2
            # an 8-aligned 16-row load, then a static slice at r % 8 (a dynamic unaligned
            # sublane load of a ref wider than one vreg does not compile)
            row = trow_ref[j]                                   # >= 0: bit ops, no sign
            rows = xs_ref[pl.ds(pl.multiple_of(row - (row & 7), 8), 16), :]
            for k in range(8):
                @pl.when((row & 7) == k)
                def _shifted(k=k):
                    win_ref[...] = rows[k:k + width].astype(win_ref.dtype)
            pltpu.sync_copy(win_ref, pool_out.at[slot, :, pl.ds(cb * bc, bc)])

        return carry

    jax.lax.fori_loop(tstart_ref[c], tstart_ref[c + 1], write_target, 0)


@functools.partial(jax.jit, static_argnames=("block_channels", "interpret"),
                   donate_argnames=("conv_pool",))
def conv_chunk_call(tstart, trow, tslot, xw, weight, bias, conv_pool, *, block_channels: int,
                    interpret: bool = False):
    """xw ``[NC, K-1+BT, C]`` (conv_pool dtype); weight ``[K, C]``; bias ``[1, C]``.
    Returns ``(y [NC, BT, C], conv_pool)``."""
    num_chunks, rows, channels = xw.shape
    width = weight.shape[0] - 1
    bt, bc = rows - width, block_channels
    sq = pl.Squeezed()
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3, grid=(channels // bc, num_chunks),
        in_specs=[pl.BlockSpec((sq, rows, bc), lambda cb, c, *_: (c, 0, cb)),
                  pl.BlockSpec((width + 1, bc), lambda cb, c, *_: (0, cb)),
                  pl.BlockSpec((1, bc), lambda cb, c, *_: (0, cb)),
                  pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=[pl.BlockSpec((sq, bt, bc), lambda cb, c, *_: (c, 0, cb)),
                   pl.BlockSpec(memory_space=pl.ANY)],
        scratch_shapes=[pltpu.VMEM((-(-rows // 8) * 8 + 8, bc), _F32),
                        pltpu.VMEM((width, bc), conv_pool.dtype)])
    return pl.pallas_call(
        _conv_chunk_kernel, grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct((num_chunks, bt, channels), xw.dtype),
                   jax.ShapeDtypeStruct(conv_pool.shape, conv_pool.dtype)],
        input_output_aliases={3 + 3: 1}, interpret=interpret,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
    )(tstart, trow, tslot, xw, weight, bias, conv_pool)


def _conv_decode_kernel(read_ref, write_ref,  # SMEM [B] slots
                        x_ref,      # [1, C] this sequence's token
                        w_ref,      # [K, C]
                        b_ref,      # [1, C]
                        pool_ref,   # [N, K-1, C] HBM: initial windows (alias of pool_out)
                        y_ref,      # [1, C]
                        pool_out,   # [N, K-1, C] HBM: new windows
                        old_ref,    # [K-1, C] pool-dtype scratch: the window read
                        new_ref,    # [K-1, C] pool-dtype scratch: the window written
                        xs_ref):    # [K, C] f32 scratch: window then the new token
    # Whole-ref DMAs only: a DMA of a row slice of a packed (bf16) window is not tile-aligned.
    b = pl.program_id(0)
    width = w_ref.shape[0] - 1
    pltpu.sync_copy(pool_ref.at[read_ref[b]], old_ref)
    xs_ref[pl.ds(0, width), :] = old_ref[...].astype(_F32)
    xs_ref[pl.ds(width, 1), :] = x_ref[...].astype(_F32)
    y_ref[...] = _silu_taps(xs_ref, w_ref, b_ref, 1).astype(y_ref.dtype)

    @pl.when(write_ref[b] > 0)
    def _write():
        new_ref[...] = xs_ref[pl.ds(1, width), :].astype(new_ref.dtype)
        pltpu.sync_copy(new_ref, pool_out.at[write_ref[b]])


@functools.partial(jax.jit, static_argnames=("interpret",), donate_argnames=("conv_pool",))
def conv_decode_call(read_slot, write_slot, x, weight, bias, conv_pool, *,
                     interpret: bool = False):
    """x ``[B, 1, C]``; weight ``[K, C]``; bias ``[1, C]``. Returns ``(y [B, 1, C], pool)``."""
    num_seqs, _, channels = x.shape
    kernel = weight.shape[0]
    sq = pl.Squeezed()
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2, grid=(num_seqs,),
        in_specs=[pl.BlockSpec((sq, 1, channels), lambda b, *_: (b, 0, 0)),
                  pl.BlockSpec((kernel, channels), lambda b, *_: (0, 0)),
                  pl.BlockSpec((1, channels), lambda b, *_: (0, 0)),
                  pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=[pl.BlockSpec((sq, 1, channels), lambda b, *_: (b, 0, 0)),
                   pl.BlockSpec(memory_space=pl.ANY)],
        scratch_shapes=[pltpu.VMEM((kernel - 1, channels), conv_pool.dtype),
                        pltpu.VMEM((kernel - 1, channels), conv_pool.dtype),
                        pltpu.VMEM((kernel, channels), _F32)])
    return pl.pallas_call(
        _conv_decode_kernel, grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype),
                   jax.ShapeDtypeStruct(conv_pool.shape, conv_pool.dtype)],
        input_output_aliases={2 + 3: 1}, interpret=interpret,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
    )(read_slot, write_slot, x, weight, bias, conv_pool)


PREFILL_CHANNELS = 1024  # channels per prefill grid step (was 128: 8x the steps, each ~100 bundles)


def _block_channels(channels: int) -> int:
    """The largest multiple of 128 <= ``PREFILL_CHANNELS`` dividing ``channels`` (all of them
    when 128 does not divide them: a block's last dim is 128-aligned or the whole dim)."""
    if channels % 128:
        return channels
    lanes = channels // 128
    return 128 * max(d for d in range(1, PREFILL_CHANNELS // 128 + 1) if lanes % d == 0)


@functools.partial(jax.jit, static_argnames=("chunk_size", "interpret"),
                   donate_argnames=("conv_pool",))
def causal_conv1d_extend(x, weight, bias, conv_pool, cu_seqlens, read_slot, write_slot,
                         snap_seq, snap_offset, snap_slot, *, chunk_size: int = 64,
                         interpret: bool = False):
    """Pallas chunked prefill; same contract as the reference. Returns ``(y, conv_pool)``."""
    check_conv(x, weight, bias, conv_pool)
    check_chunk_size(chunk_size)
    num_tokens, channels = x.shape
    width = weight.shape[0] - 1
    num_seqs = read_slot.shape[0]
    num_chunks = max_chunks(num_tokens, chunk_size, num_seqs)
    _, cseq, _, chunk_off = chunk_layout(cu_seqlens, num_tokens, chunk_size, num_chunks)
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    c = jnp.arange(num_chunks)
    local = (c - chunk_off[cseq])[:, None] * chunk_size + jnp.arange(-width, chunk_size)
    src = jnp.where(local < 0, num_tokens + cseq[:, None] * width + width + local,
                    cu_seqlens[cseq][:, None] + local)
    keep = (c < chunk_off[-1])[:, None] & (local < lens[cseq][:, None])
    src = jnp.where(keep, src, num_tokens + num_seqs * width)
    table = jnp.concatenate([x, conv_pool[read_slot].reshape(-1, channels),
                             jnp.zeros((1, channels), x.dtype)])
    conv_pool, tstart, trow, tslot = extend_targets(
        conv_pool, cu_seqlens, read_slot, write_slot, snap_seq, snap_offset, snap_slot,
        chunk_off, chunk_size, num_chunks)
    y_c, conv_pool = conv_chunk_call(tstart, trow, tslot, table[src], weight,
                                     bias_row(bias, channels), conv_pool,
                                     block_channels=_block_channels(channels),
                                     interpret=interpret)
    seq, valid = token_seq_ids(cu_seqlens, num_tokens)
    tok = jnp.arange(num_tokens) - cu_seqlens[seq]
    y = y_c[chunk_off[seq] + tok // chunk_size, tok % chunk_size]
    return jnp.where(valid[:, None], y, 0).astype(x.dtype), conv_pool


@functools.partial(jax.jit, static_argnames=("interpret",), donate_argnames=("conv_pool",))
def causal_conv1d_decode(x, weight, bias, conv_pool, read_slot, write_slot, *,
                         interpret: bool = False):
    """Pallas decode (one token per sequence); same contract as the reference."""
    check_conv(x, weight, bias, conv_pool)
    num_seqs, channels = x.shape
    y, conv_pool = conv_decode_call(read_slot, write_slot, x[:, None, :], weight,
                                    bias_row(bias, channels), conv_pool, interpret=interpret)
    return y[:, 0, :], conv_pool
