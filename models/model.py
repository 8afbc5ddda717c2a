"""The serving forward pass: ``forward(params, pools, batch, *, cfg, kernels, decode, mesh)``.

Jittable with the pools donated::

    step = jax.jit(partial(forward, cfg=cfg, kernels="auto", decode=False), donate_argnums=(1,))
    pools, logits = step(params, pools, batch)

``pools`` is duck-typed ``mambacache.engine.pools.PoolState`` (tuples ``k_pages``/``v_pages``
per full layer, ``conv``/``ssm`` per linear layer, in layer order; updated with
``pools.replace``) and ``batch`` a ``mambacache.engine.batch.ForwardBatch``. This module does
not import ``mambacache``.
``mesh`` (static; tensor parallel): the ``jax.sharding.Mesh`` the params and pools are sharded
over, or None for one device; the kernel ops and the routed experts of the MoE then run per
device inside ``shard_map``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from models.config import ModelConfig
from models.kda import kimi_delta_attention
from models.layers import rms_norm, rms_norm_plain, swiglu
from models.mamba2_model import mamba2_forward
from models.mixers import full_attention, gated_delta_net
from models.mla import mla_attention_layer
from models.moe import moe_dense_reference, moe_grouped
from pallas_kernels import ops

KERNELS = ("pallas", "reference", "auto")


def mlp_block(cfg: ModelConfig, layer: dict[str, Any], x: jax.Array, impl: str,
         mesh: Mesh | None) -> jax.Array:
    """Dense SwiGLU, or the MoE: grouped (``ragged_dot``, cost ~ T * k) with the Pallas kernels
    (GPU/TPU), the dense form (every expert on every token) with the references: on CPU
    ``ragged_dot`` lowers to a masked dense product that costs E / k times more (``docs/model.md``).
    """
    if "moe" in layer:
        routing = {"groups": (cfg.n_group, cfg.topk_group), "scale": cfg.routed_scaling_factor}
        if impl == "reference":
            return moe_dense_reference(x, layer["moe"], cfg.num_experts_per_tok,
                                       cfg.norm_topk_prob, **routing)
        return moe_grouped(x, layer["moe"], cfg.num_experts_per_tok, cfg.norm_topk_prob,
                           mesh=mesh, **routing)
    return swiglu(x, layer["mlp"]["gate_up"], layer["mlp"]["down"])


def forward(params: dict[str, Any], pools: Any, batch: Any, *, cfg: ModelConfig,
            kernels: str = "auto", decode: bool = False, mesh: Mesh | None = None,
            return_hidden: bool = False) -> tuple[Any, ...]:
    """Run one step over the packed batch; returns (updated pools, logits ``[L, V]`` float32),
    and with ``return_hidden`` the final-normed hidden state of every packed token ``[T, H]``
    (the input of the MTP head, ``models/mtp.py``; Qwen3-Next / Qwen3.5 families).

    Logits are taken at ``batch.logits_indices``. ``decode=True`` requires one token per
    sequence (``T == B``) and uses the single-step recurrent/conv ops. ``mesh``: see the module
    docstring (its ``"tp"`` axis splits heads; None = one device).
    """
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {KERNELS}, got {kernels!r}")
    impl = ops.resolve_impl(kernels)
    if decode and batch.input_ids.shape[0] != batch.read_slot.shape[0]:
        raise ValueError(f"decode needs one token per sequence: {batch.input_ids.shape[0]} tokens, "
                         f"{batch.read_slot.shape[0]} sequences")
    if cfg.family in ("nemotron_h", "granitemoehybrid"):  # models/mamba2_model.py
        return mamba2_forward(params, pools, batch, cfg=cfg, impl=impl, decode=decode, mesh=mesh)
    k_pages, v_pages = list(pools.k_pages), list(pools.v_pages)
    conv, ssm = list(pools.conv), list(pools.ssm)
    h = jnp.take(params["embed"], batch.input_ids, axis=0)
    norm = rms_norm_plain if cfg.family == "kimi_linear" else rms_norm
    full_i = linear_i = 0
    for kind, layer in zip(cfg.layer_types, params["layers"], strict=True):
        x = norm(h, layer["input_norm"], cfg.rms_norm_eps)
        if "kda" in layer:
            x, conv[linear_i], ssm[linear_i] = kimi_delta_attention(
                cfg, layer["kda"], x, conv[linear_i], ssm[linear_i], batch, decode=decode,
                impl=impl, mesh=mesh)
            linear_i += 1
        elif "mla" in layer:
            x, k_pages[full_i] = mla_attention_layer(cfg, layer["mla"], x, k_pages[full_i],
                                                     batch, impl=impl, mesh=mesh)
            full_i += 1
        elif kind == "linear_attention":
            x, conv[linear_i], ssm[linear_i] = gated_delta_net(
                cfg, layer["gdn"], x, conv[linear_i], ssm[linear_i], batch, decode=decode,
                impl=impl, mesh=mesh)
            linear_i += 1
        else:
            x, k_pages[full_i], v_pages[full_i] = full_attention(
                cfg, layer["attn"], x, k_pages[full_i], v_pages[full_i], batch, impl=impl,
                mesh=mesh)
            full_i += 1
        h = h + x
        h = h + mlp_block(cfg, layer, norm(h, layer["post_norm"], cfg.rms_norm_eps), impl, mesh)
    pools = pools.replace(k_pages=tuple(k_pages), v_pages=tuple(v_pages), conv=tuple(conv),
                          ssm=tuple(ssm))
    if return_hidden:  # the same row-wise norm as below, on every token
        hidden = norm(h, params["final_norm"], cfg.rms_norm_eps)
        logits = jnp.take(hidden, batch.logits_indices, axis=0) @ params["lm_head"]
        return pools, logits.astype(jnp.float32), hidden
    h = jnp.take(h, batch.logits_indices, axis=0)
    logits = (norm(h, params["final_norm"], cfg.rms_norm_eps) @ params["lm_head"])
    return pools, logits.astype(jnp.float32)
