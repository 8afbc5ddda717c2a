"""GPU (Pallas Triton) causal conv1d + SiLU: ragged chunked prefill with window writes, decode.

Same contract as ``reference.causal_conv1d`` (whose plain-jnp references these kernels are
tested against). ``conv_pool[slot]`` is ``[K-1, C]``: the last K-1 inputs of a sequence.

Prefill grid ``(NC, C / BC)``, both parallel: chunk c (``BT`` tokens of one sequence, chunking
restarts at every sequence start) reads its rows straight from the packed ``x`` with gather
loads; local positions < 0 come from the sequence's initial window. The initial windows are
gathered by the wrapper (``conv_pool[read_slot]``, ``[B, K-1, C]``) before the kernel, so no
program reads a pool slot that another program may be writing (a running request usually reads
and writes the same slot). The kernel then writes the windows of the chunk's targets (CSR
table: the window after ``row`` tokens of the chunk) into the aliased pool.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels._common import (
    bias_row,
    check_chunk_size,
    chunk_layout,
    extend_targets,
    max_chunks,
)
from pallas_kernels.reference.causal_conv1d import check_conv

_F32 = jnp.float32


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _block_channels(channels: int) -> int:
    """Largest power of two <= 128 dividing ``channels`` (channel tiles stay in bounds)."""
    return min(128, channels & -channels)


def _gather_inputs(x_ref, init_ref, wbase, start, pos, ok, cols):
    """f32 inputs at local positions ``pos [R]`` of one sequence; rows where ``ok [R]`` is False
    are 0. Positions >= 0 are rows ``start + pos`` of x_ref ``[T, C]``; positions < 0 are rows
    ``wbase + pos`` of the initial windows ``init_ref [B*(K-1), C]`` (``wbase`` = the row after
    the sequence's window). ``cols [BC]`` channel indices. Returns ``[R, BC]``.
    """
    shape = (pos.shape[0], cols.shape[0])
    col_idx = jnp.broadcast_to(cols[None, :], shape)
    in_x = jnp.broadcast_to((ok & (pos >= 0))[:, None], shape)
    in_w = jnp.broadcast_to((ok & (pos < 0))[:, None], shape)
    x_row = jnp.clip(start + pos, 0, x_ref.shape[0] - 1)
    w_row = jnp.clip(wbase + pos, 0, init_ref.shape[0] - 1)
    from_x = pltr.load(x_ref.at[jnp.broadcast_to(x_row[:, None], shape), col_idx], mask=in_x,
                       other=0)
    from_w = pltr.load(init_ref.at[jnp.broadcast_to(w_row[:, None], shape), col_idx],
                       mask=in_w, other=0)
    return from_x.astype(_F32) + from_w.astype(_F32)


def _conv_chunk_kernel(meta_ref,     # [4, NC] int32 per chunk: seq, seq start, local offset, count
                       tstart_ref,   # [NC+1] int32: CSR of the window targets
                       trow_ref,     # [J] int32: window after this many chunk tokens
                       tslot_ref,    # [J] int32: to this pool slot (0: dropped)
                       x_ref,        # [T, C] packed inputs
                       init_ref,     # [B*(K-1), C] initial windows, oldest first
                       w_ref,        # [K, C]
                       b_ref,        # [1, C] f32
                       pool_in_ref,  # [N, K-1, C] aliased to pool_ref (never read)
                       y_ref,        # [T + BTP, C] outputs; rows >= T absorb masked rows
                       pool_ref,     # [N, K-1, C] windows written here
                       *, block_rows: int, block_channels: int):
    del pool_in_ref
    c, cb = pl.program_id(0), pl.program_id(1)
    kernel = w_ref.shape[0]
    width = kernel - 1
    num_tokens = x_ref.shape[0]
    seq, start, loc, count = meta_ref[0, c], meta_ref[1, c], meta_ref[2, c], meta_ref[3, c]
    wbase = seq * width + width
    cols = cb * block_channels + jnp.arange(block_channels, dtype=jnp.int32)
    r = jnp.arange(block_rows, dtype=jnp.int32)
    ok = r < count
    acc = jnp.broadcast_to(pltr.load(b_ref.at[0, cols])[None, :], (block_rows, block_channels))
    for i in range(kernel):
        xs = _gather_inputs(x_ref, init_ref, wbase, start, loc + r - width + i, ok, cols)
        acc = acc + pltr.load(w_ref.at[i, cols]).astype(_F32)[None, :] * xs
    y = (acc * jax.nn.sigmoid(acc)).astype(y_ref.dtype)
    rows = jnp.where(ok, start + loc + r, num_tokens + r)   # unique rows, all in bounds
    shape = (block_rows, block_channels)
    pltr.store(y_ref.at[jnp.broadcast_to(rows[:, None], shape),
                        jnp.broadcast_to(cols[None, :], shape)], y,
               mask=jnp.broadcast_to(ok[:, None], shape))

    def write_target(j, carry):
        slot, row = tslot_ref[j], trow_ref[j]

        @pl.when(slot > 0)
        def _write():  # the window after `row` tokens: local positions loc + row - K + 1 ...
            one = jnp.ones((1,), jnp.bool_)
            for w in range(width):
                pos = jnp.full((1,), loc + row - width + w, jnp.int32)
                win = _gather_inputs(x_ref, init_ref, wbase, start, pos, one, cols)
                pltr.store(pool_ref.at[slot, w, cols],
                           win.reshape(block_channels).astype(pool_ref.dtype))

        return carry

    jax.lax.fori_loop(tstart_ref[c], tstart_ref[c + 1], write_target, 0)


def _params(block_channels: int) -> pltr.CompilerParams:
    return pltr.CompilerParams(num_warps=4 if block_channels >= 64 else 1, num_stages=1)


@functools.partial(jax.jit, static_argnames=("chunk_size", "interpret"),
                   donate_argnames=("conv_pool",))
def causal_conv1d_extend(x, weight, bias, conv_pool, cu_seqlens, read_slot, write_slot,
                         snap_seq, snap_offset, snap_slot, *, chunk_size: int = 64,
                         interpret: bool = False):
    """Pallas-Triton chunked prefill; same contract as ``causal_conv1d_extend_reference``:
    x ``[T, C]``, weight ``[K, C]``, bias ``[C]`` or None, conv_pool ``[N, K-1, C]`` (x dtype).
    Returns ``(y [T, C] in x.dtype (0 past cu_seqlens[-1]), conv_pool)``."""
    check_conv(x, weight, bias, conv_pool)
    check_chunk_size(chunk_size)
    num_tokens, channels = x.shape
    width = weight.shape[0] - 1
    num_seqs = read_slot.shape[0]
    num_chunks = max_chunks(num_tokens, chunk_size, num_seqs)
    _, cseq, _, chunk_off = chunk_layout(cu_seqlens, num_tokens, chunk_size, num_chunks)
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    c = jnp.arange(num_chunks, dtype=jnp.int32)
    loc = (c - chunk_off[cseq]) * chunk_size
    count = jnp.where(c < chunk_off[-1], jnp.clip(lens[cseq] - loc, 0, chunk_size), 0)
    meta = jnp.stack([cseq, cu_seqlens[cseq], loc, count]).astype(jnp.int32)
    init = conv_pool[read_slot].reshape(num_seqs * width, channels)
    conv_pool, tstart, trow, tslot = extend_targets(
        conv_pool, cu_seqlens, read_slot, write_slot, snap_seq, snap_offset, snap_slot,
        chunk_off, chunk_size, num_chunks)
    block_rows, block_channels = _pow2_at_least(chunk_size), _block_channels(channels)
    kernel = functools.partial(_conv_chunk_kernel, block_rows=block_rows,
                               block_channels=block_channels)
    y, conv_pool = pl.pallas_call(
        kernel, grid=(num_chunks, channels // block_channels),
        out_shape=[jax.ShapeDtypeStruct((num_tokens + block_rows, channels), x.dtype),
                   jax.ShapeDtypeStruct(conv_pool.shape, conv_pool.dtype)],
        input_output_aliases={8: 1}, interpret=interpret,
        compiler_params=_params(block_channels),
    )(meta, tstart, trow, tslot, x, init, weight, bias_row(bias, channels), conv_pool)
    valid = jnp.arange(num_tokens) < cu_seqlens[-1]
    return jnp.where(valid[:, None], y[:num_tokens], 0).astype(x.dtype), conv_pool


def _conv_decode_kernel(wslot_ref,    # [B] int32 write slots (0: dropped)
                        x_ref,        # [B, C] one token per sequence
                        win_ref,      # [B, K-1, C] initial windows
                        w_ref,        # [K, C]
                        b_ref,        # [1, C] f32
                        pool_in_ref,  # [N, K-1, C] aliased to pool_ref (never read)
                        y_ref,        # [B, C]
                        pool_ref,     # [N, K-1, C] new windows written here
                        *, block_channels: int):
    del pool_in_ref
    b, cb = pl.program_id(0), pl.program_id(1)
    width = w_ref.shape[0] - 1
    cols = cb * block_channels + jnp.arange(block_channels, dtype=jnp.int32)
    vals = [pltr.load(win_ref.at[b, i, cols]) for i in range(width)]
    vals.append(pltr.load(x_ref.at[b, cols]).astype(win_ref.dtype))
    acc = pltr.load(b_ref.at[0, cols])
    for i, val in enumerate(vals):
        acc = acc + pltr.load(w_ref.at[i, cols]).astype(_F32) * val.astype(_F32)
    pltr.store(y_ref.at[b, cols], (acc * jax.nn.sigmoid(acc)).astype(y_ref.dtype))
    slot = wslot_ref[b]

    @pl.when(slot > 0)
    def _write():
        for w in range(width):
            pltr.store(pool_ref.at[slot, w, cols], vals[w + 1].astype(pool_ref.dtype))


@functools.partial(jax.jit, static_argnames=("interpret",), donate_argnames=("conv_pool",))
def causal_conv1d_decode(x, weight, bias, conv_pool, read_slot, write_slot, *,
                         interpret: bool = False):
    """Pallas-Triton decode (one token per sequence); same contract as
    ``causal_conv1d_decode_reference``: x ``[B, C]``. Returns ``(y [B, C], conv_pool)``."""
    check_conv(x, weight, bias, conv_pool)
    num_seqs, channels = x.shape
    block_channels = _block_channels(channels)
    kernel = functools.partial(_conv_decode_kernel, block_channels=block_channels)
    y, conv_pool = pl.pallas_call(
        kernel, grid=(num_seqs, channels // block_channels),
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype),
                   jax.ShapeDtypeStruct(conv_pool.shape, conv_pool.dtype)],
        input_output_aliases={5: 1}, interpret=interpret,
        compiler_params=_params(block_channels),
    )(write_slot.astype(jnp.int32), x, conv_pool[read_slot], weight,
      bias_row(bias, channels), conv_pool)
    return y, conv_pool
