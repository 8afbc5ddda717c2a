"""Pallas Triton (GPU) Mamba2 SSD chunked prefill over ragged sequences, with snapshots at any
offset; the pool is updated in place. Decode lives in ``gpu/ssd_decode.py`` (re-exported).

Same contract as ``reference.ssd`` (state ``[H, N, P]`` f32 per slot; the chunked form is in
``docs/kernels.md``). fla / mamba_ssm-style split into five launches, so that only an
elementwise recurrence is sequential:

1. ``_chunk_state_kernel``, grid ``(NC, H, P / BP)`` (parallel): each chunk's own state
   contribution ``dS = B^T (exp(g_last - g) dt * x)`` ``[N, BP]``, into ``states``.
2. ``ssd_state.state_pass``: the sequential pass over each sequence's chunks
   (``S <- exp(g_last) S0 + dS``, the chunk start states ``S0``) and a parallel kernel over the
   CSR targets (finals, snapshots: ``S_r`` after any row r), written into the pool in place.
3. ``_scores_kernel``, grid ``(NC, G)`` (parallel): ``C B^T`` once per chunk and group.
4. ``_output_kernel``, grid ``(NC, H, P / BP)`` (parallel):
   ``y = exp(g) (C S0) + (exp(g_i - g_j) [j <= i] C B^T dt_j) x + D x``.

HBM beyond the inputs: the chunk states ``[NC, H, N, P]``, the largest traffic (hence chunks of
128 by default for narrow inputs): ``dS`` f32 written and read once; ``S0`` written and read
once, in the input dtype (narrow inputs: the output rounds it anyway; f32: over ``dS`` in
place); and ``C B^T`` ``[NC, G, BT, BT]`` f32.

Dot operands (accumulation always f32): bf16 / f16 inputs go to the tensor cores as they are;
f32 intermediates that multiply them are rounded to the input dtype for the output (y is in
that dtype) and split into two input-dtype terms ``hi + lo`` for the states (f32, ~2^-16
relative), so interpreted runs see the same roundings as the GPU. f32 inputs use ``F32_DOT``
(3-pass tf32 on the GPU, about fp32 accuracy; exact fp32 when interpreted).
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
    chunk_spans,
    extend_targets,
    max_chunks,
    token_seq_ids,
)
from pallas_kernels.gpu.gated_delta_rule import padded_ds, pow2_at_least_16
from pallas_kernels.gpu.ssd_decode import ssd_decode
from pallas_kernels.gpu.ssd_state import last, load_chunk, mm, state_pass, weighted_bt_x
from pallas_kernels.reference.ssd import check_ssd

__all__ = ["ssd_decode", "ssd_extend"]

_F32 = jnp.float32
_HIGHEST = (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST)  # exact fp32 (interpreted)
F32_DOT = jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3  # f32 inputs, compiled: 3 tf32 passes
BLOCK_P = 64        # head-dim tile of the parallel kernels
BLOCK_P_STATE = 16  # head-dim tile of the state pass (more programs for a memory-bound walk)
CHUNK_NARROW = 128  # default chunk, bf16 / f16 inputs: half the chunk states of 64 in HBM
CHUNK_F32 = 64      # default chunk, f32 inputs (3-pass tf32 tiles of 128 spill: 339 at 128)
NUM_WARPS = 8
NUM_STAGES = 1


def _chunk_state_kernel(cstart_ref,  # [NC] i32 first token of each chunk
                        clen_ref,    # [NC] i32 tokens in each chunk (0: unused chunk)
                        x_ref,       # [T, H, P]
                        dt_ref,      # [T, H] f32
                        a_ref,       # [H] f32
                        b_ref,       # [T, G, N]
                        states_ref,  # [NC, H, N, P] f32 out: the chunk's dS
                        *, bt: int, block_n: int, block_p: int, state_size: int, group: int,
                        f32_dot):
    c, h, pt = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    bm, dt, g, rmask = load_chunk(b_ref, dt_ref, cstart_ref[c], clen_ref[c], h,
                                   jax.lax.div(h, group), a_ref[h], bt=bt, block_n=block_n,
                                   state_size=state_size)
    pmask = (pt * block_p + jnp.arange(block_p)) < x_ref.shape[2]
    pidx = pl.ds(pt * block_p, block_p)
    x = pltr.load(x_ref.at[pl.ds(cstart_ref[c], bt), h, pidx],
                  mask=rmask[:, None] & pmask[None, :], other=0.0)
    w = jnp.exp(last(g, jnp.arange(bt), bt) - g) * dt
    nmask = jnp.arange(block_n) < state_size
    pltr.store(states_ref.at[c, h, padded_ds(block_n), pidx], weighted_bt_x(bm, w, x, f32_dot),
               mask=nmask[:, None] & pmask[None, :])


def _scores_kernel(cstart_ref,  # [NC] i32 first token of each chunk
                   clen_ref,    # [NC] i32 tokens in each chunk
                   b_ref,       # [T, G, N]
                   c_ref,       # [T, G, N]
                   cb_ref,      # [NC, G, BT, BT] f32 out: C B^T of the chunk (zero past clen)
                   *, bt: int, block_n: int, state_size: int, f32_dot):
    c, grp = pl.program_id(0), pl.program_id(1)
    rmask = jnp.arange(bt) < clen_ref[c]
    mask = rmask[:, None] & (jnp.arange(block_n) < state_size)[None, :]
    tidx, nidx = pl.ds(cstart_ref[c], bt), padded_ds(block_n)
    bm = pltr.load(b_ref.at[tidx, grp, nidx], mask=mask, other=0.0)
    cm = pltr.load(c_ref.at[tidx, grp, nidx], mask=mask, other=0.0)
    pltr.store(cb_ref.at[c, grp, pl.ds(0, bt), pl.ds(0, bt)], mm(cm, bm, f32_dot, trans_b=True))


def _output_kernel(cstart_ref,  # [NC] i32 first token of each chunk
                   clen_ref,    # [NC] i32 tokens in each chunk
                   x_ref,       # [T, H, P]
                   dt_ref,      # [T, H] f32
                   a_ref,       # [H] f32
                   c_ref,       # [T, G, N]
                   d_ref,       # [H] f32
                   cb_ref,      # [NC, G, BT, BT] f32 C B^T per chunk and group
                   states_ref,  # [NC, H, N, P] chunk start states (input dtype)
                   y_ref,       # [T, H, P] out (padding tokens left unwritten)
                   *, bt: int, block_n: int, block_p: int, state_size: int, group: int,
                   f32_dot):
    c, h, pt = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    tok0, grp, lane = cstart_ref[c], jax.lax.div(h, group), jnp.arange(bt)
    rmask = lane < clen_ref[c]
    tidx, nidx, pidx = pl.ds(tok0, bt), padded_ds(block_n), pl.ds(pt * block_p, block_p)
    dt = pltr.load(dt_ref.at[tidx, h], mask=rmask, other=0.0)
    g = jnp.cumsum(dt * a_ref[h])
    nmask = jnp.arange(block_n) < state_size
    pmask = (pt * block_p + jnp.arange(block_p)) < x_ref.shape[2]
    cm = pltr.load(c_ref.at[tidx, grp, nidx], mask=rmask[:, None] & nmask[None, :], other=0.0)
    tile = rmask[:, None] & pmask[None, :]
    x = pltr.load(x_ref.at[tidx, h, pidx], mask=tile, other=0.0)
    s0 = pltr.load(states_ref.at[c, h, nidx, pidx], mask=nmask[:, None] & pmask[None, :],
                   other=0.0)
    cb = cb_ref[c, grp, pl.ds(0, bt), pl.ds(0, bt)]
    rows = jax.lax.broadcasted_iota(jnp.int32, (bt, bt), 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, (bt, bt), 1)
    decay = jnp.exp(jnp.where(rows >= cols, g[:, None] - g[None, :], -jnp.inf))
    scores = (decay * cb * dt[None, :]).astype(x.dtype)
    y = (jnp.exp(g)[:, None] * mm(cm, s0, f32_dot)
         + mm(scores, x, f32_dot) + d_ref[h] * x.astype(_F32))
    pltr.store(y_ref.at[tidx, h, pidx], y.astype(y_ref.dtype), mask=tile)


def _extend_call(cu_seqlens, read_slot, chunk_off, cstart, clen, tstart, trow, tslot, x, dt, a,
                 b, c, d, ssm_pool, *, chunk_size: int, interpret: bool):
    num_heads, p, n = x.shape[1], x.shape[2], b.shape[2]
    num_chunks = cstart.shape[0]
    block_p = min(BLOCK_P, pow2_at_least_16(p))
    block_ps = min(BLOCK_P_STATE, block_p)
    common = dict(bt=chunk_size, block_n=pow2_at_least_16(n), state_size=n,
                  group=num_heads // b.shape[1], f32_dot=_HIGHEST if interpret else F32_DOT)
    params = pltr.CompilerParams(num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    sds = jax.ShapeDtypeStruct
    states = pl.pallas_call(
        functools.partial(_chunk_state_kernel, block_p=block_p, **common),
        grid=(num_chunks, num_heads, pl.cdiv(p, block_p)), interpret=interpret,
        out_shape=sds((num_chunks, num_heads, n, p), _F32), compiler_params=params,
    )(cstart, clen, x, dt, a, b)
    states, ssm_pool = state_pass(
        cu_seqlens, read_slot, chunk_off, cstart, clen, tstart, trow, tslot, x, dt, a, b, states,
        ssm_pool, chunk_size=chunk_size, block_n=common["block_n"], block_p=block_p,
        block_p_state=block_ps, group=common["group"], f32_dot=common["f32_dot"], params=params,
        interpret=interpret)
    cb = pl.pallas_call(
        functools.partial(_scores_kernel, bt=chunk_size, block_n=common["block_n"],
                          state_size=n, f32_dot=common["f32_dot"]),
        grid=(num_chunks, b.shape[1]), interpret=interpret, compiler_params=params,
        out_shape=sds((num_chunks, b.shape[1], chunk_size, chunk_size), _F32),
    )(cstart, clen, b, c)
    y = pl.pallas_call(
        functools.partial(_output_kernel, block_p=block_p, **common),
        grid=(num_chunks, num_heads, pl.cdiv(p, block_p)), interpret=interpret,
        out_shape=sds(x.shape, x.dtype), compiler_params=params,
    )(cstart, clen, x, dt, a, c, d, cb, states)
    return y, ssm_pool


@functools.partial(jax.jit, static_argnames=("chunk_size", "interpret", "fixed_order"),
                   donate_argnames=("ssm_pool",))
def ssd_extend(x, dt, a, b, c, d, ssm_pool, cu_seqlens, read_slot, write_slot, snap_seq,
               snap_offset, snap_slot, *, chunk_size: int | None = None, interpret: bool = False,
               fixed_order: bool = False):
    """Pallas Triton chunked prefill; the contract of ``ssd_extend_reference``. ``chunk_size``
    must be a power of two >= 16 here (Triton tiles; None: ``CHUNK_NARROW`` / ``CHUNK_F32``).
    x, B, C of one narrow dtype (bf16, f16) feed the tensor cores as they are; otherwise all
    three are taken as f32. Returns ``(y [T, H, P] in x.dtype, ssm_pool)``; padding tokens
    give 0. [deterministic] ``fixed_order``: chunks of ``CHUNK_F32`` (64) whatever the dtype,
    so that the deterministic grid (64) is a multiple of the chunk size."""
    check_ssd(x, dt, a, b, c, d, ssm_pool)
    narrow = x.dtype in (jnp.bfloat16, jnp.float16) and b.dtype == c.dtype == x.dtype
    if chunk_size is None:
        chunk_size = CHUNK_NARROW if narrow and not fixed_order else CHUNK_F32
    check_chunk_size(chunk_size)
    check(chunk_size >= 16 and chunk_size & (chunk_size - 1) == 0,
          f"chunk_size {chunk_size} must be a power of two >= 16 on GPU")
    num_tokens, num_seqs = x.shape[0], read_slot.shape[0]
    num_chunks = max_chunks(num_tokens, chunk_size, num_seqs)
    _, _, _, chunk_off = chunk_layout(cu_seqlens, num_tokens, chunk_size, num_chunks)
    ssm_pool, tstart, trow, tslot = extend_targets(
        ssm_pool, cu_seqlens, read_slot, write_slot, snap_seq, snap_offset, snap_slot,
        chunk_off, chunk_size, num_chunks)
    i32 = lambda v: jnp.asarray(v, jnp.int32)
    cu = i32(cu_seqlens)
    cseq, loc, clen = chunk_spans(cu, num_tokens, chunk_size, num_chunks)
    cdt = x.dtype if narrow else _F32
    y, ssm_pool = _extend_call(
        cu, i32(read_slot), chunk_off, cu[cseq] + loc, clen, tstart, trow, tslot,
        x.astype(cdt), dt.astype(_F32), a.astype(_F32), b.astype(cdt), c.astype(cdt),
        d.astype(_F32), ssm_pool, chunk_size=chunk_size, interpret=interpret)
    _, valid = token_seq_ids(cu_seqlens, num_tokens)
    return jnp.where(valid[:, None, None], y, 0).astype(x.dtype), ssm_pool
