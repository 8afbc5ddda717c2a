"""Pallas Triton (GPU) kernel: chunked gated delta rule over ragged sequences, with snapshots.

Grid ``(B, Hv, Dv / BV)``: one program per (sequence, value head, value tile). It loads the
initial state tile ``[Dk, BV]`` of ``read_slot[b]`` from the pool, then walks the sequence's
chunks of ``BT`` tokens in a ``fori_loop`` (chunking restarts at the sequence start), carrying
the state in registers. Per chunk it applies the WY / UT form of ``docs/kernels.md`` in fp32
(``(I + L)^-1`` by blocked forward substitution with 16-row diagonal blocks) and writes the
states the targets table asks for (finals and snapshots, ``S_r`` at any row r) into the pool in
place (slot 0 skipped). Dk, Dv need not be powers of two: loads and stores are masked.
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
SUB = 16        # diagonal block of the blocked inverse (Triton's minimum dot size)
BLOCK_V = 64    # value-dim tile of the state held by one program
NUM_WARPS = 8   # untuned guess: the [Dk, BV] state + [BT, Dk] q, k stay live across the loop
NUM_STAGES = 1


def pow2_at_least_16(n: int) -> int:
    """The smallest power of two >= max(n, 16): a Triton tile that covers ``n``."""
    return max(16, 1 << (max(n, 1) - 1).bit_length())


def _dot(a, b, *, trans_a=False, trans_b=False):
    dims = (((0,) if trans_a else (1,)), ((1,) if trans_b else (0,)))
    return jax.lax.dot_general(a, b, (dims, ((), ())), precision=_HIGHEST,
                               preferred_element_type=_F32)


def _unit_lower_inverse(lower):
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


def _gdr_extend_kernel(cu_ref,      # [B+1] i32 packed sequence starts
                       read_ref,    # [B] i32 initial-state slot
                       coff_ref,    # [B+1] i32 first chunk of each sequence (targets CSR row)
                       tstart_ref,  # [NC+1] i32 targets CSR offsets per chunk
                       trow_ref,    # [J] i32 state after this many chunk rows (0..BT)
                       tslot_ref,   # [J] i32 destination slot (0 = dropped)
                       q_ref,       # [T, Hk, Dk] raw q
                       k_ref,       # [T, Hk, Dk] raw k
                       v_ref,       # [T, Hv, Dv]
                       g_ref,       # [T, Hv] f32 log-decay
                       beta_ref,    # [T, Hv] f32
                       pool_ref,    # [N, Hv, Dk, Dv] f32 initial states (alias of pool_out)
                       o_ref,       # [T, Hv, Dv] output (padding tokens left unwritten)
                       pool_out,    # [N, Hv, Dk, Dv] f32 finals and snapshots
                       *, chunk_size: int, head_k_dim: int, block_k: int, block_v: int,
                       group: int):
    b, h, vt = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    bt = chunk_size
    hk = jax.lax.div(h, group)
    start, end = cu_ref[b], cu_ref[b + 1]
    v0 = vt * block_v
    kmask = jnp.arange(block_k) < head_k_dim
    vmask = (v0 + jnp.arange(block_v)) < o_ref.shape[2]
    smask = kmask[:, None] & vmask[None, :]
    kidx, vidx = pl.ds(0, block_k), pl.ds(v0, block_v)
    state0 = pltr.load(pool_ref.at[read_ref[b], h, kidx, vidx], mask=smask, other=0.0)
    lane = jnp.arange(bt)
    rows = jax.lax.broadcasted_iota(jnp.int32, (bt, bt), 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, (bt, bt), 1)

    def chunk(c, s0):  # s0 [block_k, block_v] f32: state at the chunk start
        tok0 = start + c * bt
        rmask = (tok0 + lane) < end
        tidx = pl.ds(tok0, bt)
        qk_mask = rmask[:, None] & kmask[None, :]
        q = pltr.load(q_ref.at[tidx, hk, kidx], mask=qk_mask, other=0.0).astype(_F32)
        k = pltr.load(k_ref.at[tidx, hk, kidx], mask=qk_mask, other=0.0).astype(_F32)
        v = pltr.load(v_ref.at[tidx, h, vidx], mask=rmask[:, None] & vmask[None, :],
                    other=0.0).astype(_F32)
        g = pltr.load(g_ref.at[tidx, h], mask=rmask, other=0.0)
        beta = pltr.load(beta_ref.at[tidx, h], mask=rmask, other=0.0)
        q = q * jax.lax.rsqrt(jnp.sum(q * q, axis=1, keepdims=True) + 1e-6) * head_k_dim ** -0.5
        k = k * jax.lax.rsqrt(jnp.sum(k * k, axis=1, keepdims=True) + 1e-6)
        gcum = jnp.cumsum(g)                                           # [BT] G_i
        decay = jnp.exp(jnp.where(rows >= cols, gcum[:, None] - gcum[None, :], -jnp.inf))
        lower = jnp.where(rows > cols, beta[:, None] * decay * _dot(k, k, trans_b=True), 0.0)
        eg = jnp.exp(gcum)[:, None]
        u = _dot(_unit_lower_inverse(lower), beta[:, None] * (v - eg * _dot(k, s0)))
        o = eg * _dot(q, s0) + _dot(decay * _dot(q, k, trans_b=True), u)
        pltr.store(o_ref.at[tidx, h, vidx], o.astype(o_ref.dtype),
                 mask=rmask[:, None] & vmask[None, :])

        def state_after(r):  # state after the first r rows of the chunk (0..BT)
            g_r = jnp.sum(jnp.where(lane == r - 1, gcum, 0.0))
            w = jnp.where(lane < r, jnp.exp(g_r - gcum), 0.0)
            return jnp.exp(g_r) * s0 + _dot(k, w[:, None] * u, trans_a=True)

        def write_target(j, carry):
            slot = tslot_ref[j]

            @pl.when(slot > 0)
            def _write():
                pltr.store(pool_out.at[slot, h, kidx, vidx], state_after(trow_ref[j]),
                         mask=smask)

            return carry

        cid = coff_ref[b] + c
        jax.lax.fori_loop(tstart_ref[cid], tstart_ref[cid + 1], write_target, 0)
        return state_after(bt)

    jax.lax.fori_loop(0, jax.lax.div(end - start + bt - 1, bt), chunk, state0)


def _extend_call(cu_seqlens, read_slot, chunk_off, tstart, trow, tslot, q, k, v, g, beta,
                 ssm_pool, *, chunk_size: int, interpret: bool):
    num_tokens, num_heads, dv = v.shape
    dk = q.shape[-1]
    block_v = min(BLOCK_V, pow2_at_least_16(dv))
    kernel = functools.partial(
        _gdr_extend_kernel, chunk_size=chunk_size, head_k_dim=dk,
        block_k=pow2_at_least_16(dk), block_v=block_v, group=num_heads // q.shape[1])
    return pl.pallas_call(
        kernel, grid=(read_slot.shape[0], num_heads, pl.cdiv(dv, block_v)),
        out_shape=[jax.ShapeDtypeStruct((num_tokens, num_heads, dv), v.dtype),
                   jax.ShapeDtypeStruct(ssm_pool.shape, ssm_pool.dtype)],
        input_output_aliases={11: 1}, interpret=interpret,
        compiler_params=pltr.CompilerParams(num_warps=NUM_WARPS, num_stages=NUM_STAGES),
    )(cu_seqlens, read_slot, chunk_off, tstart, trow, tslot, q, k, v, g, beta, ssm_pool)


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
    _, _, _, chunk_off = chunk_layout(cu_seqlens, num_tokens, chunk_size, num_chunks)
    ssm_pool, tstart, trow, tslot = extend_targets(
        ssm_pool, cu_seqlens, read_slot, write_slot, snap_seq, snap_offset, snap_slot,
        chunk_off, chunk_size, num_chunks)
    i32 = lambda a: jnp.asarray(a, jnp.int32)
    o, ssm_pool = _extend_call(
        i32(cu_seqlens), i32(read_slot), chunk_off, tstart, trow, tslot, q, k, v,
        g.astype(_F32), beta.astype(_F32), ssm_pool, chunk_size=chunk_size, interpret=interpret)
    _, valid = token_seq_ids(cu_seqlens, num_tokens)
    return jnp.where(valid[:, None, None], o, 0).astype(v.dtype), ssm_pool
