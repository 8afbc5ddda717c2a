"""TPU (Mosaic) causal conv1d + SiLU: ragged prefill (with window writes) and decode.

Same contract as ``reference.causal_conv1d``. Prefill grid ``(C / BC, NB)``: step (cb, j) takes
rows ``j*BT .. j*BT+BT-1`` of the packed x as an ordinary aligned block, plus the 8 rows before
it (a second aligned block: the halo, >= K-1 rows), and writes the same rows of y; there is no
gathered chunk copy of x and no gather of y. Rows whose taps reach before their sequence's start
(its first K-1 rows, of the sequences ``slo[j] .. shi[j]-1``) mask those taps and take the
initial window instead, DMA'd from the pool in place (step ``_starts_step``; the common step has
none). Every window (final, snapshots at any offset, empty sequences' copies) is written at the
step holding its last token: windows at offsets >= K-1 come from xs rows, those at offsets < K-1
inside the step that read their sequence's initial window, right after reading it, so a
sequence may write its own read slot. The row axis is "arbitrary" (in order: a sequence's
initial window is read before its later windows are written), the channel axis "parallel".
No sequence may write a slot another sequence of the same call reads.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._common import bias_row, check, check_chunk_size, state_targets
from pallas_kernels.reference.causal_conv1d import check_conv

_F32 = jnp.float32
HALO = 8     # rows of the previous block each step sees (>= K - 1, one sublane tile)


def _silu_taps(xs_ref, w_ref, b_ref, rows: int):
    """``silu(b + sum_i w[i] * xs[i : i + rows])`` in f32; xs_ref ``[rows + K - 1, BC]`` f32."""
    acc = jnp.broadcast_to(b_ref[...].astype(_F32), (rows, xs_ref.shape[1]))
    for i in range(w_ref.shape[0]):
        acc = acc + w_ref[pl.ds(i, 1), :].astype(_F32) * xs_ref[pl.ds(i, rows), :]
    return acc * jax.nn.sigmoid(acc)


def _pick_row(rows8, k):
    """Row ``k`` (traced, 0..7) of ``rows8 [8, BC]`` as ``[1, BC]``, exactly (a masked sum)."""
    sub = jax.lax.broadcasted_iota(jnp.int32, rows8.shape, 0)
    return jnp.sum(jnp.where(sub == k, rows8, 0.0), axis=0, keepdims=True)


def _window(xs_ref, init, row0, off, width: int):
    """The window after ``off`` tokens of a sequence whose first token is xs row ``row0``:
    ``[8, BC]`` f32, rows ``0..K-2`` = local positions ``off-K+1 .. off-1``, from xs where >= 0
    (every such row lies in xs for the owner step) and from ``init [8, BC]`` (the initial window,
    rows 0..K-2) where negative."""
    out = jnp.zeros((8, xs_ref.shape[1]), _F32)
    sub = jax.lax.broadcasted_iota(jnp.int32, out.shape, 0)
    for w in range(width):
        q = off - width + w
        ri = jnp.maximum(row0 + q, 0)
        from_x = _pick_row(xs_ref[pl.ds(pl.multiple_of(ri - (ri & 7), 8), 8), :], ri & 7)
        from_w = _pick_row(init, jnp.minimum(off + w, 7))
        out = jnp.where(sub == w, jnp.where(q >= 0, from_x, from_w), out)
    return out


def _conv_block_kernel(cu_ref,      # SMEM [B+1] cu_seqlens
                       rslot_ref,   # SMEM [B] read slots
                       slo_ref,     # SMEM [NB] sequences slo..shi-1 start at a row that
                       shi_ref,     # SMEM [NB]   needs its initial window in block j
                       tstart_ref,  # SMEM [NB+1] CSR of the windows written at block j
                       tseq_ref,    # SMEM [J] window's sequence
                       toff_ref,    # SMEM [J] window after this many tokens
                       tslot_ref,   # SMEM [J] to this slot (0: dropped)
                       x_ref,       # [BT, BC] rows j*BT .. of the packed x
                       halo_ref,    # [8, BC] rows j*BT - 8 .. (block 0: rows 0..7, unused)
                       w_ref,       # [K, BC]
                       b_ref,       # [1, BC] f32
                       pool_ref,    # [N, K-1, C] HBM initial windows (alias of pool_out)
                       y_ref,       # [BT, BC] outputs of rows j*BT ..
                       pool_out,    # [N, K-1, C] HBM windows written here
                       xs_ref,      # [8 + BT + 8, BC] f32: halo, block, 8 spare rows
                       acc_ref,     # [BT, BC] f32
                       local_ref,   # [BT, BC] int32: row - sequence start where < K-1, else K-1
                       init_ref,    # [8, BC] f32: the initial window of one sequence
                       win_ref,     # [K-1, BC] pool dtype: DMA staging
                       *itap_ref,   # [fixed_order] [K-1, BT, BC] f32: initial-window taps
                       fixed_order: bool = False):
    cb, j = pl.program_id(0), pl.program_id(1)
    bt, bc = y_ref.shape
    width = w_ref.shape[0] - 1
    cols = pl.ds(pl.multiple_of(cb * bc, bc), bc)
    xs_ref[pl.ds(0, HALO), :] = halo_ref[...].astype(_F32)
    xs_ref[pl.ds(HALO, bt), :] = x_ref[...].astype(_F32)
    xs_ref[pl.ds(HALO + bt, 8), :] = jnp.zeros((8, bc), _F32)
    starts = slo_ref[j] < shi_ref[j]             # some sequence's first rows are here

    @pl.when(jnp.logical_not(starts))            # the common step: taps straight from xs
    def _plain():
        acc = jnp.broadcast_to(b_ref[...], (bt, bc))
        for i in range(width + 1):
            tap = xs_ref[pl.ds(HALO - width + i, bt), :]
            acc = acc + w_ref[pl.ds(i, 1), :].astype(_F32) * tap
        y_ref[...] = (acc * jax.nn.sigmoid(acc)).astype(y_ref.dtype)

    @pl.when(starts)
    def _with_starts():
        _starts_step(cb, j, cu_ref, rslot_ref, slo_ref, shi_ref, tstart_ref, tseq_ref, toff_ref,
                     tslot_ref, w_ref, b_ref, pool_ref, y_ref, pool_out, xs_ref, acc_ref,
                     local_ref, init_ref, win_ref, itap_ref[0] if fixed_order else None)

    def window_x(k, carry):                      # windows at offsets >= K-1: rows of x only
        @pl.when((toff_ref[k] >= width) & (tslot_ref[k] > 0))
        def _write():
            start = cu_ref[tseq_ref[k]]
            win = _window(xs_ref, init_ref[...], start - j * bt + HALO, toff_ref[k], width)
            win_ref[...] = win[:width].astype(win_ref.dtype)
            pltpu.sync_copy(win_ref, pool_out.at[tslot_ref[k], :, cols])
        return carry

    jax.lax.fori_loop(tstart_ref[j], tstart_ref[j + 1], window_x, 0)


def _starts_step(cb, j, cu_ref, rslot_ref, slo_ref, shi_ref, tstart_ref, tseq_ref, toff_ref,
                 tslot_ref, w_ref, b_ref, pool_ref, y_ref, pool_out, xs_ref, acc_ref, local_ref,
                 init_ref, win_ref, itap_ref):
    """A step where sequences start (their first K-1 rows take the initial window): outputs
    with per-row tap masks plus the initial-window taps, and those sequences' windows at
    offsets < K-1 (written right after their initial window is read). [deterministic]
    ``itap_ref`` (``[K-1, BT, BC]``, else None): each initial-window tap is staged in it and
    every row sums its taps in tap order, as a row with all its taps in x and the decode do
    (else the initial-window taps are summed apart, then added)."""
    bt, bc = y_ref.shape
    width = w_ref.shape[0] - 1
    cols = pl.ds(pl.multiple_of(cb * bc, bc), bc)
    acc_ref[...] = jnp.broadcast_to(b_ref[...], (bt, bc))
    local_ref[...] = jnp.full((bt, bc), width, jnp.int32)
    row = j * bt + jax.lax.broadcasted_iota(jnp.int32, (bt, bc), 0)   # packed row of each
    t0, t1 = tstart_ref[j], tstart_ref[j + 1]
    if itap_ref is not None:
        itap_ref[...] = jnp.zeros(itap_ref.shape, _F32)

    def one_seq(b, carry):                       # a sequence whose first rows meet this block
        start, length = cu_ref[b], cu_ref[b + 1] - cu_ref[b]
        pltpu.sync_copy(pool_ref.at[rslot_ref[b], :, cols], win_ref)
        init_ref[...] = jnp.zeros((8, bc), _F32)
        init_ref[pl.ds(0, width), :] = win_ref[...].astype(_F32)
        init = init_ref[...]
        first = (row >= start) & (row < start + jnp.minimum(length, width))
        local_ref[...] = jnp.where(first, row - start, local_ref[...])
        if itap_ref is not None:
            for t in range(width):
                here = (row == start + t) & (t < length)
                for i in range(width - t):
                    itap_ref[i] = jnp.where(here, init[t + i:t + i + 1], itap_ref[i])
        else:
            fix = jnp.zeros((bt, bc), _F32)
            for t in range(width):                   # row start + t: its taps i < K-1-t
                here = (row == start + t) & (t < length)   # read init row t + i
                for i in range(width - t):
                    fix = fix + jnp.where(here, w_ref[pl.ds(i, 1), :].astype(_F32)
                                          * init[t + i:t + i + 1], 0.0)
            acc_ref[...] += fix

        def window(k, c2):                       # this sequence's windows at offsets < K-1
            @pl.when((tseq_ref[k] == b) & (toff_ref[k] < width) & (tslot_ref[k] > 0))
            def _write():
                win = _window(xs_ref, init, start - j * bt + HALO, toff_ref[k], width)
                win_ref[...] = win[:width].astype(win_ref.dtype)
                pltpu.sync_copy(win_ref, pool_out.at[tslot_ref[k], :, cols])
            return c2

        jax.lax.fori_loop(t0, t1, window, 0)
        return carry

    jax.lax.fori_loop(slo_ref[j], shi_ref[j], one_seq, 0)
    local = local_ref[...]
    if itap_ref is not None:  # [deterministic] taps in order, each from x or the window
        acc = jnp.broadcast_to(b_ref[...], (bt, bc))
        for i in range(width + 1):
            tap = xs_ref[pl.ds(HALO - width + i, bt), :]
            if i < width:
                tap = jnp.where(local < width - i, itap_ref[i], tap)
            acc = acc + w_ref[pl.ds(i, 1), :].astype(_F32) * tap
        y_ref[...] = (acc * jax.nn.sigmoid(acc)).astype(y_ref.dtype)
        return
    acc = acc_ref[...]
    for i in range(width + 1):                   # taps from x: local position >= 0
        tap = xs_ref[pl.ds(HALO - width + i, bt), :]
        acc = acc + jnp.where(local >= width - i, w_ref[pl.ds(i, 1), :].astype(_F32) * tap, 0.0)
    y_ref[...] = (acc * jax.nn.sigmoid(acc)).astype(y_ref.dtype)


def _block_targets(cu_seqlens, write_slot, snap_seq, snap_offset, snap_slot, num_tokens: int,
                   block: int, num_blocks: int):
    """Windows by the step that writes them: the block holding the window's last token (its
    sequence's first row for offset 0). Returns CSR ``(tstart [NB+1], tseq, toff, tslot)``."""
    t_seq, t_off, t_slot = state_targets(cu_seqlens, write_slot, snap_seq, snap_offset,
                                         snap_slot)
    last = jnp.clip(cu_seqlens[t_seq] + jnp.maximum(t_off, 1) - 1, 0, num_tokens - 1)
    owner = last // block
    order = jnp.argsort(owner, stable=True)
    tstart = jnp.searchsorted(owner[order], jnp.arange(num_blocks + 1), side="left")
    i32 = lambda a: a.astype(jnp.int32)  # noqa: E731
    return i32(tstart), i32(t_seq[order]), i32(t_off[order]), i32(t_slot[order])


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


@functools.partial(jax.jit, static_argnames=("chunk_size", "interpret", "fixed_order"),
                   donate_argnames=("conv_pool",))
def causal_conv1d_extend(x, weight, bias, conv_pool, cu_seqlens, read_slot, write_slot,
                         snap_seq, snap_offset, snap_slot, *, chunk_size: int = 64,
                         interpret: bool = False, fixed_order: bool = False):
    """Pallas prefill over aligned row blocks of x (``chunk_size`` rows, multiple of 8); same
    contract as the reference. Returns ``(y [T, C] in x.dtype, conv_pool)``. [deterministic]
    ``fixed_order``: a sequence's first K-1 rows sum their taps in tap order like every other
    row (``_starts_step``), so a token's bits do not depend on where its extend started."""
    check_conv(x, weight, bias, conv_pool)
    check_chunk_size(chunk_size)
    num_tokens, channels = x.shape
    width = weight.shape[0] - 1
    check(width <= HALO, f"conv kernel {width + 1} - 1 must be <= {HALO}")
    bt, bc = chunk_size, _block_channels(channels)
    num_blocks = pl.cdiv(num_tokens, bt)
    num_seqs = read_slot.shape[0]
    starts = cu_seqlens[:-1]
    edges = jnp.arange(num_blocks + 1, dtype=jnp.int32) * bt
    lo = jnp.searchsorted(starts, edges[:-1] - width + 1, side="left")
    hi = jnp.searchsorted(starts, edges[1:], side="left")
    hi = hi.at[-1].set(num_seqs)                 # the last block also owns trailing empties
    tstart, tseq, toff, tslot = _block_targets(cu_seqlens, write_slot, snap_seq, snap_offset,
                                               snap_slot, num_tokens, bt, num_blocks)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=8, grid=(channels // bc, num_blocks),
        in_specs=[pl.BlockSpec((bt, bc), lambda cb, j, *_: (j, cb)),
                  pl.BlockSpec((HALO, bc),
                               lambda cb, j, *_: (jnp.maximum(j * (bt // HALO) - 1, 0), cb)),
                  pl.BlockSpec((width + 1, bc), lambda cb, j, *_: (0, cb)),
                  pl.BlockSpec((1, bc), lambda cb, j, *_: (0, cb)),
                  pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=[pl.BlockSpec((bt, bc), lambda cb, j, *_: (j, cb)),
                   pl.BlockSpec(memory_space=pl.ANY)],
        scratch_shapes=[pltpu.VMEM((HALO + bt + 8, bc), _F32), pltpu.VMEM((bt, bc), _F32),
                        pltpu.VMEM((bt, bc), jnp.int32),
                        pltpu.VMEM((8, bc), _F32), pltpu.VMEM((width, bc), conv_pool.dtype)]
        + ([pltpu.VMEM((max(width, 1), bt, bc), _F32)] if fixed_order else []))
    y, conv_pool = pl.pallas_call(
        functools.partial(_conv_block_kernel, fixed_order=fixed_order), grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype),
                   jax.ShapeDtypeStruct(conv_pool.shape, conv_pool.dtype)],
        input_output_aliases={8 + 4: 1}, interpret=interpret,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
    )(cu_seqlens.astype(jnp.int32), read_slot.astype(jnp.int32), lo.astype(jnp.int32),
      hi.astype(jnp.int32), tstart, tseq, toff, tslot, x, x, weight, bias_row(bias, channels),
      conv_pool)
    valid = jnp.arange(num_tokens) < cu_seqlens[-1]
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
