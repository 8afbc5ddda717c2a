"""TPU (Mosaic) kernel: gated delta rule recurrent decode (one token per sequence), pool in place.

Grid ``(B,)``: each step DMAs the ``[Hv, Dk, Dv]`` state of ``read_slot[b]`` into VMEM, applies
one token for all heads with elementwise ops and reductions (no matmuls: a decode step is
memory-bound) and DMAs the new state to ``write_slot[b]`` (skipped for slot 0).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.reference.gated_delta_rule import check_gdr_decode

_F32 = jnp.float32


def _columns(rows, diagonal):
    """``[Hv, Dk]`` rows -> ``[Hv, Dk, 1]`` columns exactly (diagonal select + lane sum), so q, k
    travel lane-dense instead of as 128x-padded ``[Dk, 1]`` columns."""
    return jnp.sum(jnp.where(diagonal, rows[:, None, :], 0.0), axis=2, keepdims=True)


def _gdr_decode_kernel(read_ref, write_ref,  # SMEM [B] slots
                       q_ref,      # [Hv, Dk] raw q (GQA-expanded), lane-dense rows
                       k_ref,      # [Hv, Dk] raw k
                       v_ref,      # [Hv, 1, Dv]
                       g_ref,      # [Hv, 1, 1] f32 log-decay
                       beta_ref,   # [Hv, 1, 1] f32
                       pool_ref,   # [N, Hv, Dk, Dv] f32 HBM: initial states (alias of pool_out)
                       o_ref,      # [Hv, 1, Dv]
                       pool_out,   # [N, Hv, Dk, Dv] f32 HBM: new states
                       state_ref):  # [Hv, Dk, Dv] f32 scratch
    b = pl.program_id(0)
    dk = q_ref.shape[1]
    pltpu.sync_copy(pool_ref.at[read_ref[b]], state_ref)
    hv = q_ref.shape[0]
    diagonal = (jax.lax.broadcasted_iota(jnp.int32, (hv, dk, dk), 1)
                == jax.lax.broadcasted_iota(jnp.int32, (hv, dk, dk), 2))
    q = _columns(q_ref[...].astype(_F32), diagonal)
    k = _columns(k_ref[...].astype(_F32), diagonal)
    q = q * jax.lax.rsqrt(jnp.sum(q * q, axis=1, keepdims=True) + 1e-6) * (dk ** -0.5)
    k = k * jax.lax.rsqrt(jnp.sum(k * k, axis=1, keepdims=True) + 1e-6)
    state = jnp.exp(g_ref[...]) * state_ref[...]
    u = beta_ref[...] * (v_ref[...].astype(_F32) - jnp.sum(state * k, axis=1, keepdims=True))
    state = state + k * u
    o_ref[...] = jnp.sum(state * q, axis=1, keepdims=True).astype(o_ref.dtype)
    state_ref[...] = state

    @pl.when(write_ref[b] > 0)
    def _write():
        pltpu.sync_copy(state_ref, pool_out.at[write_ref[b]])


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
    qe = jnp.repeat(q, group, axis=1)
    ke = jnp.repeat(k, group, axis=1)
    col = lambda a: a.astype(_F32).reshape(num_seqs, num_heads, 1, 1)
    sq = pl.Squeezed()
    spec = lambda *last: pl.BlockSpec((sq, num_heads) + last, lambda b, *_: (b, 0, 0, 0))
    rows = pl.BlockSpec((sq, num_heads, dk), lambda b, *_: (b, 0, 0))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2, grid=(num_seqs,),
        in_specs=[rows, rows, spec(1, dv), spec(1, 1), spec(1, 1),
                  pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=[spec(1, dv), pl.BlockSpec(memory_space=pl.ANY)],
        scratch_shapes=[pltpu.VMEM((num_heads, dk, dv), _F32)])
    o, ssm_pool = pl.pallas_call(
        _gdr_decode_kernel, grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct((num_seqs, num_heads, 1, dv), v.dtype),
                   jax.ShapeDtypeStruct(ssm_pool.shape, ssm_pool.dtype)],
        input_output_aliases={2 + 5: 1}, interpret=interpret,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
    )(read_slot, write_slot, qe, ke, v[:, :, None, :], col(g), col(beta), ssm_pool)
    return o[:, :, 0, :], ssm_pool
