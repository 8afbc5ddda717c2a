"""``ModelConfig``: the architecture of a Qwen3-Next / Qwen3.5 hybrid model, validated.

One frozen dataclass covers the three Hugging Face families this package serves:

* ``qwen3_next``  (``Qwen3NextForCausalLM``): packed ``in_proj_qkvz`` / ``in_proj_ba`` grouped per
  key head, sparse MoE with a sigmoid-gated shared expert (dense MLP on ``mlp_only_layers``).
* ``qwen3_5``     (``Qwen3_5ForCausalLM``, text): separate ``in_proj_qkv/z/b/a``, dense MLP.
* ``qwen3_5_moe`` (``Qwen3_5MoeForCausalLM``, text): separate projections, MoE on every layer.

The parameter layout inside this package is the same for all three (see ``models/params.py``);
only the checkpoint loader cares about the family.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "kimi_linear", "nemotron_h",
            "granitemoehybrid")
MTP_FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_moe")  # models/mtp.py
LAYER_TYPES = ("linear_attention", "full_attention", "none")  # none: Nemotron-H MLP-only blocks

_ARCH_TO_FAMILY = {
    "Qwen3NextForCausalLM": "qwen3_next",
    "Qwen3_5ForCausalLM": "qwen3_5",
    "Qwen3_5ForConditionalGeneration": "qwen3_5",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe",
    "KimiLinearForCausalLM": "kimi_linear",
    "NemotronHForCausalLM": "nemotron_h",
    "GraniteMoeHybridForCausalLM": "granitemoehybrid",
}
_MODEL_TYPE_TO_FAMILY = {
    "qwen3_next": "qwen3_next",
    "qwen3_5": "qwen3_5",
    "qwen3_5_text": "qwen3_5",
    "qwen3_5_moe": "qwen3_5_moe",
    "qwen3_5_moe_text": "qwen3_5_moe",
    "kimi_linear": "kimi_linear",
    "nemotron_h": "nemotron_h",
    "granitemoehybrid": "granitemoehybrid",
}


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters (names follow the Hugging Face config keys).

    ``mlp_types[i]`` is ``"moe"`` or ``"dense"`` for decoder layer ``i``; ``layer_types[i]`` is
    ``"linear_attention"`` (Gated DeltaNet) or ``"full_attention"``.
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
    # Kimi Linear (``models/kimi_config.py``): MLA dims (0 = no MLA) and DeepSeek-style routing.
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    # Mamba2 hybrids (``models/mamba2_config.py``): dt clamp, optional RoPE, Granite multipliers
    # (attention_multiplier 0 = head_dim ** -0.5; logits are divided by logits_scaling).
    time_step_limit: tuple[float, float] = (0.0, float("inf"))
    use_rope: bool = True
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float = 0.0
    logits_scaling: float = 1.0
    # Multi-token prediction head (``models/mtp.py``): MTP layers the params carry (0 or 1;
    # Qwen3-Next / Qwen3.5 families), the speculative ``mtp`` drafter's model.
    num_mtp_layers: int = 0

    def __post_init__(self):
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        object.__setattr__(self, "mlp_types", tuple(self.mlp_types))
        object.__setattr__(self, "time_step_limit", tuple(float(v) for v in self.time_step_limit))
        _require(self.family in FAMILIES, f"family must be one of {FAMILIES}, got {self.family!r}")
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
        if self.use_rope and not self.kv_lora_rank:  # MLA (Kimi Linear) is NoPE
            rot = self.rotary_dim
            _require(0 < rot <= self.head_dim and rot % 2 == 0,
                     f"rotary dim head_dim * partial_rotary_factor = {rot} must be even and in "
                     f"(0, head_dim={self.head_dim}]")
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
        _require(not self.num_mtp_layers or self.family in MTP_FAMILIES,
                 f"an MTP head is supported for {MTP_FAMILIES}, not {self.family}")
        if self.family == "kimi_linear":
            from models.kimi_config import validate_kimi
            validate_kimi(self)
        if self.family in ("nemotron_h", "granitemoehybrid"):
            from models.mamba2_config import validate_mamba2
            validate_mamba2(self)
        else:
            _require("none" not in self.layer_types + self.mlp_types,
                     f"'none' layer or MLP types are for nemotron_h only, not {self.family}")

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
        """Build from a Hugging Face ``config.json`` dict (a VL config uses its ``text_config``)."""
        family = _family(hf)
        if family == "kimi_linear":
            from models.kimi_config import kimi_from_hf
            return kimi_from_hf(cls, hf)
        if family in ("nemotron_h", "granitemoehybrid"):
            from models.mamba2_config import mamba2_from_hf
            return mamba2_from_hf(cls, hf, family)
        if "text_config" in hf and isinstance(hf["text_config"], Mapping):
            text = hf["text_config"]
            tied = text.get("tie_word_embeddings", hf.get("tie_word_embeddings", False))
            hf = {**text, "tie_word_embeddings": tied}
        act = hf.get("hidden_act", "silu")
        _require(act == "silu", f"hidden_act must be 'silu', got {act!r}")
        _require(not hf.get("attention_bias", False), "attention_bias=True is not supported")
        num_layers = int(hf["num_hidden_layers"])
        layer_types = hf.get("layer_types") or [
            "full_attention" if (i + 1) % int(hf.get("full_attention_interval", 4)) == 0
            else "linear_attention" for i in range(num_layers)]
        layer_types = list(layer_types)[:num_layers]
        theta, partial = _rope(hf)
        heads = int(hf["num_attention_heads"])
        common = dict(
            family=family, vocab_size=int(hf["vocab_size"]), hidden_size=int(hf["hidden_size"]),
            layer_types=tuple(layer_types), mlp_types=_mlp_types(family, hf, num_layers),
            num_attention_heads=heads, num_key_value_heads=int(hf["num_key_value_heads"]),
            head_dim=int(hf.get("head_dim") or int(hf["hidden_size"]) // heads),
            linear_num_key_heads=int(hf["linear_num_key_heads"]),
            linear_num_value_heads=int(hf["linear_num_value_heads"]),
            linear_key_head_dim=int(hf["linear_key_head_dim"]),
            linear_value_head_dim=int(hf["linear_value_head_dim"]),
            linear_conv_kernel_dim=int(hf.get("linear_conv_kernel_dim", 4)),
            rope_theta=theta, partial_rotary_factor=partial,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 32768)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            intermediate_size=int(hf.get("intermediate_size") or 0),
        )
        if family != "qwen3_5":
            common.update(
                num_experts=int(hf["num_experts"]),
                num_experts_per_tok=int(hf["num_experts_per_tok"]),
                moe_intermediate_size=int(hf["moe_intermediate_size"]),
                shared_expert_intermediate_size=int(hf["shared_expert_intermediate_size"]),
                norm_topk_prob=bool(hf.get("norm_topk_prob", True)) if family == "qwen3_next"
                else True,
            )
        return cls(**common)


def _family(hf: Mapping[str, Any]) -> str:
    for arch in hf.get("architectures") or []:
        if arch in _ARCH_TO_FAMILY:
            return _ARCH_TO_FAMILY[arch]
    model_type = hf.get("model_type")
    if model_type in _MODEL_TYPE_TO_FAMILY:
        return _MODEL_TYPE_TO_FAMILY[model_type]
    raise ValueError(
        f"unsupported Hugging Face config: architectures={hf.get('architectures')!r}, "
        f"model_type={model_type!r}; supported: {sorted(_ARCH_TO_FAMILY)}")


def _rope(hf: Mapping[str, Any]) -> tuple[float, float]:
    """(rope_theta, partial_rotary_factor) from ``rope_parameters`` or the legacy top-level keys."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    _require(rope_type == "default", f"only default RoPE is supported, got {rope_type!r}")
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    partial = float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25)))
    return theta, partial


def _mlp_types(family: str, hf: Mapping[str, Any], num_layers: int) -> tuple[str, ...]:
    if family == "qwen3_5":
        return ("dense",) * num_layers
    if family == "qwen3_5_moe":
        return ("moe",) * num_layers
    only = set(hf.get("mlp_only_layers") or [])
    step = int(hf.get("decoder_sparse_step", 1))
    experts = int(hf.get("num_experts", 0))
    return tuple("moe" if i not in only and experts > 0 and (i + 1) % step == 0 else "dense"
                 for i in range(num_layers))
