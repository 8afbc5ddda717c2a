"""Pallas Triton (GPU) kernel: KDA recurrent decode (one token per sequence).

Grid ``(B, H, Dv / BV)``: each program loads the ``[Dk, BV]`` state tile of ``read_slot[b]``,
decays it per key channel, applies the delta rule with elementwise ops and reductions (one pass
over the state, no dots) and stores the new tile to ``write_slot[b]`` in place (skipped for
slot 0). Same contract as ``reference.kda.kda_decode_reference``; Dk, Dv need not be powers of
two: loads and stores are masked.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels.gpu.gated_delta_rule import padded_ds, pow2_at_least_16
from pallas_kernels.reference.kda import check_kda

_F32 = jnp.float32
BLOCK_V = 32
NUM_WARPS = 4


def _kda_decode_kernel(read_ref,   # [B] i32 initial-state slot
                       write_ref,  # [B] i32 destination slot (0 = dropped)
                       q_ref,      # [B, H, Dk] raw q
                       k_ref,      # [B, H, Dk] raw k
                       v_ref,      # [B, H, Dv]
                       g_ref,      # [B, H, Dk] f32 log-decay per key channel
                       beta_ref,   # [B, H] f32
                       pool_ref,   # [N, H, Dk, Dv] f32 initial states (alias of pool_out)
                       o_ref,      # [B, H, Dv]
                       pool_out,   # [N, H, Dk, Dv] f32 new states
                       *, head_k_dim: int, block_k: int, block_v: int):
    b, h, vt = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    v0 = vt * block_v
    kmask = jnp.arange(block_k) < head_k_dim
    vmask = (v0 + jnp.arange(block_v)) < o_ref.shape[2]
    smask = kmask[:, None] & vmask[None, :]
    kidx, vidx = padded_ds(block_k), pl.ds(v0, block_v)
    q = pltr.load(q_ref.at[b, h, kidx], mask=kmask, other=0.0).astype(_F32)
    k = pltr.load(k_ref.at[b, h, kidx], mask=kmask, other=0.0).astype(_F32)
    v = pltr.load(v_ref.at[b, h, vidx], mask=vmask, other=0.0).astype(_F32)
    g = pltr.load(g_ref.at[b, h, kidx], mask=kmask, other=0.0)
    q = q * jax.lax.rsqrt(jnp.sum(q * q) + 1e-6) * head_k_dim ** -0.5
    k = k * jax.lax.rsqrt(jnp.sum(k * k) + 1e-6)
    state = pltr.load(pool_ref.at[read_ref[b], h, kidx, vidx], mask=smask, other=0.0)
    state = jnp.exp(g)[:, None] * state
    u = beta_ref[b, h] * (v - jnp.sum(state * k[:, None], axis=0))
    state = state + k[:, None] * u[None, :]
    pltr.store(o_ref.at[b, h, vidx], jnp.sum(state * q[:, None], axis=0).astype(o_ref.dtype),
               mask=vmask)

    @pl.when(write_ref[b] > 0)
    def _write():
        pltr.store(pool_out.at[write_ref[b], h, kidx, vidx], state, mask=smask)


@functools.partial(jax.jit, static_argnames=("interpret",), donate_argnames=("ssm_pool",))
def kda_decode(q, k, v, g, beta, ssm_pool, read_slot, write_slot, *, interpret: bool = False):
    """Pallas Triton KDA decode; the contract of ``kda_decode_reference``. Grid ``(B, H,
    Dv / BV)``, one pass over the state tile. Returns ``(o [B, H, Dv] in v.dtype, ssm_pool)``."""
    check_kda(q, k, v, g, beta, ssm_pool)
    num_seqs, num_heads, dv = v.shape
    block_v = min(BLOCK_V, pow2_at_least_16(dv))
    kernel = functools.partial(_kda_decode_kernel, head_k_dim=q.shape[-1],
                               block_k=pow2_at_least_16(q.shape[-1]), block_v=block_v)
    i32 = lambda a: jnp.asarray(a, jnp.int32)
    return pl.pallas_call(
        kernel, grid=(num_seqs, num_heads, pl.cdiv(dv, block_v)),
        out_shape=[jax.ShapeDtypeStruct((num_seqs, num_heads, dv), v.dtype),
                   jax.ShapeDtypeStruct(ssm_pool.shape, ssm_pool.dtype)],
        input_output_aliases={7: 1}, interpret=interpret,
        compiler_params=pltr.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
    )(i32(read_slot), i32(write_slot), q, k, v, g.astype(_F32), beta.astype(_F32), ssm_pool)
