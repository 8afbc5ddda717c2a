"""Stateless building blocks: RMS norms, partial NeoX RoPE, the dense MLP and the sparse MoE.

Dtype handling follows transformers' Qwen3-Next modules op for op (norm statistics in float32,
casts back to the activation dtype at the same points), so fp32 matches to rounding and bf16
stays close.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

F32 = jnp.float32


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Zero-centred RMSNorm: ``x / rms(x) * (1 + w)``, statistics in fp32, result in x.dtype.

    Used for input/post-attention/final norms and the attention q/k norms (all families).
    """
    xf = x.astype(F32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * (1.0 + weight.astype(F32))).astype(x.dtype)


def gated_rms_norm(x: jax.Array, gate: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """The Gated DeltaNet output norm: ``w * (x / rms(x)) * silu(gate)``; ``w`` is a PLAIN weight.

    x, gate: ``[..., Dv]`` in the model dtype; returns x.dtype.
    """
    dtype = x.dtype
    xf = x.astype(F32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    h = weight * xf.astype(dtype)
    return (h * jax.nn.silu(gate.astype(F32))).astype(dtype)


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
    """``down(silu(gate(x)) * up(x))``; x ``[T, H]``, gate_up ``[H, 2I]`` (gate | up)."""
    g, u = jnp.split(x @ gate_up, 2, axis=-1)
    return (jax.nn.silu(g) * u) @ down


def router_weights(x: jax.Array, router: jax.Array, top_k: int, norm_topk_prob: bool) -> jax.Array:
    """Dense routing weights ``[T, E]`` in x.dtype: softmax (fp32) -> top-k -> renormalise.

    Experts outside a token's top-k get weight 0.
    """
    logits = x @ router
    probs = jax.nn.softmax(logits.astype(F32), axis=-1)
    top_vals, top_idx = jax.lax.top_k(probs, top_k)
    if norm_topk_prob:
        top_vals = top_vals / jnp.sum(top_vals, axis=-1, keepdims=True)
    top_vals = top_vals.astype(x.dtype)
    one_hot = jax.nn.one_hot(top_idx, router.shape[-1], dtype=x.dtype)  # [T, k, E]
    return jnp.einsum("tk,tke->te", top_vals, one_hot)


def sparse_moe(x: jax.Array, p: dict[str, jax.Array], top_k: int,
               norm_topk_prob: bool) -> jax.Array:
    """Top-k MoE plus the sigmoid-gated shared expert. x ``[T, H]`` -> ``[T, H]``.

    Dense form: every expert runs on every token and non-selected experts are weighted by 0
    (exact; meant for tiny models and CPU tests, cost ``T * E``).
    """
    weights = router_weights(x, p["router"], top_k, norm_topk_prob)  # [T, E]
    h = jnp.einsum("th,ehi->tei", x, p["gate_up"])
    g, u = jnp.split(h, 2, axis=-1)
    per_expert = jnp.einsum("tei,eih->teh", jax.nn.silu(g) * u, p["down"])
    routed = jnp.einsum("teh,te->th", per_expert, weights)
    shared = swiglu(x, p["shared_gate_up"], p["shared_down"])
    shared = jax.nn.sigmoid(x @ p["shared_gate"]) * shared
    return routed + shared
