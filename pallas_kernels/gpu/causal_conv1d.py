"""GPU (Pallas Triton) causal conv1d + SiLU: ragged chunked prefill with window writes, decode.

Same contract as ``reference.causal_conv1d`` (whose plain-jnp references these kernels are
tested against). ``conv_pool[slot]`` is ``[K-1, C]``: the last K-1 inputs of a sequence.

Prefill grid ``(NC + B, C / BC)``, both parallel: chunk c < NC (``BT`` tokens of one sequence,
chunking restarts at every sequence start) reads its rows straight from the packed ``x`` with
gather loads; local positions < 0 (only in a sequence's first chunk: ``K - 1 <= BT``) come from
the sequence's initial window, read in place from the pool. Every window the call writes (the
final windows and the snapshots, any offset) is written by its sequence's *owner*: the first
chunk, or program ``NC + b`` for an empty sequence b (no chunk; its windows are copies of the
initial one). The owner loads the initial window rows into registers before its first write, so
a sequence may write its own read slot (the usual case); as for every kernel here, no sequence
may write a slot that another sequence of the same call reads. No gathered copy of the pool or
of x is made in the wrapper.

Decode grid ``(B, C / BC)`` with channel tiles of up to 1024 (8 channels a thread: 16-byte
loads in bf16): each program reads its ``K - 1`` window rows from the pool in place, applies the
token and writes the shifted window to ``write_slot`` (skipped for slot 0).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels._common import (
    bias_row,
    check,
    check_chunk_size,
    chunk_spans,
    max_chunks,
    state_targets,
)
from pallas_kernels.reference.causal_conv1d import check_conv

_F32 = jnp.float32
PREFILL_CHANNELS = 128   # prefill channel tile (rows: chunk_size): [64, 128] f32 per tap
PREFILL_WARPS = 8
DECODE_CHANNELS = 1024   # decode channel tile: 8 channels per thread at 4 warps


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _block_channels(channels: int, most: int) -> int:
    """Largest power of two <= ``most`` dividing ``channels`` (channel tiles stay in bounds)."""
    return min(most, channels & -channels)


def _gather_inputs(x_ref, pool_ref, slot, start, pos, ok, cols):
    """f32 inputs at local positions ``pos [R]`` of one sequence; rows where ``ok [R]`` is False
    are 0. Positions >= 0 are rows ``start + pos`` of x_ref ``[T, C]``; positions < 0 are rows
    ``K - 1 + pos`` of the initial window ``pool_ref[slot]`` (``[N, K-1, C]``). ``cols [BC]``
    channel indices. Returns ``[R, BC]``.
    """
    shape = (pos.shape[0], cols.shape[0])
    width = pool_ref.shape[1]
    col_idx = jnp.broadcast_to(cols[None, :], shape)
    in_x = jnp.broadcast_to((ok & (pos >= 0))[:, None], shape)
    in_w = jnp.broadcast_to((ok & (pos < 0))[:, None], shape)
    x_row = jnp.clip(start + pos, 0, x_ref.shape[0] - 1)
    w_row = jnp.clip(width + pos, 0, width - 1)
    from_x = pltr.load(x_ref.at[jnp.broadcast_to(x_row[:, None], shape), col_idx], mask=in_x,
                       other=0)
    from_w = pltr.load(pool_ref.at[jnp.full(shape, slot, jnp.int32),
                                   jnp.broadcast_to(w_row[:, None], shape), col_idx],
                       mask=in_w, other=0)
    return from_x.astype(_F32) + from_w.astype(_F32)


def _write_windows(tstart_ref, toff_ref, tslot_ref, x_ref, init, start, c, cols, pool_ref):
    """Write the windows owned by program ``c``: target j is the window after ``toff[j]`` tokens
    of the sequence (local positions ``toff - K + 1 ..``; negative ones from ``init``
    ``[WP, BC]`` f32, the initial window rows in registers) into ``pool_ref[tslot[j]]``."""
    width = pool_ref.shape[1]
    w_rows = jnp.arange(init.shape[0], dtype=jnp.int32)

    def write_target(j, carry):
        slot, off = tslot_ref[j], toff_ref[j]

        @pl.when(slot > 0)
        def _write():
            for w in range(width):
                pos = off - width + w
                row = jnp.sum(jnp.where((w_rows == width + pos)[:, None], init, 0.0), axis=0)
                from_x = pltr.load(x_ref.at[jnp.maximum(start + pos, 0), cols],
                                   mask=jnp.broadcast_to(pos >= 0, cols.shape), other=0)
                win = jnp.where(pos >= 0, from_x.astype(_F32), row)
                pltr.store(pool_ref.at[slot, w, cols], win.astype(pool_ref.dtype))

        return carry

    jax.lax.fori_loop(tstart_ref[c], tstart_ref[c + 1], write_target, 0)


def _conv_chunk_kernel(meta_ref,     # [4, NC+B] int32 per program: seq, seq start, local
                                     # offset, count (programs >= NC: empty, own seq's windows)
                       rslot_ref,    # [B] int32 read slots (initial windows)
                       tstart_ref,   # [NC+B+1] int32: CSR of the windows each program writes
                       toff_ref,     # [J] int32: window after this many tokens of the sequence
                       tslot_ref,    # [J] int32: to this pool slot (0: dropped)
                       x_ref,        # [T, C] packed inputs
                       w_ref,        # [K, C]
                       b_ref,        # [1, C] f32
                       pool_in_ref,  # [N, K-1, C] initial windows; aliased to pool_ref
                       y_ref,        # [T + BTP, C] outputs; rows >= T absorb masked rows
                       pool_ref,     # [N, K-1, C] windows written here
                       *, block_rows: int, block_channels: int):
    c, cb = pl.program_id(0), pl.program_id(1)
    kernel = w_ref.shape[0]
    width = kernel - 1
    num_tokens = x_ref.shape[0]
    seq, start, loc, count = meta_ref[0, c], meta_ref[1, c], meta_ref[2, c], meta_ref[3, c]
    read = rslot_ref[seq]
    cols = cb * block_channels + jnp.arange(block_channels, dtype=jnp.int32)
    wp = _pow2_at_least(width)
    w_rows = jnp.arange(wp, dtype=jnp.int32)
    owner = tstart_ref[c + 1] > tstart_ref[c]
    init = _gather_inputs(x_ref, pool_in_ref, read, start, w_rows - width,
                          owner & (w_rows < width), cols)           # [WP, BC] before any write
    r = jnp.arange(block_rows, dtype=jnp.int32)
    ok = r < count
    acc = jnp.broadcast_to(pltr.load(b_ref.at[0, cols])[None, :], (block_rows, block_channels))
    for i in range(kernel):
        xs = _gather_inputs(x_ref, pool_in_ref, read, start, loc + r - width + i, ok, cols)
        acc = acc + pltr.load(w_ref.at[i, cols]).astype(_F32)[None, :] * xs
    y = (acc * jax.nn.sigmoid(acc)).astype(y_ref.dtype)
    rows = jnp.where(ok, start + loc + r, num_tokens + r)   # unique rows, all in bounds
    shape = (block_rows, block_channels)
    pltr.store(y_ref.at[jnp.broadcast_to(rows[:, None], shape),
                        jnp.broadcast_to(cols[None, :], shape)], y,
               mask=jnp.broadcast_to(ok[:, None], shape))
    _write_windows(tstart_ref, toff_ref, tslot_ref, x_ref, init, start, c, cols, pool_ref)


def _params(block_channels: int, warps: int = 4) -> pltr.CompilerParams:
    return pltr.CompilerParams(num_warps=warps if block_channels >= 64 else 1, num_stages=1)


def _owned_targets(cu_seqlens, write_slot, snap_seq, snap_offset, snap_slot, cseq, count,
                   num_chunks: int):
    """Every window the call writes, as a CSR table over the ``NC + B`` programs by owner (the
    sequence's first chunk, or ``NC + b`` when sequence b is empty). Returns ``(tstart
    [NC+B+1], toff [J] tokens of the sequence before the window's end, tslot [J])``."""
    num_seqs = write_slot.shape[0]
    t_seq, t_off, t_slot = state_targets(cu_seqlens, write_slot, snap_seq, snap_offset,
                                         snap_slot)
    c = jnp.arange(num_chunks, dtype=jnp.int32)
    first = jnp.full((num_seqs,), num_chunks, jnp.int32).at[cseq].min(
        jnp.where(count > 0, c, num_chunks))
    first = jnp.where(first < num_chunks, first, num_chunks + jnp.arange(num_seqs))
    owner = first[t_seq]
    order = jnp.argsort(owner, stable=True)
    tstart = jnp.searchsorted(owner[order], jnp.arange(num_chunks + num_seqs + 1), side="left")
    return tstart.astype(jnp.int32), t_off[order], t_slot[order].astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("chunk_size", "interpret", "fixed_order"),
                   donate_argnames=("conv_pool",))
def causal_conv1d_extend(x, weight, bias, conv_pool, cu_seqlens, read_slot, write_slot,
                         snap_seq, snap_offset, snap_slot, *, chunk_size: int = 64,
                         interpret: bool = False, fixed_order: bool = False):
    """Pallas-Triton chunked prefill; same contract as ``causal_conv1d_extend_reference``:
    x ``[T, C]``, weight ``[K, C]``, bias ``[C]`` or None, conv_pool ``[N, K-1, C]`` (x dtype).
    Returns ``(y [T, C] in x.dtype (0 past cu_seqlens[-1]), conv_pool)``.

    ``fixed_order`` (the TPU kernel's signature, ``ops.FIXED_ORDER_KERNELS``): nothing to
    change here, every row already sums its K taps in tap order, window rows included."""
    del fixed_order
    check_conv(x, weight, bias, conv_pool)
    check_chunk_size(chunk_size)
    num_tokens, channels = x.shape
    width = weight.shape[0] - 1
    check(width <= chunk_size, f"conv kernel {width + 1} - 1 must be <= chunk_size {chunk_size}")
    num_seqs = read_slot.shape[0]
    num_chunks = max_chunks(num_tokens, chunk_size, num_seqs)
    cseq, loc, count = chunk_spans(cu_seqlens, num_tokens, chunk_size, num_chunks)
    tstart, toff, tslot = _owned_targets(cu_seqlens, write_slot, snap_seq, snap_offset,
                                         snap_slot, cseq, count, num_chunks)
    empty = jnp.arange(num_seqs, dtype=jnp.int32)
    seqs = jnp.concatenate([cseq, empty])
    meta = jnp.stack([seqs, cu_seqlens[seqs], jnp.concatenate([loc, 0 * empty]),
                      jnp.concatenate([count, 0 * empty])]).astype(jnp.int32)
    block_rows = _pow2_at_least(chunk_size)
    block_channels = _block_channels(channels, PREFILL_CHANNELS)
    kernel = functools.partial(_conv_chunk_kernel, block_rows=block_rows,
                               block_channels=block_channels)
    y, conv_pool = pl.pallas_call(
        kernel, grid=(num_chunks + num_seqs, channels // block_channels),
        out_shape=[jax.ShapeDtypeStruct((num_tokens + block_rows, channels), x.dtype),
                   jax.ShapeDtypeStruct(conv_pool.shape, conv_pool.dtype)],
        input_output_aliases={8: 1}, interpret=interpret,
        compiler_params=_params(block_channels, PREFILL_WARPS),
    )(meta, read_slot.astype(jnp.int32), tstart, toff, tslot, x, weight,
      bias_row(bias, channels), conv_pool)
    valid = jnp.arange(num_tokens) < cu_seqlens[-1]
    return jnp.where(valid[:, None], y[:num_tokens], 0).astype(x.dtype), conv_pool


def _conv_decode_kernel(rslot_ref,    # [B] int32 read slots (initial windows)
                        wslot_ref,    # [B] int32 write slots (0: dropped)
                        x_ref,        # [B, C] one token per sequence
                        w_ref,        # [K, C]
                        b_ref,        # [1, C] f32
                        pool_in_ref,  # [N, K-1, C] initial windows; aliased to pool_ref
                        y_ref,        # [B, C]
                        pool_ref,     # [N, K-1, C] new windows written here
                        *, block_channels: int):
    b, cb = pl.program_id(0), pl.program_id(1)
    width = w_ref.shape[0] - 1
    cols = cb * block_channels + jnp.arange(block_channels, dtype=jnp.int32)
    read = rslot_ref[b]
    vals = [pltr.load(pool_in_ref.at[read, i, cols]) for i in range(width)]
    vals.append(pltr.load(x_ref.at[b, cols]).astype(pool_ref.dtype))
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
    block_channels = _block_channels(channels, DECODE_CHANNELS)
    kernel = functools.partial(_conv_decode_kernel, block_channels=block_channels)
    y, conv_pool = pl.pallas_call(
        kernel, grid=(num_seqs, channels // block_channels),
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype),
                   jax.ShapeDtypeStruct(conv_pool.shape, conv_pool.dtype)],
        input_output_aliases={5: 1}, interpret=interpret,
        compiler_params=_params(block_channels),
    )(read_slot.astype(jnp.int32), write_slot.astype(jnp.int32), x, weight,
      bias_row(bias, channels), conv_pool)
    return y, conv_pool
