"""``ModelConfig``: the architecture of a hybrid model, validated; one frozen dataclass for
every family of ``models/families/`` (Qwen3-Next, Qwen3.5, Qwen3.5-MoE, Kimi Linear,
Nemotron-H, Granite 4.0-H).

``family`` names the registered family that parsed the config (``from_hf_config``) and checks
its own rules (``Family.validate``); the rules here hold for every family. Derived sizes (pool
rows, conv widths) are properties read by the pools, the tensor-parallel specs and the model.
Field names follow the Hugging Face config keys; the Mamba2 families keep their sizes in the
linear_* fields (``models/families/mamba2_common.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from models.family_registry import detect_family, get_family

LAYER_TYPES = ("linear_attention", "full_attention", "none")  # none: Nemotron-H MLP-only blocks


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters (names follow the Hugging Face config keys).

    ``layer_types[i]`` is ``"linear_attention"`` (the family's linear mixer: Gated DeltaNet,
    KDA or Mamba2), ``"full_attention"`` (attention or MLA) or ``"none"``; ``mlp_types[i]`` is
    ``"moe"``, ``"dense"`` or ``"none"`` (which combinations are legal is the family's rule).
    """

    family: str
    vocab_size: int
    hidden_size: int
    layer_types: tuple[str, ...]
    mlp_types: tuple[str, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int = 4
    intermediate_size: int = 0
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.25
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    # Kimi Linear (``models/families/kimi_linear.py``): MLA dims (0 = no MLA) and DeepSeek-style
    # routing.
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    # Mamba2 hybrids (``models/families/mamba2_common.py``): dt clamp, optional RoPE, Granite
    # multipliers (attention_multiplier 0 = head_dim ** -0.5; logits are divided by logits_scaling).
    time_step_limit: tuple[float, float] = (0.0, float("inf"))
    use_rope: bool = True
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float = 0.0
    logits_scaling: float = 1.0
    # Multi-token prediction head (``models/mtp.py``): MTP layers the params carry (0 or 1;
    # Qwen3-Next / Qwen3.5 families), the speculative ``mtp`` drafter's model.
    num_mtp_layers: int = 0
    # Serving numerics, not architecture: ``model.deterministic`` (every row reduction in a fixed
    # order, ``pallas_kernels/fixed_order.py``); the engine sets it, checkpoints never do.
    deterministic: bool = False

    def __post_init__(self):
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        object.__setattr__(self, "mlp_types", tuple(self.mlp_types))
        object.__setattr__(self, "time_step_limit", tuple(float(v) for v in self.time_step_limit))
        family = self.model_family  # ValueError for an unknown name
        for name in ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads",
                     "head_dim", "linear_num_key_heads", "linear_num_value_heads",
                     "linear_key_head_dim", "linear_value_head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            _require(isinstance(value, int) and value > 0,
                     f"{name} must be a positive int, got {value!r}")
        _require(len(self.layer_types) > 0, "layer_types must not be empty")
        bad = [t for t in self.layer_types if t not in LAYER_TYPES]
        _require(not bad, f"layer_types entries must be in {LAYER_TYPES}, got {bad}")
        _require(len(self.mlp_types) == len(self.layer_types),
                 f"mlp_types has {len(self.mlp_types)} entries, layer_types "
                 f"{len(self.layer_types)}")
        bad = [t for t in self.mlp_types if t not in ("moe", "dense", "none")]
        _require(not bad, f"mlp_types entries must be 'moe', 'dense' or 'none', got {bad}")
        _require(self.num_attention_heads % self.num_key_value_heads == 0,
                 f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                 f"num_key_value_heads ({self.num_key_value_heads})")
        _require(self.linear_num_value_heads % self.linear_num_key_heads == 0,
                 f"linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of "
                 f"linear_num_key_heads ({self.linear_num_key_heads})")
        _require(isinstance(self.linear_conv_kernel_dim, int) and self.linear_conv_kernel_dim >= 2,
                 f"linear_conv_kernel_dim must be an int >= 2, got {self.linear_conv_kernel_dim!r}")
        _require(self.rms_norm_eps > 0, f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if "dense" in self.mlp_types:
            _require(self.intermediate_size > 0,
                     f"intermediate_size must be > 0 for dense MLP layers, "
                     f"got {self.intermediate_size}")
        if "moe" in self.mlp_types:
            _require(self.num_experts > 0 and self.moe_intermediate_size > 0
                     and self.shared_expert_intermediate_size > 0,
                     "MoE layers need num_experts, moe_intermediate_size and "
                     "shared_expert_intermediate_size > 0, got "
                     f"{self.num_experts}, {self.moe_intermediate_size}, "
                     f"{self.shared_expert_intermediate_size}")
            _require(0 < self.num_experts_per_tok <= self.num_experts,
                     f"num_experts_per_tok must be in [1, num_experts={self.num_experts}], "
                     f"got {self.num_experts_per_tok}")
        _require(self.num_mtp_layers in (0, 1),
                 f"num_mtp_layers must be 0 or 1, got {self.num_mtp_layers!r}")
        _require(not self.num_mtp_layers or family.supports_mtp,
                 f"an MTP head is not supported for {self.family}")
        family.validate(self)

    @property
    def model_family(self) -> Any:
        """The ``models.families.Family`` object of ``family`` (its parsing, layout, loader
        names and blocks)."""
        return get_family(self.family)

    # ---- derived sizes (the pools and the model read these) ----
    @property
    def num_hidden_layers(self) -> int:
        return len(self.layer_types)

    @property
    def num_full_layers(self) -> int:
        return sum(t == "full_attention" for t in self.layer_types)

    @property
    def num_linear_layers(self) -> int:
        return sum(t == "linear_attention" for t in self.layer_types)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def kv_row_shape(self) -> tuple[int, int]:
        """(heads, dim) of one token's row in a KV page array: ``(Hkv, head_dim)``, or for MLA
        one latent row ``(1, kv_lora_rank + qk_rope_head_dim)``."""
        if self.kv_lora_rank:
            return 1, self.kv_lora_rank + self.qk_rope_head_dim
        return self.num_key_value_heads, self.head_dim

    @property
    def kv_values_per_token(self) -> int:
        """KV pool values one token takes over all full-attention layers (MLA: its latent row)."""
        heads, dim = self.kv_row_shape
        return self.num_full_layers * self.kv_arrays_per_layer * heads * dim

    @property
    def kv_values_per_token_expanded(self) -> int:
        """What per-head K and V would take instead (MLA: ``Hq * (dn + dr + dv)`` per layer)."""
        if not self.kv_lora_rank:
            return self.kv_values_per_token
        return self.num_full_layers * self.num_attention_heads * (self.head_dim + self.v_head_dim)

    @property
    def kv_arrays_per_layer(self) -> int:
        """Page arrays per full-attention layer: 2 (K and V), or 1 for MLA (the latent)."""
        return 1 if self.kv_lora_rank else 2

    @property
    def linear_key_dim(self) -> int:
        """Hk * Dk: width of the q (and of the k) part of the conv input."""
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        """Hv * Dv: width of the v part of the conv input, of z and of the GDN output."""
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_conv_dim(self) -> int:
        """Conv channels C = 2 * Hk * Dk + Hv * Dv (q, k, v in that order)."""
        return 2 * self.linear_key_dim + self.linear_value_dim

    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any]) -> ModelConfig:
        """Build from a Hugging Face ``config.json`` dict; the family (``models/families/``)
        reads its own keys (a VL config's ``text_config``, transformers' JSON quirks)."""
        return cls(**detect_family(hf).config_fields(hf))
