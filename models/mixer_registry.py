"""The mixers by layer kind: one ``Mixer`` per kind of token mixer, the forward loop's only way
to call one.

A mixer kind owns its parameter dict (``param_key`` in a layer's params) and a kind of pool row:
``"state"`` mixers (Gated DeltaNet, Mamba2, KDA) read and write one conv and one SSM slot array
of their linear layer, ``"kv"`` mixers (gated attention, plain attention) the K and V pages of
their attention layer, ``"latent"`` mixers (MLA) its one latent page array. Every call takes and
returns those arrays as a tuple, so ``models/model.py`` walks the layers with one loop whatever
the family (a family maps its ``layer_types`` to mixer kinds: ``Family.mixers``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh

from models.config import ModelConfig
from models.kda import kimi_delta_attention
from models.mamba2 import mamba2_mixer
from models.mamba2_blocks import plain_attention
from models.mixers import full_attention, gated_delta_net
from models.mla import mla_attention_layer

POOLS = ("state", "kv", "latent")


@dataclasses.dataclass(frozen=True)
class Mixer:
    """``fn`` has the signature of its pool kind: state ``(cfg, p, x, conv, ssm, batch, *,
    decode, impl, mesh) -> (x, conv, ssm)``; kv ``(cfg, p, x, k, v, batch, *, impl, mesh) ->
    (x, k, v)``; latent ``(cfg, p, x, latent, batch, *, impl, mesh) -> (x, latent)``."""

    name: str
    param_key: str
    pool: str
    fn: Callable[..., tuple[jax.Array, ...]]

    def __post_init__(self):
        if self.pool not in POOLS:
            raise ValueError(f"mixer {self.name}: pool must be one of {POOLS}, got {self.pool!r}")

    def __call__(self, cfg: ModelConfig, layer: dict[str, Any], x: jax.Array,
                 arrays: tuple[jax.Array, ...], batch: Any, *, decode: bool, impl: str,
                 mesh: Mesh | None) -> tuple[jax.Array, tuple[jax.Array, ...]]:
        """Run on ``layer[param_key]``; ``arrays``: this layer's pool arrays (conv, ssm / k, v /
        latent). Returns the mixer output and the updated arrays."""
        p = layer[self.param_key]
        if self.pool == "state":
            out, *new = self.fn(cfg, p, x, *arrays, batch, decode=decode, impl=impl, mesh=mesh)
        else:
            out, *new = self.fn(cfg, p, x, *arrays, batch, impl=impl, mesh=mesh)
        return out, tuple(new)


MIXERS: dict[str, Mixer] = {m.name: m for m in (
    Mixer("gated_delta_net", "gdn", "state", gated_delta_net),
    Mixer("mamba2", "mamba", "state", mamba2_mixer),
    Mixer("kda", "kda", "state", kimi_delta_attention),
    Mixer("gated_attention", "attn", "kv", full_attention),
    Mixer("attention", "attn", "kv", plain_attention),
    Mixer("mla", "mla", "latent", mla_attention_layer),
)}
