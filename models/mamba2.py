"""The Mamba2 mixer (Nemotron-H, Granite 4.0-H) over the pools, through ``pallas_kernels.ops``.

As transformers computes it: ``in_proj`` -> z, xBC, dt; the causal depthwise conv over xBC (with
bias) + SiLU; x ``[H, P]`` and B, C ``[G, N]`` (heads of a group share them);
``dt = clamp(softplus(dt + dt_bias), *time_step_limit)``, ``A = -exp(A_log)``; the SSD scan
(``ops.ssd_extend`` / ``ops.ssd_decode``: ``h = exp(dt A) h + dt B x^T``, ``y = h^T C + D x``);
the grouped gated RMSNorm ``w * rmsnorm_per_group(y * silu(z))``; ``out_proj``.

The clamp is applied in every path (transformers skips it in its one-token update, which makes
its cached decode a different function from its prefill whenever the clamp bites; ours is one
function, so a cached prefix gives the same tokens as a recomputed one).

Layout (group-major, ``models/families/mamba2_common.py``): with ``r = H / G``, ``in_proj``
columns are ``G`` groups ``z_j (r*P) | x_j (r*P) | B_j (N) | C_j (N) | dt_j (r)`` and the conv
channels ``G`` groups ``x_j | B_j | C_j``; a contiguous split over tensor-parallel devices gives
whole groups. Pools: conv ``[S, K-1, C]`` in the model dtype, ssm ``[S, H, N, P]`` float32
(``ModelConfig``'s linear_* sizes hold the Mamba2 ones: key heads = G, key dim = N, value heads
= H, value dim = P).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from models.config import ModelConfig
from models.layers import F32
from pallas_kernels import ops
from pallas_kernels.fixed_order import row_mean


def mamba2_sizes(cfg: ModelConfig) -> tuple[int, int, int, int]:
    """``(H, P, G, N)``: heads, head dim, groups, state size."""
    return (cfg.linear_num_value_heads, cfg.linear_value_head_dim, cfg.linear_num_key_heads,
            cfg.linear_key_head_dim)


def _project(cfg: ModelConfig, p: dict[str, jax.Array], x: jax.Array):
    """x ``[T, D]`` -> (xBC ``[T, C]`` group-major, z ``[T, H*P]``, dt ``[T, H]``)."""
    h, hp, g, n = mamba2_sizes(cfg)
    t, r = x.shape[0], h // g
    proj = x @ p["in_proj"]
    if "in_proj_b" in p:
        proj = proj + p["in_proj_b"]
    proj = proj.reshape(t, g, 2 * r * hp + 2 * n + r)
    z = proj[..., :r * hp].reshape(t, h * hp)
    xbc = proj[..., r * hp:2 * r * hp + 2 * n].reshape(t, g * (r * hp + 2 * n))
    dt = proj[..., 2 * r * hp + 2 * n:].reshape(t, h)
    return xbc, z, dt


def _split(cfg: ModelConfig, y: jax.Array):
    """Group-major conv output ``[T, C]`` -> x ``[T, H, P]``, B and C ``[T, G, N]``."""
    h, hp, g, n = mamba2_sizes(cfg)
    t, r = y.shape[0], h // g
    y = y.reshape(t, g, r * hp + 2 * n)
    return (y[..., :r * hp].reshape(t, h, hp), y[..., r * hp:r * hp + n], y[..., r * hp + n:])


def grouped_gated_norm(y: jax.Array, z: jax.Array, weight: jax.Array, groups: int,
                       eps: float, *, fixed_order: bool = False) -> jax.Array:
    """``w * rmsnorm(y * silu(z))`` with the statistics per group of ``H*P / G`` channels.

    y, z ``[T, H*P]``; gating and statistics in fp32, the normalised value cast to y.dtype
    before the plain weight multiplies (transformers' ``RMSNormGated``)."""
    t, width = y.shape
    hf = y.astype(F32) * jax.nn.silu(z.astype(F32))
    hf = hf.reshape(t, groups, width // groups)
    hf = hf * jax.lax.rsqrt(row_mean(hf * hf, fixed_order=fixed_order) + eps)
    return weight * hf.reshape(t, width).astype(y.dtype)


def time_step(cfg: ModelConfig, dt: jax.Array, dt_bias: jax.Array) -> jax.Array:
    """``clamp(softplus(dt + dt_bias), lo, hi)`` in fp32, ``[T, H]``."""
    lo, hi = cfg.time_step_limit
    return jnp.clip(jax.nn.softplus(dt.astype(F32) + dt_bias.astype(F32)), lo, hi)


def mamba2_mixer(cfg: ModelConfig, p: dict[str, jax.Array], x: jax.Array, conv_pool: jax.Array,
                 ssm_pool: jax.Array, batch: Any, *, decode: bool, impl: str,
                 mesh: Mesh | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One Mamba2 layer. x ``[T, D]`` -> (out ``[T, D]``, conv_pool, ssm_pool).

    ``decode`` = one token per sequence (T == B), using the single-step ops.
    """
    xbc, z, dt = _project(cfg, p, x)
    if decode:
        y, conv_pool = ops.causal_conv1d_decode(
            xbc, p["conv_w"], p.get("conv_b"), conv_pool, batch.read_slot, batch.write_slot,
            impl=impl, mesh=mesh, fixed_order=cfg.deterministic)
    else:
        y, conv_pool = ops.causal_conv1d_extend(
            xbc, p["conv_w"], p.get("conv_b"), conv_pool, batch.cu_seqlens, batch.read_slot,
            batch.write_slot, batch.snap_seq, batch.snap_offset, batch.snap_slot, impl=impl,
            mesh=mesh, fixed_order=cfg.deterministic)
    xs, b, c = _split(cfg, y)
    dt = time_step(cfg, dt, p["dt_bias"])
    a = -jnp.exp(p["A_log"].astype(F32))
    d = p["D"].astype(F32)
    if decode:
        o, ssm_pool = ops.ssd_decode(xs, dt, a, b, c, d, ssm_pool, batch.read_slot,
                                     batch.write_slot, impl=impl, mesh=mesh,
                                     fixed_order=cfg.deterministic)
    else:
        o, ssm_pool = ops.ssd_extend(
            xs, dt, a, b, c, d, ssm_pool, batch.cu_seqlens, batch.read_slot, batch.write_slot,
            batch.snap_seq, batch.snap_offset, batch.snap_slot, impl=impl, mesh=mesh,
            fixed_order=cfg.deterministic)
    o = grouped_gated_norm(o.reshape(o.shape[0], -1), z, p["norm"], cfg.linear_num_key_heads,
                           cfg.rms_norm_eps, fixed_order=cfg.deterministic)
    out = o @ p["out_proj"]
    if "out_proj_b" in p:
        out = out + p["out_proj_b"]
    return out, conv_pool, ssm_pool
