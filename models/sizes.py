"""Byte sizes of a model without allocating it: weights, one state slot, one token of KV.

The engine's sizing code, the plan command and the simulator read these for any config (a tiny
preset, a real-size preset of ``models/hf_configs/``, or a checkpoint's ``config.json``); nothing
here creates a device buffer. Invariants, shared with ``mambacache/engine/runners/pools.py``:

* a state slot is, per linear layer, the conv window ``[K - 1, C]`` in the model dtype plus the
  recurrent state ``[Hv, Dk, Dv]`` in float32 (Gated DeltaNet, KDA and Mamba2 alike);
* one token of KV is, per attention layer, ``kv_arrays_per_layer`` rows of ``kv_row_shape``
  (K and V, or MLA's one latent row) in the model dtype;
* weights are the leaves of ``models.params.param_shapes`` in the model dtype (a tied
  ``lm_head`` is its own array in this layout, so it counts).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from models.config import ModelConfig
from models.params import param_shapes


def _is_shape(x: Any) -> bool:
    return isinstance(x, tuple) and all(isinstance(d, int) for d in x)


def abstract_params(cfg: ModelConfig, dtype: Any = jnp.bfloat16) -> Any:
    """The parameter pytree as ``jax.ShapeDtypeStruct`` leaves (no memory): what ``jax.jit(...)
    .lower`` and ``jax.eval_shape`` take in place of real weights."""
    return jax.tree_util.tree_map(lambda s: jax.ShapeDtypeStruct(s, jnp.dtype(dtype)),
                                  param_shapes(cfg), is_leaf=_is_shape)


def num_params(cfg: ModelConfig) -> int:
    """Parameter count of the layout (the tied ``lm_head`` copy included)."""
    leaves = jax.tree_util.tree_leaves(param_shapes(cfg), is_leaf=_is_shape)
    return sum(math.prod(s) for s in leaves)


def state_bytes_per_slot(cfg: ModelConfig, dtype: Any = jnp.bfloat16) -> int:
    """Bytes one state slot takes over all linear layers (conv window + float32 state)."""
    conv = (cfg.linear_conv_kernel_dim - 1) * cfg.linear_conv_dim * jnp.dtype(dtype).itemsize
    ssm = (cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim
           * jnp.dtype(jnp.float32).itemsize)
    return cfg.num_linear_layers * (conv + ssm)


def kv_bytes_per_token(cfg: ModelConfig, dtype: Any = jnp.bfloat16) -> int:
    """Bytes one cached token takes over all attention layers (MLA: its latent row)."""
    return cfg.kv_values_per_token * jnp.dtype(dtype).itemsize


@dataclasses.dataclass(frozen=True)
class ModelSizes:
    """What sizing needs of a model in one dtype (all in bytes, ``num_params`` a count)."""

    num_params: int
    weight_bytes: int
    state_bytes: int
    kv_bytes_per_token: int

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


def model_sizes(cfg: ModelConfig, dtype: Any = jnp.bfloat16) -> ModelSizes:
    """``ModelSizes`` of ``cfg`` with weights, conv windows and KV in ``dtype``."""
    count = num_params(cfg)
    return ModelSizes(num_params=count, weight_bytes=count * jnp.dtype(dtype).itemsize,
                      state_bytes=state_bytes_per_slot(cfg, dtype),
                      kv_bytes_per_token=kv_bytes_per_token(cfg, dtype))
