"""Token mixers: Gated DeltaNet (linear attention) and gated full attention over paged KV.

Both read and write the pools through ``pallas_kernels.ops`` only; ``batch`` is duck-typed
(``mambacache.engine.step.batch.ForwardBatch``: packed ragged tokens, see that module). ``mesh``
(static, a ``jax.sharding.Mesh`` or None) is handed to every kernel op: under tensor parallelism
each op runs per device on its own heads (``ops``' docstring). ``short_conv`` is the conv step
of every mixer with a conv pool (Gated DeltaNet here, KDA in ``models/kda.py``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from models.config import ModelConfig
from models.layers import F32, apply_rope, gated_rms_norm, rms_norm, rope_cos_sin
from pallas_kernels import ops


def _gdn_group_width(cfg: ModelConfig) -> int:
    """Conv channels per key-head group: ``2*Dk + r*Dv`` with ``r = Hv/Hk``."""
    r = cfg.linear_num_value_heads // cfg.linear_num_key_heads
    return 2 * cfg.linear_key_head_dim + r * cfg.linear_value_head_dim


def _gdn_project(cfg: ModelConfig, p: dict[str, jax.Array], x: jax.Array):
    """x ``[T, H]`` -> (conv input ``[T, C]``, z ``[T, Hv, Dv]``, b ``[T, Hv]``, a ``[T, Hv]``).

    ``in_proj`` is group-major (``models/params.py``): per key head ``[q | k | v | z | b | a]``.
    The conv input keeps that order (per group ``[q | k | v]``); z, b, a come out per value head
    in GQA order (``h = j*r + i``). Reshaping to ``[T, Hk, ...]`` keeps a tp split on Hk.
    """
    t, hk, hv = x.shape[0], cfg.linear_num_key_heads, cfg.linear_num_value_heads
    r, dv, cw = hv // hk, cfg.linear_value_head_dim, _gdn_group_width(cfg)
    proj = (x @ p["in_proj"]).reshape(t, hk, cw + r * dv + 2 * r)
    qkv = proj[..., :cw].reshape(t, hk * cw)
    z = proj[..., cw:cw + r * dv].reshape(t, hv, dv)
    b = proj[..., cw + r * dv:cw + r * dv + r].reshape(t, hv)
    a = proj[..., cw + r * dv + r:].reshape(t, hv)
    return qkv, z, b, a


def _gdn_split(cfg: ModelConfig, y: jax.Array):
    """Group-major conv output ``[T, C]`` -> q, k ``[T, Hk, Dk]`` and v ``[T, Hv, Dv]``."""
    t, hk, dk = y.shape[0], cfg.linear_num_key_heads, cfg.linear_key_head_dim
    y = y.reshape(t, hk, _gdn_group_width(cfg))
    q, k = y[..., :dk], y[..., dk:2 * dk]
    v = y[..., 2 * dk:].reshape(t, cfg.linear_num_value_heads, cfg.linear_value_head_dim)
    return q, k, v


def short_conv(x: jax.Array, weight: jax.Array, bias: jax.Array | None, conv_pool: jax.Array,
               batch: Any, *, decode: bool, impl: str, mesh: Mesh | None = None,
               fixed_order: bool = False) -> tuple[jax.Array, jax.Array]:
    """Causal depthwise conv + SiLU of x ``[T, C]`` against the conv pool (``ops``' extend with
    the batch's slots and snapshots, or its decode step; ``fixed_order``: ``ops``'
    [deterministic] decode). Returns ``(y [T, C], conv_pool)``."""
    if decode:
        return ops.causal_conv1d_decode(x, weight, bias, conv_pool, batch.read_slot,
                                        batch.write_slot, impl=impl, mesh=mesh,
                                        fixed_order=fixed_order)
    return ops.causal_conv1d_extend(x, weight, bias, conv_pool, batch.cu_seqlens,
                                    batch.read_slot, batch.write_slot, batch.snap_seq,
                                    batch.snap_offset, batch.snap_slot, impl=impl, mesh=mesh,
                                    fixed_order=fixed_order)


def gated_delta_net(cfg: ModelConfig, p: dict[str, jax.Array], x: jax.Array, conv_pool: jax.Array,
                    ssm_pool: jax.Array, batch: Any, *, decode: bool, impl: str,
                    mesh: Mesh | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One Gated DeltaNet layer. x ``[T, H]`` -> (out ``[T, H]``, conv_pool, ssm_pool).

    ``decode`` = one token per sequence (T == B), using the single-step ops.
    """
    qkv, z, b, a = _gdn_project(cfg, p, x)
    y, conv_pool = short_conv(qkv, p["conv_w"], None, conv_pool, batch, decode=decode,
                              impl=impl, mesh=mesh, fixed_order=cfg.deterministic)
    q, k, v = _gdn_split(cfg, y)
    beta = jax.nn.sigmoid(b).astype(F32)
    g = -jnp.exp(p["A_log"].astype(F32)) * jax.nn.softplus(a.astype(F32) + p["dt_bias"])
    if decode:
        o, ssm_pool = ops.gated_delta_rule_decode(
            q, k, v, g, beta, ssm_pool, batch.read_slot, batch.write_slot, impl=impl,
            mesh=mesh, fixed_order=cfg.deterministic)
    else:
        o, ssm_pool = ops.gated_delta_rule_extend(
            q, k, v, g, beta, ssm_pool, batch.cu_seqlens, batch.read_slot, batch.write_slot,
            batch.snap_seq, batch.snap_offset, batch.snap_slot, impl=impl, mesh=mesh,
            fixed_order=cfg.deterministic)
    o = gated_rms_norm(o, z, p["norm"], cfg.rms_norm_eps, fixed_order=cfg.deterministic)
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
    r = hq // hkv  # group-major qkv_proj: per KV head [r x (query D | gate D) | k D | v D]
    proj = (x @ p["qkv_proj"]).reshape(t, hkv, (2 * r + 2) * d)
    qg = proj[..., :2 * r * d].reshape(t, hq, 2 * d)
    q, gate = qg[..., :d], qg[..., d:].reshape(t, hq * d)
    k, v = proj[..., 2 * r * d:(2 * r + 1) * d], proj[..., (2 * r + 1) * d:]
    q = rms_norm(q, p["q_norm"], cfg.rms_norm_eps, fixed_order=cfg.deterministic)
    k = rms_norm(k, p["k_norm"], cfg.rms_norm_eps, fixed_order=cfg.deterministic)
    cos, sin = rope_cos_sin(batch.positions, cfg.rotary_dim, cfg.rope_theta, x.dtype)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    k_pages, v_pages = ops.write_kv(k_pages, v_pages, k, v, batch.out_cache_loc)
    o = ops.paged_attention(q, k_pages, v_pages, batch.cu_seqlens, batch.seq_lens,
                            batch.page_table, scale=d ** -0.5, impl=impl, mesh=mesh,
                            fixed_order=cfg.deterministic)
    o = o.reshape(t, hq * d) * jax.nn.sigmoid(gate)
    return o @ p["o_proj"], k_pages, v_pages
