"""TPU (Mosaic) chunked gated delta rule over ragged sequences: pool read/write + snapshots.

Same contract as ``reference.gated_delta_rule.gated_delta_rule_extend_reference`` (math in
``docs/kernels.md``). Layout (built by ``gated_delta_rule_extend``): every sequence is cut into
chunks of ``BT`` tokens that never span two sequences; chunk c of the padded chunk axis holds
tokens of one sequence (zero rows past its end, which leave the state unchanged). The grid is
``(Hv, NC / n)``: heads in parallel, steps of ``n = CHUNKS_PER_STEP`` chunks in order (NC is
padded to a multiple of n with empty chunks), the running state in VMEM scratch. A step first
does the n chunks' state-free work batched (norms, decay, ``K K^T``, the inverse, W and U), then
the sequential part chunk by chunk (a chunk that starts a sequence takes its initial state from
the pool), then writes the step's state targets.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._common import (
    check,
    chunk_layout,
    chunk_targets,
    max_chunks,
    state_targets,
    token_seq_ids,
)
from pallas_kernels.reference.gated_delta_rule import check_gdr
from pallas_kernels.tpu._targets import decayed_state_after

_F32 = jnp.float32


def _dot(a, b, *, trans_a=False, trans_b=False):
    dims = (((0,) if trans_a else (1,)), ((1,) if trans_b else (0,)))
    return jax.lax.dot_general(a, b, (dims, ((), ())), preferred_element_type=_F32)


def _l2norm(x):
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-6)


def _column(row, diagonal):
    """``[1, BT]`` -> ``[BT, 1]`` exactly (a select on the diagonal and a lane sum): the inputs
    stay lane-dense in HBM instead of 128x-padded ``[BT, 1]`` columns."""
    return jnp.sum(jnp.where(diagonal, row, 0.0), axis=-1, keepdims=True)


def _bdot(a, b, *, trans_a=False, trans_b=False):
    """Batched ``_dot`` over the leading (chunk) axis: ``[n, ., .] x [n, ., .]`` in f32."""
    dims = (((1,) if trans_a else (2,)), ((2,) if trans_b else (1,)))
    return jax.lax.dot_general(a, b, (dims, ((0,), (0,))), preferred_element_type=_F32)


def unit_lower_inverse(lower):
    """``(I + L)^-1`` for each strictly lower ``L`` of ``lower [n, BT, BT]`` (n even, BT a
    multiple of 8), blocked and recursive, every step a full-width MXU matmul:

    * the 8x8 diagonal blocks by doubling, ``(I + P)(I + P^2)(I + P^4)`` with ``P = -L`` on those
      blocks (``P^8 = 0``; entries of ``P^j`` stay within binomial(7, j), so no cancellation);
    * then blocks of b -> 2b: ``[[A, 0], [C, B]]^-1 = [[A^-1, 0], [-B^-1 C A^-1, B^-1]]``, i.e.
      ``M <- M - M C M`` with ``C`` the lower-left b-blocks of ``L`` inside each 2b-block and
      ``M`` block diagonal: two matmuls per level, ``log2(BT / 8)`` levels.
    10 dependent products at BT = 64 (was 63 dependent ``[1, BT]`` steps). The doubling over the
    whole ``BT`` cancels catastrophically when ``L`` has entries near 1 (correlated keys); this
    does not. Chunks go in pairs side by side in lanes (``[BT, 2 BT]``: 128 lanes at BT 64, so
    the elementwise work is on full vregs) and a pair's product is ``[X_a | X_b] @ diag(Y_a,
    Y_b) = [X_a Y_a | X_b Y_b]``: one K = 2 BT pass instead of two half-empty ones.
    """
    n, bt, _ = lower.shape
    pairs = lower.reshape(n // 2, 2, bt, bt)
    lower = jnp.concatenate([pairs[:, 0], pairs[:, 1]], axis=-1)          # [n/2, BT, 2 BT]
    rows = jax.lax.broadcasted_iota(jnp.int32, (bt, 2 * bt), 0)
    lanes = jax.lax.broadcasted_iota(jnp.int32, (bt, 2 * bt), 1)
    left = lanes < bt
    cols = jnp.where(left, lanes, lanes - bt)                              # column in its chunk
    div = jax.lax.div  # non-negative operands; ``//`` asks the default device for its TPU kind

    def mul(x, y):  # per chunk x @ y, both in pair layout
        diag = jnp.concatenate([jnp.where(left, y, 0.0), jnp.where(left, 0.0, y)], axis=1)
        return _bdot(x, diag)

    block = 8
    power = jnp.where(div(rows, block) == div(cols, block), -lower, 0.0)
    inv = jnp.where(rows == cols, 1.0, power)
    for _ in range(2):                     # (I + P)(I + P^2)(I + P^4) on the 8x8 blocks
        power = mul(power, power)
        inv = inv + mul(inv, power)
    while block < bt:
        pair = ((div(rows, 2 * block) == div(cols, 2 * block))
                & (div(rows, block) != div(cols, block)))
        inv = inv - mul(inv, mul(jnp.where(pair, lower, 0.0), inv))
        block *= 2
    return jnp.stack([inv[..., :bt], inv[..., bt:]], axis=1).reshape(n, bt, bt)


# Chunks of one head per grid step (even): their state-free work is batched, so that its
# independent products overlap on the MXUs; the per-step overhead is shared.
CHUNKS_PER_STEP = 8


def _chunks_free(q_raw, k_raw, v_raw, gr, beta_r, *, scale):
    """Everything of a step's n chunks that does not depend on their start states, batched.

    q_raw, k_raw ``[n, BT, Dk]`` and v_raw ``[n, BT, Dv]`` (input dtype); gr, beta_r
    ``[n, 1, BT]`` f32 rows. Returns ``(qe, k, w [n, BT, Dk], u0 [n, BT, Dv], attn [n, BT, BT],
    kw_t [n, Dk, BT], e_last [n, 1, 1])``: ``qe = exp(G) q``, ``w = (I + L)^-1 beta exp(G) k``,
    ``u0 = (I + L)^-1 beta v`` (the chunk writes ``u = u0 - w S0``), the decayed causal
    ``attn = M exp(G_i - G_j) q k^T``, ``kw_t = (exp(G_last - G) k)^T`` and ``exp(G_last)``
    (the chunk's end state is ``exp(G_last) S0 + kw_t u``).
    """
    bt, dk = k_raw.shape[1:]
    rows = jax.lax.broadcasted_iota(jnp.int32, (bt, bt), 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, (bt, bt), 1)
    q = _l2norm(q_raw.astype(_F32)) * scale
    k = _l2norm(k_raw.astype(_F32))
    gc = _column(gr, rows == cols)                                        # [n, BT, 1]
    beta = _column(beta_r, rows == cols)
    decay = jnp.exp(jnp.where(rows >= cols, gc - gr, -jnp.inf))           # exp(G_i - G_j)
    qk_k = _bdot(jnp.concatenate([q, k], axis=1), k, trans_b=True)        # [n, 2 BT, BT]
    inv = unit_lower_inverse(jnp.where(rows > cols, beta * decay * qk_k[:, bt:], 0.0))
    eg = jnp.exp(gc)
    wu = _bdot(inv, jnp.concatenate([beta * eg * k, beta * v_raw.astype(_F32)], axis=2))
    last = gr[..., bt - 1:]                                               # [n, 1, 1]
    kw_t = jnp.swapaxes(jnp.exp(last - gc) * k, 1, 2)
    return eg * q, k, wu[..., :dk], wu[..., dk:], decay * qk_k[:, :bt], kw_t, jnp.exp(last)


def _gdr_chunk_kernel(first_ref, read_ref, tstart_ref, trow_ref, tslot_ref,  # SMEM scalars
                      q_ref,      # [n, BT, Dk] raw q of n chunks (key head h // G)
                      k_ref,      # [n, BT, Dk] raw k
                      v_ref,      # [n, BT, Dv]
                      g_ref,      # [NC, BT] f32 in-chunk cumulative log-decay, all chunks
                      beta_ref,   # [NC, BT] f32 (lane-dense rows; chunk c's is row c)
                      pool_ref,   # [N, Hv, Dk, Dv] f32 HBM: initial states (alias of pool_out)
                      o_ref,      # [n, BT, Dv] output
                      pool_out,   # [N, Hv, Dk, Dv] f32 HBM: final states, snapshots
                      state_ref,  # [Dk, Dv] f32 scratch: state carried to the next step
                      s0_ref,     # [n, Dk, Dv] f32 scratch: each chunk's start state
                      k_scr,      # [n, BT, Dk] f32 scratch: normalised keys (for the targets)
                      u_scr,      # [n, BT, Dv] f32 scratch: the values each chunk writes
                      snap_ref,   # [Dk, Dv] f32 scratch: staging for DMA to the pool
                      sem,        # DMA semaphores [n]
                      *, fixed_order: bool):
    h, step = pl.program_id(0), pl.program_id(1)
    n, bt, dk = k_ref.shape
    c0 = step * n

    def initial_copy(j):
        return pltpu.make_async_copy(pool_ref.at[read_ref[c0 + j], h], s0_ref.at[j], sem.at[j])

    for j in range(n):  # start the reads of the sequences that begin in this step
        pl.when(first_ref[c0 + j] == 1)(lambda j=j: initial_copy(j).start())
    qe, k, w, u0, attn, kw_t, e_last = _chunks_free(
        q_ref[...], k_ref[...], v_ref[...], _step_rows(g_ref, c0, n), _step_rows(beta_ref, c0, n),
        scale=dk ** -0.5)
    for j in range(n):
        pl.when(first_ref[c0 + j] == 1)(lambda j=j: initial_copy(j).wait())

    state = state_ref[...]
    half = dk // 2
    for j in range(n):  # the sequential part: S0 -> u -> end state, two products per chunk
        s0 = jnp.where(first_ref[c0 + j] == 1, s0_ref[j], state)
        u = u0[j] - _dot(w[j], s0)
        o_ref[j] = (_dot(qe[j], s0) + _dot(attn[j], u)).astype(o_ref.dtype)
        s0_ref[j], k_scr[j], u_scr[j] = s0, k[j], u
        if fixed_order:  # [deterministic] the carry is the chunk-end target, bit for bit
            gr = g_ref[pl.ds(c0 + j, 1), :]
            state = _state_after(gr, s0, k[j], u, *_iotas(bt))(bt)
        else:  # kw_t u in two row halves: two MXUs, half the latency on the sequential path
            state = e_last[j] * s0 + jnp.concatenate(
                [_dot(kw_t[j][:half], u), _dot(kw_t[j][half:], u)], axis=0)
    state_ref[...] = state
    _write_targets(c0, n, bt, h, g_ref, tstart_ref, trow_ref, tslot_ref, s0_ref, k_scr, u_scr,
                   snap_ref, pool_ref, pool_out)


def _step_rows(table_ref, c0, n):
    """Rows ``c0 .. c0 + n - 1`` of a ``[NC, BT]`` table as ``[n, 1, BT]``."""
    return jnp.concatenate([table_ref[pl.ds(c0 + j, 1), :][None] for j in range(n)], axis=0)


def _iotas(bt):
    return (jax.lax.broadcasted_iota(jnp.int32, (bt, bt), 0),
            jax.lax.broadcasted_iota(jnp.int32, (bt, bt), 1))


def _state_after(gr, s0, k, u, rows, cols):
    """``r -> `` the state after ``r`` rows of a chunk (``decayed_state_after``; gr ``[1, BT]``
    its cumulative log-decay, rows, cols ``[BT, BT]`` iotas): the one formula of the targets
    (and, under ``fixed_order``, of the carry)."""
    return decayed_state_after(s0, k, u, _column(gr, rows == cols), gr, _dot)


def _write_targets(c0, n, bt, h, g_ref, tstart_ref, trow_ref, tslot_ref, s0_ref, k_scr, u_scr,
                   snap_ref, pool_ref, pool_out):
    """DMA the state after ``trow[t]`` rows of its chunk to ``pool_out[tslot[t], h]`` for every
    target ``t`` of this step's chunks ``c0 .. c0 + n - 1`` (slot 0: dropped), one loop for
    the step: its chunk ``j`` is found in the CSR starts, its inputs in the scratch buffers.
    The last step also copies the targets of empty sequences (past ``tstart[NC]``, row
    ``-(read slot + 1)``) from their read slot, pool to pool."""
    rows, cols = _iotas(bt)

    def write_target(t, carry):
        slot, row = tslot_ref[t], trow_ref[t]

        @pl.when((slot > 0) & (row >= 0))
        def _write():
            j = sum((t >= tstart_ref[c0 + i]).astype(jnp.int32) for i in range(1, n))
            gr = g_ref[pl.ds(c0 + j, 1), :]
            state_after = _state_after(gr, s0_ref[j], k_scr[j], u_scr[j], rows, cols)
            snap_ref[...] = state_after(row)
            pltpu.sync_copy(snap_ref, pool_out.at[slot, h])

        @pl.when((slot > 0) & (row < 0))
        def _copy():
            pltpu.sync_copy(pool_ref.at[-1 - row, h], pool_out.at[slot, h])

        return carry

    last = pl.program_id(1) == pl.num_programs(1) - 1
    end = jnp.where(last, trow_ref.shape[0], tstart_ref[c0 + n])
    jax.lax.fori_loop(tstart_ref[c0], end, write_target, 0)


def _targets(cu_seqlens, read_slot, write_slot, snap_seq, snap_offset, snap_slot, chunk_off,
             chunk_size: int, num_chunks: int):
    """The CSR target table of ``_common.chunk_targets`` (``tstart [NC+1]``, ``trow, tslot
    [B+S]``) with the targets of empty sequences last (past ``tstart[NC]``, they have no
    chunk) and their row ``-(read slot + 1)``: the kernel copies those itself, so no
    ``[B+S, Hv, Dk, Dv]`` gather and scatter of states runs in XLA before it."""
    t_seq, t_off, t_slot = state_targets(cu_seqlens, write_slot, snap_seq, snap_offset,
                                         snap_slot)
    empty = cu_seqlens[1:][t_seq] == cu_seqlens[:-1][t_seq]
    t_off = jnp.where(empty, -1 - read_slot[t_seq], t_off)
    return chunk_targets(cu_seqlens, chunk_off, t_seq, t_off, t_slot, chunk_size, num_chunks)


@functools.partial(jax.jit, static_argnames=("chunks_per_step", "interpret", "fixed_order"),
                   donate_argnames=("ssm_pool",))
def gdr_chunk_call(first, read, tstart, trow, tslot, q, k, v, gcum, beta, ssm_pool, *,
                   chunks_per_step: int = CHUNKS_PER_STEP, interpret: bool = False,
                   fixed_order: bool = False):
    """Run the kernel on chunked inputs. q, k ``[Hk, NC, BT, Dk]``; v ``[Hv, NC, BT, Dv]``;
    gcum, beta ``[Hv, NC, BT]`` f32 (one head's table stays in VMEM across its chunks);
    per-chunk ``first, read [NC]``; targets CSR ``tstart [NC+1]``, ``trow, tslot [J]``;
    NC a multiple of ``chunks_per_step``. Returns ``(o [Hv, NC, BT, Dv], pool)``."""
    num_heads, num_chunks, bt, dv = v.shape
    dk = q.shape[-1]
    group = num_heads // q.shape[0]
    n = chunks_per_step
    check(n % 2 == 0 and num_chunks % n == 0,
          f"chunks ({num_chunks}) must be a multiple of chunks_per_step ({n}, even)")
    sq = pl.Squeezed()

    def blk(last2, kv_head=False):
        if kv_head:
            return pl.BlockSpec((sq, n) + last2, lambda h, s, *_: (jax.lax.div(h, group), s, 0, 0))
        return pl.BlockSpec((sq, n) + last2, lambda h, s, *_: (h, s, 0, 0))

    table = pl.BlockSpec((sq, num_chunks, bt), lambda h, s, *_: (h, 0, 0))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=5, grid=(num_heads, num_chunks // n),
        in_specs=[blk((bt, dk), True), blk((bt, dk), True), blk((bt, dv)), table, table,
                  pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=[blk((bt, dv)), pl.BlockSpec(memory_space=pl.ANY)],
        scratch_shapes=[pltpu.VMEM((dk, dv), _F32), pltpu.VMEM((n, dk, dv), _F32),
                        pltpu.VMEM((n, bt, dk), _F32), pltpu.VMEM((n, bt, dv), _F32),
                        pltpu.VMEM((dk, dv), _F32), pltpu.SemaphoreType.DMA((n,))])
    return pl.pallas_call(
        functools.partial(_gdr_chunk_kernel, fixed_order=fixed_order), grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct((num_heads, num_chunks, bt, dv), v.dtype),
                   jax.ShapeDtypeStruct(ssm_pool.shape, ssm_pool.dtype)],
        input_output_aliases={5 + 5: 1}, interpret=interpret,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
    )(first, read, tstart, trow, tslot, q, k, v, gcum, beta, ssm_pool)


@functools.partial(jax.jit, static_argnames=("chunk_size", "chunks_per_step", "interpret",
                                             "fixed_order"),
                   donate_argnames=("ssm_pool",))
def gated_delta_rule_extend(q, k, v, g, beta, ssm_pool, cu_seqlens, read_slot, write_slot,
                            snap_seq, snap_offset, snap_slot, *, chunk_size: int = 64,
                            chunks_per_step: int = CHUNKS_PER_STEP, interpret: bool = False,
                            fixed_order: bool = False):
    """Pallas chunked prefill; same contract as the reference. Returns ``(o, ssm_pool)``.
    ``chunks_per_step`` (even): chunks of a head per grid step. [deterministic]
    ``fixed_order`` (``model.deterministic``): the state carried from a chunk to the next is
    computed by the targets' formula (``_state_after``), so a snapshot at a chunk's end holds
    the very bits the next chunk starts from (off: the faster split product)."""
    check_gdr(q, k, v, g, beta, ssm_pool, chunk_size)
    check(chunks_per_step > 0 and chunks_per_step % 2 == 0,
          f"chunks_per_step {chunks_per_step} must be a positive even number")
    num_tokens, num_heads, _ = v.shape
    num_seqs = read_slot.shape[0]
    n = chunks_per_step
    num_chunks = -(-max_chunks(num_tokens, chunk_size, num_seqs) // n) * n
    gather, cseq, first, chunk_off = chunk_layout(cu_seqlens, num_tokens, chunk_size,
                                                   num_chunks)
    tstart, trow, tslot = _targets(cu_seqlens, read_slot, write_slot, snap_seq, snap_offset,
                                   snap_slot, chunk_off, chunk_size, num_chunks)

    def chunked(x):  # [T, H, ...] -> [H, NC, BT, ...] with zero rows
        x = jnp.concatenate([x, jnp.zeros((1,) + x.shape[1:], x.dtype)])[gather]
        return jnp.moveaxis(x, 2, 0)

    gcum = jnp.cumsum(chunked(g.astype(jnp.float32)), axis=-1)           # [Hv, NC, BT]
    o_c, ssm_pool = gdr_chunk_call(
        first, read_slot[cseq], tstart, trow, tslot, chunked(q), chunked(k), chunked(v),
        gcum, chunked(beta.astype(jnp.float32)), ssm_pool, chunks_per_step=n,
        interpret=interpret, fixed_order=fixed_order)
    seq, valid = token_seq_ids(cu_seqlens, num_tokens)
    local = jnp.arange(num_tokens) - cu_seqlens[seq]
    o = o_c[:, chunk_off[seq] + local // chunk_size, local % chunk_size]   # [Hv, T, Dv]
    o = jnp.where(valid[None, :, None], o, 0).astype(v.dtype)
    return jnp.moveaxis(o, 0, 1), ssm_pool
