"""Stateless building blocks: RMS norms, partial NeoX RoPE and the dense (SwiGLU) MLP.

The MoE lives in ``models/moe.py``.

Every norm takes ``fixed_order`` (``ModelConfig.deterministic``): its mean of squares sums in
the fixed tree of ``pallas_kernels/fixed_order.py``.

Dtype handling follows transformers' Qwen3-Next modules op for op (norm statistics in float32,
casts back to the activation dtype at the same points), so fp32 matches to rounding and bf16
stays close.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels.fixed_order import row_mean

F32 = jnp.float32


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, *,
             fixed_order: bool = False) -> jax.Array:
    """Zero-centred RMSNorm: ``x / rms(x) * (1 + w)``, statistics in fp32, result in x.dtype.

    Used for input/post-attention/final norms and the attention q/k norms (all families).
    """
    xf = x.astype(F32)
    xf = xf * jax.lax.rsqrt(row_mean(xf * xf, fixed_order=fixed_order) + eps)
    return (xf * (1.0 + weight.astype(F32))).astype(x.dtype)


def gated_rms_norm(x: jax.Array, gate: jax.Array, weight: jax.Array, eps: float, *,
                   fixed_order: bool = False) -> jax.Array:
    """The Gated DeltaNet output norm: ``w * (x / rms(x)) * silu(gate)``; ``w`` is a PLAIN weight.

    x, gate: ``[..., Dv]`` in the model dtype; returns x.dtype.
    """
    dtype = x.dtype
    xf = x.astype(F32)
    xf = xf * jax.lax.rsqrt(row_mean(xf * xf, fixed_order=fixed_order) + eps)
    h = weight * xf.astype(dtype)
    return (h * jax.nn.silu(gate.astype(F32))).astype(dtype)


def rms_norm_plain(x: jax.Array, weight: jax.Array, eps: float, *,
                   fixed_order: bool = False) -> jax.Array:
    """Plain RMSNorm ``w * (x / rms(x))`` (Kimi Linear): statistics in fp32, the normalised value
    cast to x.dtype before the multiply (as transformers' ``KimiLinearRMSNorm``)."""
    xf = x.astype(F32)
    xf = xf * jax.lax.rsqrt(row_mean(xf * xf, fixed_order=fixed_order) + eps)
    return (weight * xf.astype(x.dtype)).astype(x.dtype)


def rms_norm_f32_weight(x: jax.Array, weight: jax.Array, eps: float, *,
                        fixed_order: bool = False) -> jax.Array:
    """Nemotron-H's RMSNorm: ``(w * x / rms(x))`` all in fp32, cast once to x.dtype."""
    xf = x.astype(F32)
    xf = xf * jax.lax.rsqrt(row_mean(xf * xf, fixed_order=fixed_order) + eps)
    return (weight.astype(F32) * xf).astype(x.dtype)


def sigmoid_gated_rms_norm(x: jax.Array, gate: jax.Array, weight: jax.Array,
                           eps: float, *, fixed_order: bool = False) -> jax.Array:
    """KDA output norm ``w * (x / rms(x)) * sigmoid(gate)``, all in fp32, cast once to x.dtype.

    x, gate: ``[..., D]``; weight ``[D]`` (plain)."""
    xf = x.astype(F32)
    xf = xf * jax.lax.rsqrt(row_mean(xf * xf, fixed_order=fixed_order) + eps)
    return (weight.astype(F32) * xf * jax.nn.sigmoid(gate.astype(F32))).astype(x.dtype)


def rope_cos_sin(positions: jax.Array, rotary_dim: int, theta: float,
                 dtype: Any) -> tuple[jax.Array, jax.Array]:
    """NeoX-style cos/sin ``[T, rotary_dim]`` (frequencies repeated twice), cast to ``dtype``."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, rotary_dim, 2, dtype=F32) / rotary_dim))
    freqs = positions.astype(F32)[:, None] * inv_freq[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate the first ``rotary_dim`` features of x ``[T, H, D]``; the rest pass through."""
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = jnp.concatenate([-x_rot[..., half:], x_rot[..., :half]], axis=-1)
    x_rot = x_rot * cos[:, None, :] + rotated * sin[:, None, :]
    return jnp.concatenate([x_rot, x_pass], axis=-1)


def swiglu(x: jax.Array, gate_up: jax.Array, down: jax.Array) -> jax.Array:
    """``down(silu(gate(x)) * up(x))``; x ``[T, H]``, gate_up ``[H, 2I]`` pair-interleaved
    (column ``2i`` is gate ``i``, ``2i + 1`` up ``i``: a contiguous column split over tensor
    parallel devices gives each whole (gate, up) pairs), down ``[I, H]``."""
    h = (x @ gate_up).reshape(*x.shape[:-1], -1, 2)
    return (jax.nn.silu(h[..., 0]) * h[..., 1]) @ down
