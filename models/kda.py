"""Kimi Delta Attention (KDA) layer: the linear-attention mixer of Kimi Linear.

``x @ in_proj`` gives q, k, v (per head ``q_h | k_h | v_h``: the conv channels, group-major, see
``models/families/kimi_linear.py``); one depthwise causal conv + SiLU over all ``3 * H * D``
channels (transformers keeps three convs, q / k / v, which are one depthwise conv over the
concatenation: one conv-pool row per layer holds the three windows). The decay is per key channel:
``g = -exp(A_log[h]) * softplus(f_b(f_a(x)) + dt_bias)`` ``[T, H, D]`` float32;
``beta = sigmoid(b_proj(x))``; ``ops.kda_extend`` / ``ops.kda_decode`` run the delta rule against
the SSM pool (q, k L2-normalised inside, q scaled by ``D^-0.5``); the output goes through
``w * rmsnorm(o) * sigmoid(g_b(g_a(x)))`` (fp32) and ``out_proj``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from models.config import ModelConfig
from models.layers import F32, sigmoid_gated_rms_norm
from models.mixers import short_conv
from pallas_kernels import ops


def kda_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Parameter shapes of one KDA layer (``models/families/kimi_linear.py`` documents them)."""
    h, hl, d = cfg.hidden_size, cfg.linear_num_value_heads, cfg.linear_value_head_dim
    return {
        "in_proj": (h, hl * 3 * d), "conv_w": (cfg.linear_conv_kernel_dim, hl * 3 * d),
        "f_a": (h, d), "f_b": (d, hl * d), "dt_bias": (hl, d), "A_log": (hl,),
        "b_proj": (h, hl), "g_a": (h, d), "g_b": (d, hl * d), "norm": (d,),
        "out_proj": (hl * d, h),
    }


def kda_gates(cfg: ModelConfig, p: dict[str, jax.Array], x: jax.Array):
    """x ``[T, H]`` -> (g ``[T, Hl, D]`` f32 log decay, beta ``[T, Hl]`` f32), as transformers'
    ``KimiLinearForgetGate`` (softplus ``log(1 + exp)``, identity above 20) and ``b_proj``."""
    t, hl, d = x.shape[0], cfg.linear_num_value_heads, cfg.linear_value_head_dim
    f = ((x @ p["f_a"]) @ p["f_b"]).astype(F32).reshape(t, hl, d)
    f = f + p["dt_bias"].astype(F32)
    soft = jnp.where(f > 20.0, f, jnp.log(1.0 + jnp.exp(jnp.minimum(f, 20.0))))
    g = -jnp.exp(p["A_log"].astype(F32))[:, None] * soft
    beta = jax.nn.sigmoid(x @ p["b_proj"]).astype(F32)
    return g, beta


def kimi_delta_attention(cfg: ModelConfig, p: dict[str, jax.Array], x: jax.Array,
                         conv_pool: jax.Array, ssm_pool: jax.Array, batch: Any, *, decode: bool,
                         impl: str, mesh: Mesh | None = None
                         ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One KDA layer. x ``[T, H]`` -> (out ``[T, H]``, conv_pool, ssm_pool); ``decode`` = one
    token per sequence (T == B)."""
    t, hl, d = x.shape[0], cfg.linear_num_value_heads, cfg.linear_value_head_dim
    y, conv_pool = short_conv(x @ p["in_proj"], p["conv_w"], None, conv_pool, batch,
                              decode=decode, impl=impl, mesh=mesh, fixed_order=cfg.deterministic)
    y = y.reshape(t, hl, 3, d)
    q, k, v = y[:, :, 0], y[:, :, 1], y[:, :, 2]
    g, beta = kda_gates(cfg, p, x)
    if decode:
        o, ssm_pool = ops.kda_decode(q, k, v, g, beta, ssm_pool, batch.read_slot,
                                     batch.write_slot, impl=impl, mesh=mesh,
                                     fixed_order=cfg.deterministic)
    else:
        o, ssm_pool = ops.kda_extend(q, k, v, g, beta, ssm_pool, batch.cu_seqlens,
                                     batch.read_slot, batch.write_slot, batch.snap_seq,
                                     batch.snap_offset, batch.snap_slot, impl=impl, mesh=mesh,
                                     fixed_order=cfg.deterministic)
    gate = ((x @ p["g_a"]) @ p["g_b"]).reshape(t, hl, d)
    o = sigmoid_gated_rms_norm(o, gate, p["norm"], cfg.rms_norm_eps,
                               fixed_order=cfg.deterministic)
    return o.reshape(t, hl * d) @ p["out_proj"], conv_pool, ssm_pool
