"""TPU (Mosaic) kernel: gated delta rule recurrent decode (one token per sequence), pool in place.

Grid ``(B,)`` ("arbitrary": the DMAs cross steps): each step waits for the ``[Hv, Dk, Dv]``
state of ``read_slot[b]`` (prefetched by the previous step), starts the read of ``b + 1``,
applies one token for all heads with elementwise ops and reductions (no matmuls: a decode step
is memory-bound) and starts the DMA of the new state to ``write_slot[b]`` (skipped for slot 0),
drained at the next step.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.reference.gated_delta_rule import check_gdr_decode

_F32 = jnp.float32


def _column(row, diagonal):
    """``[1, Dk]`` row -> ``[Dk, 1]`` column exactly (diagonal select + lane sum), so q, k travel
    lane-dense instead of as 128x-padded ``[Dk, 1]`` columns."""
    return jnp.sum(jnp.where(diagonal, row, 0.0), axis=1, keepdims=True)


def _gdr_decode_kernel(read_ref, write_ref,  # SMEM [B] slots
                       q_ref,      # [Hv, Dk] f32 raw q (GQA-expanded), lane-dense rows
                       k_ref,      # [Hv, Dk] f32 raw k
                       v_ref,      # [Hv, 1, Dv]
                       g_ref,      # [Hv, 1, 1] f32 log-decay
                       beta_ref,   # [Hv, 1, 1] f32
                       pool_ref,   # [N, Hv, Dk, Dv] f32 HBM: initial states (alias of pool_out)
                       o_ref,      # [Hv, 1, Dv]
                       pool_out,   # [N, Hv, Dk, Dv] f32 HBM: new states
                       buf_ref,    # [2, Hv, Dk, Dv] f32 scratch: this step's state, next one's
                       read_sem,   # DMA semaphores [2]: state reads into buf_ref
                       write_sem):  # DMA semaphores [2]: state writes out of buf_ref
    # Double-buffered: sequence b+1's state is read while b computes and b's write drains
    # while b+1 waits for its read. Slots a decode batch writes are not read by a later
    # sequence of the batch (each writes its own slot), so the reordering is unobservable.
    b, last = pl.program_id(0), pl.num_programs(0) - 1
    cur, nxt = jax.lax.rem(b, 2), 1 - jax.lax.rem(b, 2)
    read = lambda i, slot: pltpu.make_async_copy(pool_ref.at[read_ref[i]], buf_ref.at[slot],
                                                 read_sem.at[slot])
    write = lambda i, slot: pltpu.make_async_copy(buf_ref.at[slot], pool_out.at[write_ref[i]],
                                                  write_sem.at[slot])

    @pl.when(b == 0)
    def _first_read():
        read(0, 0).start()

    read(b, cur).wait()

    @pl.when((b > 0) & (write_ref[jnp.maximum(b - 1, 0)] > 0))
    def _drain_previous_write():  # frees buf_ref[nxt] for the next read
        write(b - 1, nxt).wait()

    @pl.when(b < last)
    def _prefetch_next():
        read(b + 1, nxt).start()

    dk = q_ref.shape[1]
    diagonal = (jax.lax.broadcasted_iota(jnp.int32, (dk, dk), 0)
                == jax.lax.broadcasted_iota(jnp.int32, (dk, dk), 1))

    def head(h, carry):  # one head at a time: temporaries stay [Dk, Dk] / [Dk, Dv]
        q = _column(q_ref[pl.ds(h, 1), :].astype(_F32), diagonal)          # [Dk, 1]
        k = _column(k_ref[pl.ds(h, 1), :].astype(_F32), diagonal)
        q = q * jax.lax.rsqrt(jnp.sum(q * q, axis=0, keepdims=True) + 1e-6) * (dk ** -0.5)
        k = k * jax.lax.rsqrt(jnp.sum(k * k, axis=0, keepdims=True) + 1e-6)
        state = jnp.exp(g_ref[h]) * buf_ref[cur, h]                        # [Dk, Dv]
        u = beta_ref[h] * (v_ref[h].astype(_F32) - jnp.sum(state * k, axis=0, keepdims=True))
        state = state + k * u
        o_ref[h] = jnp.sum(state * q, axis=0, keepdims=True).astype(o_ref.dtype)
        buf_ref[cur, h] = state
        return carry

    jax.lax.fori_loop(0, q_ref.shape[0], head, 0)

    @pl.when(write_ref[b] > 0)
    def _write():
        write(b, cur).start()

    @pl.when((b == last) & (write_ref[b] > 0))
    def _drain_last_write():
        write(b, cur).wait()


@functools.partial(jax.jit, static_argnames=("interpret",), donate_argnames=("ssm_pool",))
def gated_delta_rule_decode(q, k, v, g, beta, ssm_pool, read_slot, write_slot, *,
                            interpret: bool = False):
    """Pallas decode; same contract as ``gated_delta_rule_decode_reference``.

    q, k ``[B, Hk, Dk]``; v ``[B, Hv, Dv]``; g, beta ``[B, Hv]``; ssm_pool ``[N, Hv, Dk, Dv]``
    f32. Returns ``(o [B, Hv, Dv] in v.dtype, ssm_pool)``.
    """
    num_seqs, num_heads, dv = v.shape
    hk, dk = check_gdr_decode(q, k, v, g, beta, ssm_pool)
    group = num_heads // hk
    qe = jnp.repeat(q, group, axis=1).astype(_F32)  # f32 rows: one-row loads of a packed
    ke = jnp.repeat(k, group, axis=1).astype(_F32)  # bf16 ref at a dynamic head do not lower
    col = lambda a: a.astype(_F32).reshape(num_seqs, num_heads, 1, 1)
    sq = pl.Squeezed()
    spec = lambda *last: pl.BlockSpec((sq, num_heads) + last, lambda b, *_: (b, 0, 0, 0))
    rows = pl.BlockSpec((sq, num_heads, dk), lambda b, *_: (b, 0, 0))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2, grid=(num_seqs,),
        in_specs=[rows, rows, spec(1, dv), spec(1, 1), spec(1, 1),
                  pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=[spec(1, dv), pl.BlockSpec(memory_space=pl.ANY)],
        scratch_shapes=[pltpu.VMEM((2, num_heads, dk, dv), _F32),
                        pltpu.SemaphoreType.DMA((2,)), pltpu.SemaphoreType.DMA((2,))])
    o, ssm_pool = pl.pallas_call(
        _gdr_decode_kernel, grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct((num_seqs, num_heads, 1, dv), v.dtype),
                   jax.ShapeDtypeStruct(ssm_pool.shape, ssm_pool.dtype)],
        input_output_aliases={2 + 5: 1}, interpret=interpret,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
    )(read_slot, write_slot, qe, ke, v[:, :, None, :], col(g), col(beta), ssm_pool)
    return o[:, :, 0, :], ssm_pool
