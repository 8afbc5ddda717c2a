"""Named model configurations: tiny seeded-random ones and the published models' real sizes.

``tiny_qwen3_next`` is the embedded default: 4 layers in the 3:1 linear:full pattern, GQA,
partial RoPE, a sparse MoE with a sigmoid-gated shared expert on every layer. The tiny presets
(``PRESETS``) are small enough that a CPU step takes milliseconds.

Real-size presets (``REAL_PRESETS``: ``qwen3_next_80b_a3b``, ``nemotron_h_47b``,
``kimi_linear_48b_a3b``, ...) are the published ``config.json`` files stored in
``models/hf_configs/<name>.json``, parsed by ``ModelConfig.from_hf_config`` exactly as a
checkpoint directory would be. They are for sizing (``models/sizes.py``), the simulator and the
plan command: nothing allocates their weights (a seeded init of 80B parameters is not a test).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

from models.config import ModelConfig

HF_CONFIG_DIR = Path(__file__).parent / "hf_configs"
# name -> the published model it is (its Hugging Face id); the config is hf_configs/<name>.json
REAL_PRESETS: dict[str, str] = {
    "qwen3_next_80b_a3b": "Qwen/Qwen3-Next-80B-A3B-Instruct",
    "qwen3_5_9b": "Qwen/Qwen3.5-9B",
    "qwen3_5_35b_a3b": "Qwen/Qwen3.5-35B-A3B",
    "qwen3_5_122b_a10b": "Qwen/Qwen3.5-122B-A10B",
    "qwen3_5_397b_a17b": "Qwen/Qwen3.5-397B-A17B",
    "nemotron_h_8b": "nvidia/Nemotron-H-8B-Base-8K",
    "nemotron_h_47b": "nvidia/Nemotron-H-47B-Base-8K",
    "nemotron_h_56b": "nvidia/Nemotron-H-56B-Base-8K",
    "nemotron_3_nano_30b_a3b": "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16",
    "granite_4_0_h_micro": "ibm-granite/granite-4.0-h-micro",
    "granite_4_0_h_tiny": "ibm-granite/granite-4.0-h-tiny",
    "granite_4_0_h_small": "ibm-granite/granite-4.0-h-small",
    "kimi_linear_48b_a3b": "moonshotai/Kimi-Linear-48B-A3B-Instruct",
}

_PATTERN = ("linear_attention", "linear_attention", "linear_attention", "full_attention")

_COMMON = dict(
    vocab_size=512,
    hidden_size=64,
    layer_types=_PATTERN,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    rope_theta=10000.0,
    partial_rotary_factor=0.25,
    rms_norm_eps=1e-6,
    max_position_embeddings=4096,
)

_MOE = dict(
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
)

PRESETS: dict[str, ModelConfig] = {
    "tiny_qwen3_next": ModelConfig(family="qwen3_next", mlp_types=("moe",) * 4, **_MOE,
                                   norm_topk_prob=True, **_COMMON),
    "tiny_qwen3_5": ModelConfig(family="qwen3_5", mlp_types=("dense",) * 4, intermediate_size=128,
                                **_COMMON),
    "tiny_qwen3_5_moe": ModelConfig(family="qwen3_5_moe", mlp_types=("moe",) * 4, **_MOE,
                                    **_COMMON),
}
# Head counts divisible by 4 (tensor parallel 2 and 4 on forced CPU devices: tests, scripts).
PRESETS["tiny_qwen3_next_tp4"] = dataclasses.replace(
    PRESETS["tiny_qwen3_next"], num_attention_heads=8, num_key_value_heads=4,
    linear_num_key_heads=4, linear_num_value_heads=8)

# Mamba2 hybrids (models/families/mamba2_common.py): linear_* hold the Mamba2 sizes (G=2 groups
# of N=16 state, H=8 heads of P=8), dt clamped as the released configs do. Head, KV-head and expert
# counts divide 4 (TP 2 and 4 on forced CPU devices; at TP 4 each device gets half a group).
_MAMBA2 = dict(vocab_size=512, hidden_size=64, num_attention_heads=8, num_key_value_heads=4,
               head_dim=16, linear_num_key_heads=2, linear_num_value_heads=8,
               linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4,
               max_position_embeddings=4096, **_MOE)
PRESETS["tiny_nemotron_h"] = ModelConfig(  # blocks M E M * M - (Mamba, MoE, attention, MLP)
    family="nemotron_h",
    layer_types=("linear_attention", "none", "linear_attention", "full_attention",
                 "linear_attention", "none"),
    mlp_types=("none", "moe", "none", "none", "none", "dense"), intermediate_size=96,
    n_group=2, topk_group=1, routed_scaling_factor=1.5, time_step_limit=(0.001, float("inf")),
    use_rope=False, partial_rotary_factor=1.0, rms_norm_eps=1e-5, **_MAMBA2)
PRESETS["tiny_granite_4_h"] = ModelConfig(  # M M * M, MoE + shared SwiGLU, muP multipliers
    family="granitemoehybrid", layer_types=_PATTERN[:2] + ("full_attention", "linear_attention"),
    mlp_types=("moe",) * 4, intermediate_size=32, use_rope=False, partial_rotary_factor=1.0,
    embedding_multiplier=0.5, residual_multiplier=0.8, attention_multiplier=0.0625,
    logits_scaling=2.0, tie_word_embeddings=True, rms_norm_eps=1e-6, **_MAMBA2)

# Kimi Linear (models/families/kimi_linear.py): KDA x3 + MLA (NoPE, latent 32 + shared key 8
# per token), first MLP dense, then DeepSeek-style MoE (4 groups of 2 experts, top-2 groups,
# top-2). KDA conv channels 3 * 4 * 32 = 384, a multiple of 128 (the TPU conv prefill needs
# one above 128).
PRESETS["tiny_kimi_linear"] = ModelConfig(
    family="kimi_linear", vocab_size=512, hidden_size=64, layer_types=_PATTERN,
    mlp_types=("dense", "moe", "moe", "moe"), num_attention_heads=4, num_key_value_heads=4,
    head_dim=24, linear_num_key_heads=4, linear_num_value_heads=4, linear_key_head_dim=32,
    linear_value_head_dim=32, linear_conv_kernel_dim=4, intermediate_size=128,
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
    shared_expert_intermediate_size=32, kv_lora_rank=32, qk_nope_head_dim=16,
    qk_rope_head_dim=8, v_head_dim=16, n_group=4, topk_group=2, routed_scaling_factor=2.446,
    rms_norm_eps=1e-5, max_position_embeddings=4096)


def hf_config(name: str) -> dict:
    """The stored ``config.json`` dict of the real-size preset ``name``."""
    if name not in REAL_PRESETS:
        raise ValueError(f"unknown real-size preset {name!r}; known: {sorted(REAL_PRESETS)}")
    return json.loads((HF_CONFIG_DIR / f"{name}.json").read_text())


@functools.cache
def _real_preset(name: str) -> ModelConfig:
    return ModelConfig.from_hf_config(hf_config(name))


def is_real_preset(name: str) -> bool:
    """Whether ``name`` is a published model's size (weights never initialised)."""
    return name in REAL_PRESETS


def get_preset(name: str) -> ModelConfig:
    """The preset ``name`` (tiny or real-size); a ``ValueError`` lists the known names
    otherwise."""
    if name in PRESETS:
        return PRESETS[name]
    if name in REAL_PRESETS:
        return _real_preset(name)
    raise ValueError(f"unknown model preset {name!r}; known: {sorted(PRESETS)} and the "
                     f"real-size {sorted(REAL_PRESETS)}")
