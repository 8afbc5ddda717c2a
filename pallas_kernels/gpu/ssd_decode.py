"""Pallas Triton (GPU) Mamba2 SSD decode: one token per sequence, pool updated in place.

Grid ``(B, H)``: each program loads the whole ``[N, P]`` state of one head of ``read_slot[b]``
(masked pow2 tiles: N, P need not be powers of two), applies the token elementwise
(``S <- exp(dt A) S + dt B x^T``, ``y = S^T C + D x``; no dots: decode is memory-bound) and
stores ``y`` and the new state to ``write_slot[b]`` (skipped for slot 0). Same contract as
``reference.ssd.ssd_decode_reference``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels.gpu.gated_delta_rule import padded_ds, pow2_at_least_16
from pallas_kernels.reference.ssd import check_ssd

_F32 = jnp.float32


def _ssd_decode_kernel(read_ref,   # [B] i32
                       write_ref,  # [B] i32 (0 = dropped)
                       x_ref,      # [B, H, P]
                       dt_ref,     # [B, H] f32
                       a_ref,      # [H] f32
                       b_ref,      # [B, G, N]
                       c_ref,      # [B, G, N]
                       d_ref,      # [H] f32
                       pool_ref,   # [S, H, N, P] f32 (alias of pool_out)
                       y_ref,      # [B, H, P]
                       pool_out,   # [S, H, N, P] f32
                       *, state_size: int, head_dim: int, block_n: int, block_p: int,
                       group: int):
    i, h = pl.program_id(0), pl.program_id(1)
    grp = jax.lax.div(h, group)
    nmask, pmask = jnp.arange(block_n) < state_size, jnp.arange(block_p) < head_dim
    smask = nmask[:, None] & pmask[None, :]
    nidx, pidx = padded_ds(block_n), padded_ds(block_p)
    state = pltr.load(pool_ref.at[read_ref[i], h, nidx, pidx], mask=smask, other=0.0)
    x = pltr.load(x_ref.at[i, h, pidx], mask=pmask, other=0.0).astype(_F32)
    bv = pltr.load(b_ref.at[i, grp, nidx], mask=nmask, other=0.0).astype(_F32)
    cv = pltr.load(c_ref.at[i, grp, nidx], mask=nmask, other=0.0).astype(_F32)
    dt = dt_ref[i, h]
    state = jnp.exp(dt * a_ref[h]) * state + (dt * bv)[:, None] * x[None, :]
    y = jnp.sum(state * cv[:, None], axis=0) + d_ref[h] * x
    pltr.store(y_ref.at[i, h, pidx], y.astype(y_ref.dtype), mask=pmask)

    @pl.when(write_ref[i] > 0)
    def _write():
        pltr.store(pool_out.at[write_ref[i], h, nidx, pidx], state, mask=smask)


@functools.partial(jax.jit, static_argnames=("interpret",), donate_argnames=("ssm_pool",))
def ssd_decode(x, dt, a, b, c, d, ssm_pool, read_slot, write_slot, *, interpret: bool = False):
    """Pallas Triton decode; the contract of ``ssd_decode_reference``. Returns ``(y, pool)``."""
    num_heads, p, g, n = check_ssd(x, dt, a, b, c, d, ssm_pool)
    kernel = functools.partial(_ssd_decode_kernel, state_size=n, head_dim=p,
                               block_n=pow2_at_least_16(n), block_p=pow2_at_least_16(p),
                               group=num_heads // g)
    i32 = lambda v: jnp.asarray(v, jnp.int32)
    return pl.pallas_call(
        kernel, grid=(x.shape[0], num_heads),
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype),
                   jax.ShapeDtypeStruct(ssm_pool.shape, ssm_pool.dtype)],
        input_output_aliases={8: 1}, interpret=interpret,
        compiler_params=pltr.CompilerParams(num_warps=4, num_stages=1),
    )(i32(read_slot), i32(write_slot), x, dt.astype(_F32), a.astype(_F32), b, c,
      d.astype(_F32), ssm_pool)
