"""Pallas Triton (GPU) kernel: gated delta rule recurrent decode (one token per sequence).

Grid ``(B, Hv, Dv / BV)``: each program loads the ``[Dk, BV]`` state tile of ``read_slot[b]``
from the pool, applies one token with elementwise ops and reductions (no dots: decode is
memory-bound, one pass over the state) and stores the new tile to ``write_slot[b]`` in place
(skipped for slot 0). Dk, Dv need not be powers of two: loads and stores are masked.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels.gpu.gated_delta_rule import padded_ds, pow2_at_least_16
from pallas_kernels.reference.gated_delta_rule import check_gdr_decode

_F32 = jnp.float32
BLOCK_V = 32    # value-dim tile: B * Hv * Dv/32 programs keep the GPU busy at small batch
NUM_WARPS = 4


def _gdr_decode_kernel(read_ref,   # [B] i32 initial-state slot
                       write_ref,  # [B] i32 destination slot (0 = dropped)
                       q_ref,      # [B, Hk, Dk] raw q
                       k_ref,      # [B, Hk, Dk] raw k
                       v_ref,      # [B, Hv, Dv]
                       g_ref,      # [B, Hv] f32 log-decay
                       beta_ref,   # [B, Hv] f32
                       pool_ref,   # [N, Hv, Dk, Dv] f32 initial states (alias of pool_out)
                       o_ref,      # [B, Hv, Dv]
                       pool_out,   # [N, Hv, Dk, Dv] f32 new states
                       *, head_k_dim: int, block_k: int, block_v: int, group: int):
    b, h, vt = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    hk = jax.lax.div(h, group)
    v0 = vt * block_v
    kmask = jnp.arange(block_k) < head_k_dim
    vmask = (v0 + jnp.arange(block_v)) < o_ref.shape[2]
    smask = kmask[:, None] & vmask[None, :]
    kidx, vidx = padded_ds(block_k), pl.ds(v0, block_v)
    q = pltr.load(q_ref.at[b, hk, kidx], mask=kmask, other=0.0).astype(_F32)
    k = pltr.load(k_ref.at[b, hk, kidx], mask=kmask, other=0.0).astype(_F32)
    v = pltr.load(v_ref.at[b, h, vidx], mask=vmask, other=0.0).astype(_F32)
    q = q * jax.lax.rsqrt(jnp.sum(q * q) + 1e-6) * head_k_dim ** -0.5
    k = k * jax.lax.rsqrt(jnp.sum(k * k) + 1e-6)
    state = pltr.load(pool_ref.at[read_ref[b], h, kidx, vidx], mask=smask, other=0.0)
    state = jnp.exp(g_ref[b, h]) * state
    u = beta_ref[b, h] * (v - jnp.sum(state * k[:, None], axis=0))
    state = state + k[:, None] * u[None, :]
    o = jnp.sum(state * q[:, None], axis=0)
    pltr.store(o_ref.at[b, h, vidx], o.astype(o_ref.dtype), mask=vmask)
    slot = write_ref[b]

    @pl.when(slot > 0)
    def _write():
        pltr.store(pool_out.at[slot, h, kidx, vidx], state, mask=smask)


@functools.partial(jax.jit, static_argnames=("interpret",), donate_argnames=("ssm_pool",))
def gated_delta_rule_decode(q, k, v, g, beta, ssm_pool, read_slot, write_slot, *,
                            interpret: bool = False):
    """Pallas Triton decode; same contract as ``gated_delta_rule_decode_reference``.

    q, k ``[B, Hk, Dk]``; v ``[B, Hv, Dv]``; g, beta ``[B, Hv]``; ssm_pool ``[N, Hv, Dk, Dv]``
    f32 (donated, updated in place). Returns ``(o [B, Hv, Dv] in v.dtype, ssm_pool)``.
    """
    num_seqs, num_heads, dv = v.shape
    hk, dk = check_gdr_decode(q, k, v, g, beta, ssm_pool)
    block_v = min(BLOCK_V, pow2_at_least_16(dv))
    kernel = functools.partial(_gdr_decode_kernel, head_k_dim=dk, block_k=pow2_at_least_16(dk),
                               block_v=block_v, group=num_heads // hk)
    i32 = lambda a: jnp.asarray(a, jnp.int32)
    return pl.pallas_call(
        kernel, grid=(num_seqs, num_heads, pl.cdiv(dv, block_v)),
        out_shape=[jax.ShapeDtypeStruct((num_seqs, num_heads, dv), v.dtype),
                   jax.ShapeDtypeStruct(ssm_pool.shape, ssm_pool.dtype)],
        input_output_aliases={7: 1}, interpret=interpret,
        compiler_params=pltr.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
    )(i32(read_slot), i32(write_slot), q, k, v, g.astype(_F32), beta.astype(_F32), ssm_pool)
