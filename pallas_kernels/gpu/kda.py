"""Pallas Triton (GPU) KDA chunked prefill over ragged sequences with snapshots at any offset
(decode: ``gpu/kda_decode.py``).

Same contracts as ``reference.kda``. Prefill is fla's chunk_kda split (the house pattern of
``gpu/gated_delta_rule.py``) into four launches, so that only the state recurrence is
sequential:

1. ``_chunk_kernel``, grid ``(NC, H)`` (parallel), once per (chunk, head): ``A[i, j] = beta_i
   sum_c k_i k_j exp(G_i - G_j)`` (j < i) by ``kda_chunk.decayed_gram`` (sub-chunks of 16 rows:
   never an ``exp`` of a positive difference), ``X = (I + A)^-1`` (blocked), ``W = X (beta e^G
   k)``, ``U = X (beta v)`` and the state update's keys ``k exp(G_last - G)``.
2. ``_scores_kernel``, grid ``(NC, H)`` (parallel): ``M[i, j] = sum_c q_i k_j exp(G_i - G_j)``
   (j <= i), same factorisation.
3. ``_state_kernel``, grid ``(B, H, Dv / BVS)``: walks a sequence's chunks carrying the state
   tile ``S [Dk, BVS]`` f32: ``V' = U - W S``, records ``S`` at every chunk start, writes the
   states the CSR targets table asks for (finals and snapshots after any row r:
   ``S_r = diag(e^{G_r}) S + (k exp(G_r - G))^T V'`` over rows < r) into the pool in place;
   the carry ``S_last`` takes the chunk kernel's keys (no exp, no k or G tile here).
4. ``_output_kernel``, grid ``(NC, H, Dv / BV)`` (parallel): ``o = (q e^G) S + M V'``.

Operand precision (f32 accumulation everywhere, the carried state f32): ``A`` and the inverse
are IEEE fp32 dots (the inverse amplifies rounding). W, U and the state products run on tensor
cores as 3-pass tf32 (``F32_DOT``, about fp32: a 1-pass tf32 W / U puts ~5e-4 into the states);
M and the output products too for f32 inputs, 1-pass tf32 (``TF32_DOT``, ~2^-11 relative: ~2e-4
on o, under a bf16 ulp) for bf16 / f16 inputs. Interpreted (CPU) every product is exact fp32.
The in-chunk cumulative decays ``[T, H, Dk]`` are summed by the wrapper per (sequence, chunk);
rows past a sequence end take the chunk's last valid ``G`` (its minimum), never 0. Dk, Dv need
not be powers of two: loads and stores are masked (padded key channels carry zero q, k, decay).
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
    chunk_spans,
    extend_targets,
    max_chunks,
    token_seq_ids,
)
from pallas_kernels.gpu.gated_delta_rule import (
    padded_ds,
    pow2_at_least_16,
    unit_lower_inverse,
)
from pallas_kernels.kda_chunk import SUB, decayed_gram
from pallas_kernels.reference.kda import check_kda

_F32 = jnp.float32
_HIGHEST = (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST)
TF32_DOT = None  # one tf32 pass (fp32 operands) on GPU tensor cores: ~2^-11 relative
F32_DOT = jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3  # three tf32 passes: about fp32
BLOCK_V = 64          # value tile of the output kernel
BLOCK_V_STATE = 32    # value tile of the state pass (64: 39 spills in fp32; 32: none)
NUM_WARPS = 8


def _dot(a, b, precision, *, trans_a=False, trans_b=False):
    dims = (((0,) if trans_a else (1,)), ((1,) if trans_b else (0,)))
    return jax.lax.dot_general(a, b, (dims, ((), ())), precision=precision,
                               preferred_element_type=_F32)


def _l2norm_rows(x):
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-6)


def _load_rows(ref, tok0, count, h, *, bt, block, width):
    """Rows ``[tok0, tok0 + BT)`` of ``ref [T, H, width]`` at head h as ``[BT, block]`` f32,
    zero past ``count`` rows and ``width`` columns."""
    mask = (jnp.arange(bt) < count)[:, None] & (jnp.arange(block) < width)[None, :]
    return pltr.load(ref.at[pl.ds(tok0, bt), h, padded_ds(block)], mask=mask,
                     other=0.0).astype(_F32)


def _load_kg(k_ref, g_ref, tok0, count, h, *, bt, block_k, head_k_dim):
    """L2-normalised k and the in-chunk cumulative log-decay G ``[BT, block_k]`` f32; rows past
    ``count`` are zero in k and carry the last valid row's G (its minimum, since G only falls:
    a 0 there would overflow ``exp(G_i - G_j)`` against a strongly decayed row j)."""
    kw = dict(bt=bt, block=block_k, width=head_k_dim)
    k = _l2norm_rows(_load_rows(k_ref, tok0, count, h, **kw))
    g = _load_rows(g_ref, tok0, count, h, **kw)
    rmask = (jnp.arange(bt) < count)[:, None]
    return k, jnp.where(rmask, g, jnp.min(g, axis=0, keepdims=True))


def _chunk_kernel(cstart_ref,  # [NC] i32 first token of each chunk
                  clen_ref,    # [NC] i32 tokens in each chunk (0 for unused chunks)
                  k_ref,       # [T, H, Dk] raw k
                  v_ref,       # [T, H, Dv]
                  g_ref,       # [T, H, Dk] f32 in-chunk cumulative log-decay
                  beta_ref,    # [T, H] f32
                  w_ref,       # [T, H, Dk] f32 out: W = X (beta e^G k)
                  u_ref,       # [T, H, Dv] f32 out: U = X (beta v)
                  kd_ref,      # [T, H, Dk] f32 out: k exp(G_last - G), the state update's keys
                  *, bt: int, head_k_dim: int, block_k: int, block_dv: int, exact):
    c, h = pl.program_id(0), pl.program_id(1)
    tok0, count = cstart_ref[c], clen_ref[c]
    k, gcum = _load_kg(k_ref, g_ref, tok0, count, h, bt=bt, block_k=block_k,
                       head_k_dim=head_k_dim)
    rmask = jnp.arange(bt) < count
    tidx = pl.ds(tok0, bt)
    beta = pltr.load(beta_ref.at[tidx, h], mask=rmask, other=0.0)[:, None]
    inv = unit_lower_inverse(
        beta * decayed_gram(k, k, gcum, inclusive=False, precision=_HIGHEST))
    kmask = jnp.arange(block_k) < head_k_dim
    pltr.store(w_ref.at[tidx, h, padded_ds(block_k)], _dot(inv, beta * jnp.exp(gcum) * k, exact),
               mask=rmask[:, None] & kmask[None, :])
    g_last = jnp.min(gcum, axis=0, keepdims=True)  # the last valid row's G (G only falls)
    pltr.store(kd_ref.at[tidx, h, padded_ds(block_k)], k * jnp.exp(g_last - gcum),
               mask=rmask[:, None] & kmask[None, :])
    v = _load_rows(v_ref, tok0, count, h, bt=bt, block=block_dv, width=v_ref.shape[2])
    vmask = jnp.arange(block_dv) < v_ref.shape[2]
    pltr.store(u_ref.at[tidx, h, padded_ds(block_dv)], _dot(inv, beta * v, exact),
               mask=rmask[:, None] & vmask[None, :])


def _scores_kernel(cstart_ref,  # [NC] i32 first token of each chunk
                   clen_ref,    # [NC] i32 tokens in each chunk (0 for unused chunks)
                   q_ref,       # [T, H, Dk] raw q
                   k_ref,       # [T, H, Dk] raw k
                   g_ref,       # [T, H, Dk] f32 in-chunk cumulative log-decay
                   m_ref,       # [T, H, BT] f32 out: M, row i of the chunk at token i
                   *, bt: int, head_k_dim: int, block_k: int, fast):
    c, h = pl.program_id(0), pl.program_id(1)
    tok0, count = cstart_ref[c], clen_ref[c]
    k, gcum = _load_kg(k_ref, g_ref, tok0, count, h, bt=bt, block_k=block_k,
                       head_k_dim=head_k_dim)
    q = _l2norm_rows(_load_rows(q_ref, tok0, count, h, bt=bt, block=block_k,
                                width=head_k_dim)) * head_k_dim ** -0.5
    pltr.store(m_ref.at[pl.ds(tok0, bt), h, pl.ds(0, bt)],
               decayed_gram(q, k, gcum, inclusive=True, precision=fast),
               mask=(jnp.arange(bt) < count)[:, None])


def _state_kernel(cu_ref,      # [B+1] i32 packed sequence starts
                  read_ref,    # [B] i32 initial-state slot
                  coff_ref,    # [B+1] i32 first chunk of each sequence (targets CSR row)
                  tstart_ref,  # [NC+1] i32 targets CSR offsets per chunk
                  trow_ref,    # [J] i32 state after this many chunk rows (0..BT)
                  tslot_ref,   # [J] i32 destination slot (0 = dropped)
                  k_ref,       # [T, H, Dk] raw k
                  g_ref,       # [T, H, Dk] f32 in-chunk cumulative log-decay
                  w_ref,       # [T, H, Dk] f32
                  u_ref,       # [T, H, Dv] f32
                  kd_ref,      # [T, H, Dk] f32 k exp(G_last - G)
                  pool_ref,    # [N, H, Dk, Dv] f32 initial states (alias of pool_out)
                  vnew_ref,    # [T, H, Dv] f32 out: V' = U - W S
                  hs_ref,      # [NC, H, Dk, Dv] f32 out: state at each chunk start
                  pool_out,    # [N, H, Dk, Dv] f32 finals and snapshots
                  *, bt: int, head_k_dim: int, block_k: int, block_v: int, exact,
                  fixed_order: bool):
    b, h, vt = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    start, end = cu_ref[b], cu_ref[b + 1]
    kmask = jnp.arange(block_k) < head_k_dim
    vmask = (vt * block_v + jnp.arange(block_v)) < u_ref.shape[2]
    smask = kmask[:, None] & vmask[None, :]
    kidx, vidx = padded_ds(block_k), pl.ds(vt * block_v, block_v)
    state0 = pltr.load(pool_ref.at[read_ref[b], h, kidx, vidx], mask=smask, other=0.0)
    lane = jnp.arange(bt)[:, None]

    def chunk(c, s0):  # s0 [block_k, block_v] f32: state at the chunk start
        tok0 = start + c * bt
        count = jnp.minimum(end - tok0, bt)
        tidx, cid = pl.ds(tok0, bt), coff_ref[b] + c
        tile = (lane < count) & vmask[None, :]
        w = pltr.load(w_ref.at[tidx, h, kidx], mask=(lane < count) & kmask[None, :], other=0.0)
        vnew = pltr.load(u_ref.at[tidx, h, vidx], mask=tile, other=0.0) - _dot(w, s0, exact)
        pltr.store(vnew_ref.at[tidx, h, vidx], vnew, mask=tile)
        pltr.store(hs_ref.at[cid, h, kidx, vidx], s0, mask=smask)

        def g_row(r):  # G after r rows (1..count) as [block_k]
            return pltr.load(g_ref.at[tok0 + r - 1, h, kidx], mask=kmask, other=0.0)

        def state_after(r):  # rows past count add nothing: clamp r to a valid G row
            r = jnp.minimum(r, count)
            k, gcum = _load_kg(k_ref, g_ref, tok0, count, h, bt=bt, block_k=block_k,
                               head_k_dim=head_k_dim)
            g_r = jnp.where(r > 0, g_row(jnp.maximum(r, 1)), 0.0)
            before = lane < r
            kw = jnp.where(before, k * jnp.exp(jnp.where(before, g_r[None, :] - gcum, 0.0)),
                           0.0)
            return jnp.exp(g_r)[:, None] * s0 + _dot(kw, vnew, exact, trans_a=True)

        def write_target(j, carry):
            slot = tslot_ref[j]

            @pl.when(slot > 0)
            def _write():
                pltr.store(pool_out.at[slot, h, kidx, vidx], state_after(trow_ref[j]),
                           mask=smask)

            return carry

        jax.lax.fori_loop(tstart_ref[cid], tstart_ref[cid + 1], write_target, 0)
        if fixed_order:  # [deterministic] the carry is the chunk-end target, bit for bit
            return state_after(bt)
        kd = pltr.load(kd_ref.at[tidx, h, kidx], mask=(lane < count) & kmask[None, :],
                       other=0.0)
        return jnp.exp(g_row(count))[:, None] * s0 + _dot(kd, vnew, exact, trans_a=True)

    jax.lax.fori_loop(0, jax.lax.div(end - start + bt - 1, bt), chunk, state0)


def _output_kernel(cstart_ref,  # [NC] i32 first token of each chunk
                   clen_ref,    # [NC] i32 tokens in each chunk
                   q_ref,       # [T, H, Dk] raw q
                   g_ref,       # [T, H, Dk] f32 in-chunk cumulative log-decay
                   m_ref,       # [T, H, BT] f32 intra-chunk scores M
                   vnew_ref,    # [T, H, Dv] f32 corrected values V'
                   hs_ref,      # [NC, H, Dk, Dv] f32 state at each chunk start
                   o_ref,       # [T, H, Dv] out (padding tokens left unwritten)
                   *, bt: int, head_k_dim: int, block_k: int, block_v: int, fast):
    c, h, vt = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    tok0, count = cstart_ref[c], clen_ref[c]
    kw = dict(bt=bt, block=block_k, width=head_k_dim)
    q = _l2norm_rows(_load_rows(q_ref, tok0, count, h, **kw)) * head_k_dim ** -0.5
    qg = q * jnp.exp(_load_rows(g_ref, tok0, count, h, **kw))  # padded rows: q = 0
    kmask = jnp.arange(block_k) < head_k_dim
    vmask = (vt * block_v + jnp.arange(block_v)) < o_ref.shape[2]
    tidx, vidx = pl.ds(tok0, bt), pl.ds(vt * block_v, block_v)
    s0 = pltr.load(hs_ref.at[c, h, padded_ds(block_k), vidx],
                   mask=kmask[:, None] & vmask[None, :], other=0.0)
    tile = (jnp.arange(bt) < count)[:, None] & vmask[None, :]
    vnew = pltr.load(vnew_ref.at[tidx, h, vidx], mask=tile, other=0.0)
    m = _load_rows(m_ref, tok0, count, h, bt=bt, block=bt, width=bt)
    o = _dot(qg, s0, fast) + _dot(m, vnew, fast)
    pltr.store(o_ref.at[tidx, h, vidx], o.astype(o_ref.dtype), mask=tile)


def _chunk_cumsum(g, cu_seqlens, chunk_size: int, num_chunks: int):
    """``g [T, H, Dk]`` -> the cumulative sum within each (sequence, chunk) segment, f32."""
    num_tokens = g.shape[0]
    gather, _, _, chunk_off = chunk_layout(cu_seqlens, num_tokens, chunk_size, num_chunks)
    gc = jnp.concatenate([g.astype(_F32), jnp.zeros((1,) + g.shape[1:], _F32)])[gather]
    gc = jnp.cumsum(gc, axis=1)                                          # [NC, BT, H, Dk]
    seq, _ = token_seq_ids(cu_seqlens, num_tokens)
    local = jnp.arange(num_tokens) - cu_seqlens[seq]
    return gc[chunk_off[seq] + local // chunk_size, local % chunk_size], chunk_off


def _extend_call(cu_seqlens, read_slot, chunk_off, tstart, trow, tslot, q, k, v, gcum, beta,
                 ssm_pool, *, chunk_size: int, interpret: bool, fixed_order: bool):
    num_tokens, num_heads, dv = v.shape
    dk = q.shape[-1]
    num_chunks = tstart.shape[0] - 1
    block_dv = pow2_at_least_16(dv)
    block_v, block_vs = min(BLOCK_V, block_dv), min(BLOCK_V_STATE, block_dv)
    common = dict(bt=chunk_size, head_k_dim=dk, block_k=pow2_at_least_16(dk))
    exact = _HIGHEST if interpret else F32_DOT  # the CPU has no tf32 passes
    fast = exact if v.dtype == _F32 else TF32_DOT
    seq, loc, clen = chunk_spans(cu_seqlens, num_tokens, chunk_size, num_chunks)
    cstart = (cu_seqlens[seq] + loc).astype(jnp.int32)
    sds = jax.ShapeDtypeStruct
    params = pltr.CompilerParams(num_warps=NUM_WARPS, num_stages=1)
    w, u, kd = pl.pallas_call(
        functools.partial(_chunk_kernel, block_dv=block_dv, exact=exact, **common),
        grid=(num_chunks, num_heads), interpret=interpret, compiler_params=params,
        out_shape=[sds((num_tokens, num_heads, dk), _F32), sds((num_tokens, num_heads, dv), _F32),
                   sds((num_tokens, num_heads, dk), _F32)],
    )(cstart, clen, k, v, gcum, beta)
    m = pl.pallas_call(
        functools.partial(_scores_kernel, fast=fast, **common),
        grid=(num_chunks, num_heads), interpret=interpret, compiler_params=params,
        out_shape=sds((num_tokens, num_heads, chunk_size), _F32),
    )(cstart, clen, q, k, gcum)
    vnew, hs, ssm_pool = pl.pallas_call(
        functools.partial(_state_kernel, block_v=block_vs, exact=exact, fixed_order=fixed_order,
                          **common),
        grid=(read_slot.shape[0], num_heads, pl.cdiv(dv, block_vs)), interpret=interpret,
        out_shape=[sds((num_tokens, num_heads, dv), _F32),
                   sds((num_chunks, num_heads, dk, dv), _F32),
                   sds(ssm_pool.shape, ssm_pool.dtype)],
        input_output_aliases={11: 2}, compiler_params=params,
    )(cu_seqlens, read_slot, chunk_off, tstart, trow, tslot, k, gcum, w, u, kd, ssm_pool)
    o = pl.pallas_call(
        functools.partial(_output_kernel, block_v=block_v, fast=fast, **common),
        grid=(num_chunks, num_heads, pl.cdiv(dv, block_v)), interpret=interpret,
        out_shape=sds((num_tokens, num_heads, dv), v.dtype), compiler_params=params,
    )(cstart, clen, q, gcum, m, vnew, hs)
    return o, ssm_pool


@functools.partial(jax.jit, static_argnames=("chunk_size", "interpret", "fixed_order"),
                   donate_argnames=("ssm_pool",))
def kda_extend(q, k, v, g, beta, ssm_pool, cu_seqlens, read_slot, write_slot, snap_seq,
               snap_offset, snap_slot, *, chunk_size: int = 32, interpret: bool = False,
               fixed_order: bool = False):
    """Pallas Triton chunked KDA prefill; the contract of ``kda_extend_reference``
    (``chunk_size`` a power of two >= 16). q, k ``[T, H, Dk]`` raw, v ``[T, H, Dv]``, g
    ``[T, H, Dk]`` log-decay, beta ``[T, H]``, ssm_pool ``[N, H, Dk, Dv]`` f32 (donated).
    Returns ``(o [T, H, Dv] in v.dtype, ssm_pool)``; padding tokens give 0. [deterministic]
    ``fixed_order``: the state carried to the next chunk is the targets' ``state_after(BT)``,
    so a snapshot at a chunk's end holds the bits the next chunk starts from (off: the chunk
    kernel's ``k exp(G_last - G)`` keys)."""
    check_kda(q, k, v, g, beta, ssm_pool)
    check(chunk_size >= SUB and chunk_size & (chunk_size - 1) == 0,
          f"chunk_size {chunk_size} must be a power of two >= {SUB} on GPU")
    num_tokens = v.shape[0]
    num_chunks = max_chunks(num_tokens, chunk_size, read_slot.shape[0])
    gcum, chunk_off = _chunk_cumsum(g, cu_seqlens, chunk_size, num_chunks)
    ssm_pool, tstart, trow, tslot = extend_targets(
        ssm_pool, cu_seqlens, read_slot, write_slot, snap_seq, snap_offset, snap_slot,
        chunk_off, chunk_size, num_chunks)
    i32 = lambda a: jnp.asarray(a, jnp.int32)
    o, ssm_pool = _extend_call(i32(cu_seqlens), i32(read_slot), chunk_off, tstart, trow, tslot,
                               q, k, v, gcum, beta.astype(_F32), ssm_pool,
                               chunk_size=chunk_size, interpret=interpret,
                               fixed_order=fixed_order)
    _, valid = token_seq_ids(cu_seqlens, num_tokens)
    return jnp.where(valid[:, None, None], o, 0).astype(v.dtype), ssm_pool
