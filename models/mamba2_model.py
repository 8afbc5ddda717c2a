"""Forward pass of the Mamba2 hybrids (``nemotron_h``, ``granitemoehybrid``); ``models.forward``
dispatches here for those families (same signature, same pools and batch contract).

* Nemotron-H: each block is ``h += sublayer(norm(h))`` with one sublayer (Mamba2, attention
  without RoPE, relu2 MLP or MoE); norms multiply by a plain weight in fp32.
* Granite 4.0-H: ``h += m * mixer(norm(h))``, ``h += m * (moe + shared MLP)(norm(h))`` with the
  residual multiplier ``m``; embeddings times ``embedding_multiplier``, logits divided by
  ``logits_scaling``; norms ``w * normalised.astype(dtype)``.

Mamba2 layers take the conv / ssm pools of the linear layers in order, attention layers the KV
pages of the full layers in order (``PoolState``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from models.config import ModelConfig
from models.layers import F32, rms_norm_plain
from models.mamba2 import mamba2_mixer
from models.mamba2_blocks import granite_ffn, nemotron_mlp, nemotron_moe, plain_attention


def rms_norm_f32_weight(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Nemotron-H's RMSNorm: ``(w * x / rms(x))`` all in fp32, cast once to x.dtype."""
    xf = x.astype(F32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (weight.astype(F32) * xf).astype(x.dtype)


def mamba2_forward(params: dict[str, Any], pools: Any, batch: Any, *, cfg: ModelConfig,
                   impl: str, decode: bool, mesh: Mesh | None) -> tuple[Any, jax.Array]:
    """One step over the packed batch; returns (pools, logits ``[L, V]`` float32)."""
    nemotron = cfg.family == "nemotron_h"
    norm = rms_norm_f32_weight if nemotron else rms_norm_plain
    eps, m = cfg.rms_norm_eps, cfg.residual_multiplier
    k_pages, v_pages = list(pools.k_pages), list(pools.v_pages)
    conv, ssm = list(pools.conv), list(pools.ssm)
    h = jnp.take(params["embed"], batch.input_ids, axis=0)
    if cfg.embedding_multiplier != 1.0:
        h = h * cfg.embedding_multiplier
    full_i = linear_i = 0
    for kind, mlp, layer in zip(cfg.layer_types, cfg.mlp_types, params["layers"], strict=True):
        x = norm(h, layer["input_norm"], eps)
        if kind == "linear_attention":
            x, conv[linear_i], ssm[linear_i] = mamba2_mixer(
                cfg, layer["mamba"], x, conv[linear_i], ssm[linear_i], batch, decode=decode,
                impl=impl, mesh=mesh)
            linear_i += 1
        elif kind == "full_attention":
            x, k_pages[full_i], v_pages[full_i] = plain_attention(
                cfg, layer["attn"], x, k_pages[full_i], v_pages[full_i], batch, impl=impl,
                mesh=mesh)
            full_i += 1
        elif mlp == "dense":
            x = nemotron_mlp(layer["mlp"], x)
        else:
            x = nemotron_moe(cfg, layer["moe"], x, impl, mesh)
        if nemotron:
            h = h + x
            continue
        h = h + x * m
        h = h + granite_ffn(cfg, layer, norm(h, layer["post_norm"], eps), impl, mesh) * m
    h = jnp.take(h, batch.logits_indices, axis=0)
    logits = norm(h, params["final_norm"], eps) @ params["lm_head"]
    if cfg.logits_scaling != 1.0:
        logits = logits / cfg.logits_scaling
    pools = pools.replace(k_pages=tuple(k_pages), v_pages=tuple(v_pages), conv=tuple(conv),
                          ssm=tuple(ssm))
    return pools, logits.astype(jnp.float32)
