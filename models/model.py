"""The serving forward pass: ``forward(params, pools, batch, *, cfg, kernels, decode, mesh)``.

Jittable with the pools donated::

    step = jax.jit(partial(forward, cfg=cfg, kernels="auto", decode=False), donate_argnums=(1,))
    pools, logits = step(params, pools, batch)

One loop for every family: each layer's mixer comes from the family's ``mixers`` (a
``models.mixer_registry.Mixer`` per layer type), its norms and feed-forward from the family too
(``models/families/base.py`` states the block structure).
``pools`` is duck-typed ``mambacache.engine.runners.pools.PoolState`` (tuples
``k_pages``/``v_pages`` per full layer, ``conv``/``ssm`` per linear layer, in layer order; updated
with ``pools.replace``) and ``batch`` a ``mambacache.engine.step.batch.ForwardBatch``. This module
does not import ``mambacache``.
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
from models.moe import mlp_block  # noqa: F401  (re-exported: the Qwen / Kimi feed-forward)
from models.precision import exact_matmuls
from pallas_kernels import ops

KERNELS = ("pallas", "reference", "auto")


def _residual(h: jax.Array, x: jax.Array, multiplier: float) -> jax.Array:
    return h + (x if multiplier == 1.0 else x * multiplier)


def _layers(cfg: ModelConfig, params: dict[str, Any], pools: Any, h: jax.Array, batch: Any, *,
            impl: str, decode: bool, mesh: Mesh | None) -> tuple[jax.Array, Any]:
    """Every decoder layer in order (``Family``'s block structure); returns (h, pools). Linear
    layers take the conv / ssm slots in order, attention layers the KV (or latent) pages."""
    family, eps, m = cfg.model_family, cfg.rms_norm_eps, cfg.residual_multiplier
    fixed = cfg.deterministic  # [deterministic] row reductions in a fixed order
    k_pages, v_pages = list(pools.k_pages), list(pools.v_pages)
    conv, ssm = list(pools.conv), list(pools.ssm)
    full_i = linear_i = 0
    for kind, mlp, layer in zip(cfg.layer_types, cfg.mlp_types, params["layers"], strict=True):
        if kind != "none":
            mixer = family.mixers[kind]
            x = family.norm(h, layer["input_norm"], eps, fixed_order=fixed)
            if mixer.pool == "state":
                i, arrays = linear_i, (conv[linear_i], ssm[linear_i])
                linear_i += 1
            else:
                i, arrays = full_i, (k_pages[full_i],) + (
                    (v_pages[full_i],) if mixer.pool == "kv" else ())
                full_i += 1
            x, arrays = mixer(cfg, layer, x, arrays, batch, decode=decode, impl=impl, mesh=mesh)
            if mixer.pool == "state":
                conv[i], ssm[i] = arrays
            else:
                k_pages[i] = arrays[0]
                if mixer.pool == "kv":
                    v_pages[i] = arrays[1]
            h = _residual(h, x, m)
        if mlp != "none":
            w = layer["post_norm" if "post_norm" in layer else "input_norm"]
            x = family.norm(h, w, eps, fixed_order=fixed)
            h = _residual(h, family.ffn(cfg, layer, x, impl, mesh), m)
    return h, pools.replace(k_pages=tuple(k_pages), v_pages=tuple(v_pages), conv=tuple(conv),
                            ssm=tuple(ssm))


def forward(params: dict[str, Any], pools: Any, batch: Any, *, cfg: ModelConfig,
            kernels: str = "auto", decode: bool = False, mesh: Mesh | None = None,
            return_hidden: bool = False) -> tuple[Any, ...]:
    """Run one step over the packed batch; returns (updated pools, logits ``[L, V]`` float32),
    and with ``return_hidden`` the final-normed hidden state of every packed token ``[T, H]``
    (the input of the MTP head, ``models/mtp.py``; Qwen3-Next / Qwen3.5 families).
    Float32 weights compute at HIGHEST matmul precision on every backend (no TF32 on a GPU;
    ``models/precision.py``); other dtypes at the backend's default.

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
    with exact_matmuls(params["embed"].dtype):  # float32 means float32 (models/precision.py)
        return _forward(params, pools, batch, cfg, impl, decode, mesh, return_hidden)


def _forward(params: dict[str, Any], pools: Any, batch: Any, cfg: ModelConfig, impl: str,
             decode: bool, mesh: Mesh | None, return_hidden: bool) -> tuple[Any, ...]:
    eps = cfg.rms_norm_eps

    def norm(x: jax.Array, w: jax.Array) -> jax.Array:  # [deterministic] fixed order if asked
        return cfg.model_family.norm(x, w, eps, fixed_order=cfg.deterministic)

    h = jnp.take(params["embed"], batch.input_ids, axis=0)
    if cfg.embedding_multiplier != 1.0:
        h = h * cfg.embedding_multiplier
    h, pools = _layers(cfg, params, pools, h, batch, impl=impl, decode=decode, mesh=mesh)
    if return_hidden:  # the same row-wise norm as below, on every token
        hidden = norm(h, params["final_norm"])
        logits = jnp.take(hidden, batch.logits_indices, axis=0) @ params["lm_head"]
    else:
        h = jnp.take(h, batch.logits_indices, axis=0)
        logits = norm(h, params["final_norm"]) @ params["lm_head"]
    if cfg.logits_scaling != 1.0:
        logits = logits / cfg.logits_scaling
    logits = logits.astype(jnp.float32)
    return (pools, logits, hidden) if return_hidden else (pools, logits)
