"""TPU (Mosaic) chunked gated delta rule over ragged sequences: pool read/write + snapshots.

Same contract as ``reference.gated_delta_rule.gated_delta_rule_extend_reference`` (math in
``docs/kernels.md``). Layout (built by ``gated_delta_rule_extend``): every sequence is cut into
chunks of ``BT`` tokens that never span two sequences; chunk c of the padded chunk axis holds
tokens of one sequence (zero rows past its end, which leave the state unchanged). The grid is
``(Hv, NC)``: heads in parallel, chunks in order, the running state in VMEM scratch.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._common import chunk_layout, extend_targets, max_chunks, token_seq_ids
from pallas_kernels.reference.gated_delta_rule import check_gdr
from pallas_kernels.tpu._targets import decayed_state_after, write_state_targets

_F32 = jnp.float32


def _dot(a, b, *, trans_a=False, trans_b=False):
    dims = (((0,) if trans_a else (1,)), ((1,) if trans_b else (0,)))
    return jax.lax.dot_general(a, b, (dims, ((), ())), preferred_element_type=_F32)


def _l2norm(x):
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-6)


def _column(row, diagonal):
    """``[1, BT]`` -> ``[BT, 1]`` exactly (a select on the diagonal and a lane sum): the inputs
    stay lane-dense in HBM instead of 128x-padded ``[BT, 1]`` columns."""
    return jnp.sum(jnp.where(diagonal, row, 0.0), axis=1, keepdims=True)


def _unit_lower_inverse(lower):
    """``(I + L)^-1`` for strictly lower ``L [BT, BT]`` (BT a multiple of 8), blocked and
    recursive, every step a full-width MXU matmul (no chain of one-row steps):

    * the 8x8 diagonal blocks by doubling, ``(I + P)(I + P^2)(I + P^4)`` with ``P = -L`` on those
      blocks (``P^8 = 0``; entries of ``P^j`` stay within binomial(7, j), so no cancellation);
    * then blocks of b -> 2b: ``[[A, 0], [C, B]]^-1 = [[A^-1, 0], [-B^-1 C A^-1, B^-1]]``, i.e.
      ``M <- M - M C M`` with ``C`` the lower-left b-blocks of ``L`` inside each 2b-block and
      ``M`` block diagonal: two matmuls per level, ``log2(BT / 8)`` levels.
    10 matmuls at BT = 64 (was 63 dependent ``[1, BT]`` steps). The doubling over the whole
    ``BT`` cancels catastrophically when ``L`` has entries near 1 (correlated keys); this does not.
    """
    bt = lower.shape[0]
    rows = jax.lax.broadcasted_iota(jnp.int32, (bt, bt), 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, (bt, bt), 1)
    div = jax.lax.div  # non-negative operands; ``//`` asks the default device for its TPU kind
    block = 8
    power = jnp.where(div(rows, block) == div(cols, block), -lower, 0.0)
    inv = jnp.where(rows == cols, 1.0, power)
    for _ in range(2):                     # (I + P)(I + P^2)(I + P^4) on the 8x8 blocks
        power = _dot(power, power)
        inv = inv + _dot(inv, power)
    while block < bt:
        pair = ((div(rows, 2 * block) == div(cols, 2 * block))
                & (div(rows, block) != div(cols, block)))
        inv = inv - _dot(inv, _dot(jnp.where(pair, lower, 0.0), inv))
        block *= 2
    return inv


def _gdr_chunk_kernel(first_ref, read_ref, tstart_ref, trow_ref, tslot_ref,  # SMEM scalars
                      q_ref,      # [BT, Dk] raw q of this chunk (key head h // G)
                      k_ref,      # [BT, Dk] raw k
                      v_ref,      # [BT, Dv]
                      g_ref,      # [NC, BT] f32 in-chunk cumulative log-decay, all chunks
                      beta_ref,   # [NC, BT] f32 (lane-dense rows; this chunk's is row c)
                      pool_ref,   # [N, Hv, Dk, Dv] f32 HBM: initial states (alias of pool_out)
                      o_ref,      # [BT, Dv] output
                      pool_out,   # [N, Hv, Dk, Dv] f32 HBM: final states, snapshots
                      state_ref,  # [Dk, Dv] f32 scratch: state at this chunk's start
                      snap_ref):  # [Dk, Dv] f32 scratch: staging for DMA to the pool
    h, c = pl.program_id(0), pl.program_id(1)
    bt, dk = k_ref.shape

    @pl.when(first_ref[c] == 1)
    def _load_initial():
        pltpu.sync_copy(pool_ref.at[read_ref[c], h], state_ref)

    q = _l2norm(q_ref[...].astype(_F32)) * (dk ** -0.5)
    k = _l2norm(k_ref[...].astype(_F32))
    v = v_ref[...].astype(_F32)
    rows = jax.lax.broadcasted_iota(jnp.int32, (bt, bt), 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, (bt, bt), 1)
    gr, beta_r = g_ref[pl.ds(c, 1), :], beta_ref[pl.ds(c, 1), :]          # [1, BT] rows
    gc = _column(gr, rows == cols)                                       # [BT, 1] columns
    beta = _column(beta_r, rows == cols)
    decay = jnp.exp(jnp.where(rows >= cols, gc - gr, -jnp.inf))          # exp(G_i - G_j), j<=i
    s0 = state_ref[...]
    qk = jnp.concatenate([q, k], axis=0)                                 # [2 BT, Dk]: one MXU
    qk_k = _dot(qk, k, trans_b=True)                                     # pass per shared rhs
    qk_s0 = _dot(qk, s0)
    lower = jnp.where(rows > cols, beta * decay * qk_k[bt:], 0.0)
    inv = _unit_lower_inverse(lower)
    # U = (I + L)^-1 beta (V - exp(G) K S0): the corrected values written by each token.
    u = _dot(inv, beta * (v - jnp.exp(gc) * qk_s0[bt:]))
    attn = decay * qk_k[:bt]
    o_ref[...] = (jnp.exp(gc) * qk_s0[:bt] + _dot(attn, u)).astype(o_ref.dtype)

    write_state_targets(decayed_state_after(s0, k, u, gc, gr, _dot), h=h, c=c, bt=bt,
                        tstart_ref=tstart_ref, trow_ref=trow_ref, tslot_ref=tslot_ref,
                        snap_ref=snap_ref, pool_out=pool_out, state_ref=state_ref)


@functools.partial(jax.jit, static_argnames=("interpret",), donate_argnames=("ssm_pool",))
def gdr_chunk_call(first, read, tstart, trow, tslot, q, k, v, gcum, beta, ssm_pool, *,
                   interpret: bool = False):
    """Run the kernel on chunked inputs. q, k ``[Hk, NC, BT, Dk]``; v ``[Hv, NC, BT, Dv]``;
    gcum, beta ``[Hv, NC, BT]`` f32 (one head's table stays in VMEM across its chunks);
    per-chunk ``first, read [NC]``;
    targets CSR ``tstart [NC+1]``, ``trow, tslot [J]``. Returns ``(o [Hv, NC, BT, Dv], pool)``."""
    num_heads, num_chunks, bt, dv = v.shape
    dk = q.shape[-1]
    group = num_heads // q.shape[0]
    sq = pl.Squeezed()

    def blk(last2, kv_head=False):
        if kv_head:
            return pl.BlockSpec((sq, sq) + last2, lambda h, c, *_: (jax.lax.div(h, group), c, 0, 0))
        return pl.BlockSpec((sq, sq) + last2, lambda h, c, *_: (h, c, 0, 0))

    table = pl.BlockSpec((sq, num_chunks, bt), lambda h, c, *_: (h, 0, 0))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=5, grid=(num_heads, num_chunks),
        in_specs=[blk((bt, dk), True), blk((bt, dk), True), blk((bt, dv)), table, table,
                  pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=[blk((bt, dv)), pl.BlockSpec(memory_space=pl.ANY)],
        scratch_shapes=[pltpu.VMEM((dk, dv), _F32), pltpu.VMEM((dk, dv), _F32)])
    return pl.pallas_call(
        _gdr_chunk_kernel, grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct((num_heads, num_chunks, bt, dv), v.dtype),
                   jax.ShapeDtypeStruct(ssm_pool.shape, ssm_pool.dtype)],
        input_output_aliases={5 + 5: 1}, interpret=interpret,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
    )(first, read, tstart, trow, tslot, q, k, v, gcum, beta, ssm_pool)


@functools.partial(jax.jit, static_argnames=("chunk_size", "interpret"),
                   donate_argnames=("ssm_pool",))
def gated_delta_rule_extend(q, k, v, g, beta, ssm_pool, cu_seqlens, read_slot, write_slot,
                            snap_seq, snap_offset, snap_slot, *, chunk_size: int = 64,
                            interpret: bool = False):
    """Pallas chunked prefill; same contract as the reference. Returns ``(o, ssm_pool)``."""
    check_gdr(q, k, v, g, beta, ssm_pool, chunk_size)
    num_tokens, num_heads, _ = v.shape
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

    gcum = jnp.cumsum(chunked(g.astype(jnp.float32)), axis=-1)           # [Hv, NC, BT]
    o_c, ssm_pool = gdr_chunk_call(
        first, read_slot[cseq], tstart, trow, tslot, chunked(q), chunked(k), chunked(v),
        gcum, chunked(beta.astype(jnp.float32)), ssm_pool, interpret=interpret)
    seq, valid = token_seq_ids(cu_seqlens, num_tokens)
    local = jnp.arange(num_tokens) - cu_seqlens[seq]
    o = o_c[:, chunk_off[seq] + local // chunk_size, local % chunk_size]   # [Hv, T, Dv]
    o = jnp.where(valid[None, :, None], o, 0).astype(v.dtype)
    return jnp.moveaxis(o, 0, 1), ssm_pool
