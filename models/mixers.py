"""Token mixers: Gated DeltaNet (linear attention) and gated full attention over paged KV.

Both read and write the pools through ``pallas_kernels.ops`` only; ``batch`` is duck-typed
(``mambacache.batch.ForwardBatch``: packed ragged tokens, see that module). ``mesh`` (static, a
``jax.sharding.Mesh`` or None) is handed to every kernel op: under tensor parallelism each op runs
per device on its own heads (``ops``' docstring).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from models.config import ModelConfig
from models.layers import F32, apply_rope, gated_rms_norm, rms_norm, rope_cos_sin
from pallas_kernels import ops


def _gdn_project(cfg: ModelConfig, p: dict[str, jax.Array], x: jax.Array):
    """x ``[T, H]`` -> (conv input ``[T, C]``, z ``[T, Hv, Dv]``, b ``[T, Hv]``, a ``[T, Hv]``)."""
    c, vd, hv = cfg.linear_conv_dim, cfg.linear_value_dim, cfg.linear_num_value_heads
    proj = x @ p["in_proj"]
    qkv = proj[:, :c]
    z = proj[:, c:c + vd].reshape(-1, hv, cfg.linear_value_head_dim)
    b = proj[:, c + vd:c + vd + hv]
    a = proj[:, c + vd + hv:]
    return qkv, z, b, a


def _gdn_split(cfg: ModelConfig, y: jax.Array):
    """Conv output ``[T, C]`` -> q, k ``[T, Hk, Dk]`` and v ``[T, Hv, Dv]``."""
    kd = cfg.linear_key_dim
    q = y[:, :kd].reshape(-1, cfg.linear_num_key_heads, cfg.linear_key_head_dim)
    k = y[:, kd:2 * kd].reshape(-1, cfg.linear_num_key_heads, cfg.linear_key_head_dim)
    v = y[:, 2 * kd:].reshape(-1, cfg.linear_num_value_heads, cfg.linear_value_head_dim)
    return q, k, v


def gated_delta_net(cfg: ModelConfig, p: dict[str, jax.Array], x: jax.Array, conv_pool: jax.Array,
                    ssm_pool: jax.Array, batch: Any, *, decode: bool, impl: str,
                    mesh: Mesh | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One Gated DeltaNet layer. x ``[T, H]`` -> (out ``[T, H]``, conv_pool, ssm_pool).

    ``decode`` = one token per sequence (T == B), using the single-step ops.
    """
    qkv, z, b, a = _gdn_project(cfg, p, x)
    if decode:
        y, conv_pool = ops.causal_conv1d_decode(
            qkv, p["conv_w"], None, conv_pool, batch.read_slot, batch.write_slot, impl=impl,
            mesh=mesh)
    else:
        y, conv_pool = ops.causal_conv1d_extend(
            qkv, p["conv_w"], None, conv_pool, batch.cu_seqlens, batch.read_slot,
            batch.write_slot, batch.snap_seq, batch.snap_offset, batch.snap_slot, impl=impl,
            mesh=mesh)
    q, k, v = _gdn_split(cfg, y)
    beta = jax.nn.sigmoid(b).astype(F32)
    g = -jnp.exp(p["A_log"].astype(F32)) * jax.nn.softplus(a.astype(F32) + p["dt_bias"])
    if decode:
        o, ssm_pool = ops.gated_delta_rule_decode(
            q, k, v, g, beta, ssm_pool, batch.read_slot, batch.write_slot, impl=impl,
            mesh=mesh)
    else:
        o, ssm_pool = ops.gated_delta_rule_extend(
            q, k, v, g, beta, ssm_pool, batch.cu_seqlens, batch.read_slot, batch.write_slot,
            batch.snap_seq, batch.snap_offset, batch.snap_slot, impl=impl, mesh=mesh)
    o = gated_rms_norm(o, z, p["norm"], cfg.rms_norm_eps)
    out = o.reshape(o.shape[0], cfg.linear_value_dim) @ p["out_proj"]
    return out, conv_pool, ssm_pool


def full_attention(cfg: ModelConfig, p: dict[str, jax.Array], x: jax.Array, k_pages: jax.Array,
                   v_pages: jax.Array, batch: Any, impl: str,
                   mesh: Mesh | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Gated GQA attention with zero-centred q/k norms and partial RoPE over paged KV.

    x ``[T, H]`` -> (out ``[T, H]``, k_pages, v_pages). This step's K/V are written at
    ``batch.out_cache_loc`` before attending; rotary positions come from ``batch.positions``.
    """
    t = x.shape[0]
    d, hq, hkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    proj = x @ p["qkv_proj"]
    qg = proj[:, :hq * 2 * d].reshape(t, hq, 2 * d)
    q, gate = qg[..., :d], qg[..., d:].reshape(t, hq * d)
    k = proj[:, hq * 2 * d:hq * 2 * d + hkv * d].reshape(t, hkv, d)
    v = proj[:, hq * 2 * d + hkv * d:].reshape(t, hkv, d)
    q = rms_norm(q, p["q_norm"], cfg.rms_norm_eps)
    k = rms_norm(k, p["k_norm"], cfg.rms_norm_eps)
    cos, sin = rope_cos_sin(batch.positions, cfg.rotary_dim, cfg.rope_theta, x.dtype)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    k_pages, v_pages = ops.write_kv(k_pages, v_pages, k, v, batch.out_cache_loc)
    o = ops.paged_attention(q, k_pages, v_pages, batch.cu_seqlens, batch.seq_lens,
                            batch.page_table, scale=d ** -0.5, impl=impl, mesh=mesh)
    o = o.reshape(t, hq * d) * jax.nn.sigmoid(gate)
    return o @ p["o_proj"], k_pages, v_pages
