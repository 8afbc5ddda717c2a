"""Pallas Triton (GPU) chunked gated delta rule over ragged sequences, with snapshots.

fla-style split of the WY / UT form of ``docs/kernels.md`` into three launches, so that only the
two-matmul state recurrence is sequential:

1. ``_wu_kernel``, grid ``(NC, Hv)`` (parallel): per chunk of ``BT`` tokens (chunks never span
   two sequences), ``A = (I + L)^-1`` (``L = beta exp(G_i - G_j) k_i.k_j``, blocked inverse in
   IEEE fp32), ``W = A (beta exp(G) k)`` and ``U = A (beta v)``.
2. ``_state_kernel``, grid ``(B, Hv, Dv / BV)``: walks a sequence's chunks carrying the state
   tile ``S [Dk, BV]``: ``V' = U - W S`` (the corrected values), records ``S`` at every chunk
   start, writes the states the targets table asks for (finals and snapshots at any row r:
   ``S_r = exp(G_r) S + k^T (exp(G_r - G) V')[:r]``) into the pool in place, and moves on
   with ``S_BT``.
3. ``_output_kernel``, grid ``(NC, Hv, Dv / BV)`` (parallel):
   ``o = exp(G) q S + (exp(G_i - G_j) q_i.k_j)_{j<=i} V'``.

Dots outside the inverse take the precision of the inputs (``fast``): fp32 inputs ``F32_DOT``
(3-pass tf32 on the tensor cores, hi/lo splits of each operand: about fp32, no tf32 rounding;
exact fp32 when interpreted, the CPU has no tf32 passes), bf16 / f16 inputs the default (1-pass
tf32 for the f32 operands). The inverse and ``L`` stay IEEE fp32 (``_HIGHEST``), where
cancellation is. Dk, Dv need not be powers of two: loads and stores are masked.
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
from pallas_kernels.reference.gated_delta_rule import check_gdr

_F32 = jnp.float32
_HIGHEST = (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST)  # IEEE fp32 dots, no TF32
F32_DOT = jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3  # fp32 inputs, compiled: about fp32
SUB = 16        # diagonal block of the blocked inverse (Triton's minimum dot size)
BLOCK_V = 64    # value-dim tile of the state kernel and the output kernel
NUM_WARPS = 8
WU_WARPS = 8    # the inverse's IEEE fp32 dots need the registers of 8 warps
NUM_STAGES = 1


def pow2_at_least_16(n: int) -> int:
    """The smallest power of two >= max(n, 16): a Triton tile that covers ``n``."""
    return max(16, 1 << (max(n, 1) - 1).bit_length())


def padded_ds(size: int) -> pl.Slice:
    """``pl.ds(0, size)`` for a masked load or store whose tile may be wider than the ref's
    dim (a pow2 tile over Dk 24, say; Triton never touches masked elements). The start is an
    array, not a Python int: JAX >= 0.12 checks a slice whose start is a Python int against
    the dim when the ref is indexed, without seeing the mask ("Out of bound slice"), and leaves
    array starts to the kernel. Triton gets ``start + make_range`` offsets; the interpreter
    pads the ref past the dim, where the mask discards."""
    return pl.ds(jnp.int32(0), size)


def _dot(a, b, *, trans_a=False, trans_b=False, precision=_HIGHEST):
    dims = (((0,) if trans_a else (1,)), ((1,) if trans_b else (0,)))
    return jax.lax.dot_general(a, b, (dims, ((), ())), precision=precision,
                               preferred_element_type=_F32)


def unit_lower_inverse(lower):
    """``(I + L)^-1`` for strictly lower ``L [BT, BT]`` f32 (BT a multiple of 16).

    Diagonal 16x16 blocks by forward substitution (row s of every block at once, one dot per
    step), then block rows in order: ``X_r = D_r - D (Lb X)`` restricted to block row r, where
    ``D`` is the block-diagonal inverse and ``Lb`` the strictly block-lower part of ``L``.
    """
    bt = lower.shape[0]
    rows = jax.lax.broadcasted_iota(jnp.int32, (bt, bt), 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, (bt, bt), 1)
    eye = (rows == cols).astype(_F32)
    row_blk = jax.lax.div(rows, SUB)
    same = row_blk == jax.lax.div(cols, SUB)
    diag = jnp.where(same, lower, 0.0)
    row_in = jax.lax.rem(rows, SUB)
    inv_d = jax.lax.fori_loop(
        1, SUB, lambda s, x: jnp.where(row_in == s, eye - _dot(diag, x), x), eye)
    off = jnp.where(same, 0.0, lower)
    return jax.lax.fori_loop(
        1, bt // SUB,
        lambda r, x: jnp.where(row_blk == r, inv_d - _dot(inv_d, _dot(off, x)), x), inv_d)


def _load_chunk_qkg(q_ref, k_ref, g_ref, tok0, count, hk, h, *, bt, block_k, head_k_dim):
    """L2-normalised q (times ``Dk**-0.5``), k ``[BT, block_k]`` f32, in-chunk cumulative
    log-decay ``G [BT]`` and the row mask ``[BT]`` of one chunk (rows >= count are zero)."""
    lane = jnp.arange(bt)
    rmask = lane < count
    kmask = jnp.arange(block_k) < head_k_dim
    tidx, kidx = pl.ds(tok0, bt), padded_ds(block_k)
    qk_mask = rmask[:, None] & kmask[None, :]
    q = pltr.load(q_ref.at[tidx, hk, kidx], mask=qk_mask, other=0.0).astype(_F32)
    k = pltr.load(k_ref.at[tidx, hk, kidx], mask=qk_mask, other=0.0).astype(_F32)
    q = q * jax.lax.rsqrt(jnp.sum(q * q, axis=1, keepdims=True) + 1e-6) * head_k_dim ** -0.5
    k = k * jax.lax.rsqrt(jnp.sum(k * k, axis=1, keepdims=True) + 1e-6)
    g = pltr.load(g_ref.at[tidx, h], mask=rmask, other=0.0)
    return q, k, jnp.cumsum(g), rmask


def _wu_kernel(cstart_ref,  # [NC] i32 first token of each chunk
               clen_ref,    # [NC] i32 tokens in each chunk (0 for unused chunks)
               q_ref,       # [T, Hk, Dk] raw q (unused here: shared loader)
               k_ref,       # [T, Hk, Dk] raw k
               v_ref,       # [T, Hv, Dv]
               g_ref,       # [T, Hv] f32 log-decay
               beta_ref,    # [T, Hv] f32
               w_ref,       # [T, Hv, Dk] f32 out: W = A (beta exp(G) k)
               u_ref,       # [T, Hv, Dv] f32 out: U = A (beta v)
               *, bt: int, head_k_dim: int, block_k: int, block_dv: int, group: int, fast):
    c, h = pl.program_id(0), pl.program_id(1)
    tok0, count = cstart_ref[c], clen_ref[c]
    _, k, gcum, rmask = _load_chunk_qkg(q_ref, k_ref, g_ref, tok0, count, jax.lax.div(h, group),
                                        h, bt=bt, block_k=block_k, head_k_dim=head_k_dim)
    tidx = pl.ds(tok0, bt)
    vmask = jnp.arange(block_dv) < v_ref.shape[2]
    v = pltr.load(v_ref.at[tidx, h, padded_ds(block_dv)], mask=rmask[:, None] & vmask[None, :],
                  other=0.0).astype(_F32)
    beta = pltr.load(beta_ref.at[tidx, h], mask=rmask, other=0.0)[:, None]
    rows = jax.lax.broadcasted_iota(jnp.int32, (bt, bt), 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, (bt, bt), 1)
    decay = jnp.exp(jnp.where(rows > cols, gcum[:, None] - gcum[None, :], -jnp.inf))
    inv = unit_lower_inverse(beta * decay * _dot(k, k, trans_b=True))
    kmask = jnp.arange(block_k) < head_k_dim
    pltr.store(w_ref.at[tidx, h, padded_ds(block_k)],
               _dot(inv, beta * jnp.exp(gcum)[:, None] * k, precision=fast),
               mask=rmask[:, None] & kmask[None, :])
    pltr.store(u_ref.at[tidx, h, padded_ds(block_dv)], _dot(inv, beta * v, precision=fast),
               mask=rmask[:, None] & vmask[None, :])


def _state_kernel(cu_ref,      # [B+1] i32 packed sequence starts
                  read_ref,    # [B] i32 initial-state slot
                  coff_ref,    # [B+1] i32 first chunk of each sequence
                  tstart_ref,  # [NC+1] i32 targets CSR offsets per chunk
                  trow_ref,    # [J] i32 state after this many chunk rows (0..BT)
                  tslot_ref,   # [J] i32 destination slot (0 = dropped)
                  k_ref,       # [T, Hk, Dk] raw k
                  g_ref,       # [T, Hv] f32 log-decay
                  w_ref,       # [T, Hv, Dk] f32
                  u_ref,       # [T, Hv, Dv] f32
                  pool_ref,    # [N, Hv, Dk, Dv] f32 initial states (alias of pool_out)
                  vnew_ref,    # [T, Hv, Dv] f32 out: V' = U - W S
                  hs_ref,      # [NC, Hv, Dk, Dv] f32 out: state at each chunk start
                  pool_out,    # [N, Hv, Dk, Dv] f32 finals and snapshots
                  *, bt: int, head_k_dim: int, block_k: int, block_v: int, group: int, fast):
    b, h, vt = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    start, end = cu_ref[b], cu_ref[b + 1]
    kmask = jnp.arange(block_k) < head_k_dim
    vmask = (vt * block_v + jnp.arange(block_v)) < u_ref.shape[2]
    smask = kmask[:, None] & vmask[None, :]
    kidx, vidx = padded_ds(block_k), pl.ds(vt * block_v, block_v)
    state0 = pltr.load(pool_ref.at[read_ref[b], h, kidx, vidx], mask=smask, other=0.0)
    lane = jnp.arange(bt)

    def chunk(c, s0):  # s0 [block_k, block_v] f32: state at the chunk start
        tok0 = start + c * bt
        _, k, gcum, rmask = _load_chunk_qkg(k_ref, k_ref, g_ref, tok0, end - tok0,
                                            jax.lax.div(h, group), h, bt=bt, block_k=block_k,
                                            head_k_dim=head_k_dim)
        tidx, cid = pl.ds(tok0, bt), coff_ref[b] + c
        w = pltr.load(w_ref.at[tidx, h, kidx], mask=rmask[:, None] & kmask[None, :], other=0.0)
        tile = rmask[:, None] & vmask[None, :]
        vnew = (pltr.load(u_ref.at[tidx, h, vidx], mask=tile, other=0.0)
                - _dot(w, s0, precision=fast))
        pltr.store(vnew_ref.at[tidx, h, vidx], vnew, mask=tile)
        pltr.store(hs_ref.at[cid, h, kidx, vidx], s0, mask=smask)

        def state_after(r):  # state after the first r rows of the chunk (0..BT)
            g_r = jnp.sum(jnp.where(lane == r - 1, gcum, 0.0))
            wr = jnp.where(lane < r, jnp.exp(g_r - gcum), 0.0)
            return jnp.exp(g_r) * s0 + _dot(k, wr[:, None] * vnew, trans_a=True, precision=fast)

        def write_target(j, carry):
            slot = tslot_ref[j]

            @pl.when(slot > 0)
            def _write():
                pltr.store(pool_out.at[slot, h, kidx, vidx], state_after(trow_ref[j]),
                           mask=smask)

            return carry

        jax.lax.fori_loop(tstart_ref[cid], tstart_ref[cid + 1], write_target, 0)
        return state_after(bt)

    jax.lax.fori_loop(0, jax.lax.div(end - start + bt - 1, bt), chunk, state0)


def _output_kernel(cstart_ref,  # [NC] i32 first token of each chunk
                   clen_ref,    # [NC] i32 tokens in each chunk
                   q_ref,       # [T, Hk, Dk] raw q
                   k_ref,       # [T, Hk, Dk] raw k
                   g_ref,       # [T, Hv] f32 log-decay
                   vnew_ref,    # [T, Hv, Dv] f32 corrected values
                   hs_ref,      # [NC, Hv, Dk, Dv] f32 state at each chunk start
                   o_ref,       # [T, Hv, Dv] out (padding tokens left unwritten)
                   *, bt: int, head_k_dim: int, block_k: int, block_v: int, group: int, fast):
    c, h, vt = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    tok0, count = cstart_ref[c], clen_ref[c]
    q, k, gcum, rmask = _load_chunk_qkg(q_ref, k_ref, g_ref, tok0, count, jax.lax.div(h, group),
                                        h, bt=bt, block_k=block_k, head_k_dim=head_k_dim)
    kmask = jnp.arange(block_k) < head_k_dim
    vmask = (vt * block_v + jnp.arange(block_v)) < o_ref.shape[2]
    tidx, vidx = pl.ds(tok0, bt), pl.ds(vt * block_v, block_v)
    s0 = pltr.load(hs_ref.at[c, h, padded_ds(block_k), vidx],
                   mask=kmask[:, None] & vmask[None, :], other=0.0)
    tile = rmask[:, None] & vmask[None, :]
    vnew = pltr.load(vnew_ref.at[tidx, h, vidx], mask=tile, other=0.0)
    rows = jax.lax.broadcasted_iota(jnp.int32, (bt, bt), 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, (bt, bt), 1)
    decay = jnp.exp(jnp.where(rows >= cols, gcum[:, None] - gcum[None, :], -jnp.inf))
    o = (jnp.exp(gcum)[:, None] * _dot(q, s0, precision=fast)
         + _dot(decay * _dot(q, k, trans_b=True, precision=fast), vnew, precision=fast))
    pltr.store(o_ref.at[tidx, h, vidx], o.astype(o_ref.dtype), mask=tile)


def _extend_call(cu_seqlens, read_slot, chunk_off, cseq, tstart, trow, tslot, q, k, v, g, beta,
                 ssm_pool, *, chunk_size: int, interpret: bool):
    num_tokens, num_heads, dv = v.shape
    dk = q.shape[-1]
    num_chunks = cseq.shape[0]
    block_dv = pow2_at_least_16(dv)
    block_v = min(BLOCK_V, block_dv)
    fast = (_HIGHEST if interpret else F32_DOT) if v.dtype == _F32 else None
    common = dict(bt=chunk_size, head_k_dim=dk, block_k=pow2_at_least_16(dk),
                  group=num_heads // q.shape[1], fast=fast)
    params = pltr.CompilerParams(num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    inner = (jnp.arange(num_chunks, dtype=jnp.int32) - chunk_off[cseq]) * chunk_size
    cstart = cu_seqlens[cseq] + inner
    clen = jnp.where(jnp.arange(num_chunks) < chunk_off[-1],
                     jnp.clip(lens[cseq] - inner, 0, chunk_size), 0).astype(jnp.int32)
    sds = jax.ShapeDtypeStruct
    w, u = pl.pallas_call(
        functools.partial(_wu_kernel, block_dv=block_dv, **common),
        grid=(num_chunks, num_heads), interpret=interpret,
        compiler_params=pltr.CompilerParams(num_warps=WU_WARPS, num_stages=NUM_STAGES),
        out_shape=[sds((num_tokens, num_heads, dk), _F32), sds((num_tokens, num_heads, dv), _F32)],
    )(cstart, clen, q, k, v, g, beta)
    vnew, hs, ssm_pool = pl.pallas_call(
        functools.partial(_state_kernel, block_v=block_v, **common),
        grid=(read_slot.shape[0], num_heads, pl.cdiv(dv, block_v)), interpret=interpret,
        out_shape=[sds((num_tokens, num_heads, dv), _F32),
                   sds((num_chunks, num_heads, dk, dv), _F32),
                   sds(ssm_pool.shape, ssm_pool.dtype)],
        input_output_aliases={10: 2}, compiler_params=params,
    )(cu_seqlens, read_slot, chunk_off, tstart, trow, tslot, k, g, w, u, ssm_pool)
    o = pl.pallas_call(
        functools.partial(_output_kernel, block_v=block_v, **common),
        grid=(num_chunks, num_heads, pl.cdiv(dv, block_v)), interpret=interpret,
        out_shape=sds((num_tokens, num_heads, dv), v.dtype), compiler_params=params,
    )(cstart, clen, q, k, g, vnew, hs)
    return o, ssm_pool


@functools.partial(jax.jit, static_argnames=("chunk_size", "interpret"),
                   donate_argnames=("ssm_pool",))
def gated_delta_rule_extend(q, k, v, g, beta, ssm_pool, cu_seqlens, read_slot, write_slot,
                            snap_seq, snap_offset, snap_slot, *, chunk_size: int = 64,
                            interpret: bool = False):
    """Pallas Triton chunked prefill; the contract of ``gated_delta_rule_extend_reference``.

    q, k ``[T, Hk, Dk]`` raw; v ``[T, Hv, Dv]``; g, beta ``[T, Hv]``; ssm_pool ``[N, Hv, Dk, Dv]``
    f32 (donated, updated in place). ``chunk_size`` must be a power of two >= 16 here (Triton
    tiles). Returns ``(o [T, Hv, Dv] in v.dtype, ssm_pool)``; padding tokens give 0.
    """
    check_gdr(q, k, v, g, beta, ssm_pool, chunk_size)
    check(chunk_size >= SUB and chunk_size & (chunk_size - 1) == 0,
          f"chunk_size {chunk_size} must be a power of two >= {SUB} on GPU")
    num_tokens = v.shape[0]
    num_seqs = read_slot.shape[0]
    num_chunks = max_chunks(num_tokens, chunk_size, num_seqs)
    _, cseq, _, chunk_off = chunk_layout(cu_seqlens, num_tokens, chunk_size, num_chunks)
    ssm_pool, tstart, trow, tslot = extend_targets(
        ssm_pool, cu_seqlens, read_slot, write_slot, snap_seq, snap_offset, snap_slot,
        chunk_off, chunk_size, num_chunks)
    i32 = lambda a: jnp.asarray(a, jnp.int32)
    o, ssm_pool = _extend_call(
        i32(cu_seqlens), i32(read_slot), chunk_off, cseq, tstart, trow, tslot, q, k, v,
        g.astype(_F32), beta.astype(_F32), ssm_pool, chunk_size=chunk_size, interpret=interpret)
    _, valid = token_seq_ids(cu_seqlens, num_tokens)
    return jnp.where(valid[:, None, None], o, 0).astype(v.dtype), ssm_pool
