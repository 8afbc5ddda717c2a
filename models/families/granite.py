"""IBM Granite 4.0-H (``GraniteMoeHybridForCausalLM``): Mamba2 + attention, MoE with a shared
SwiGLU (or the shared SwiGLU alone without experts), muP multipliers.

Every layer is a mixer (``layer_types``: ``mamba`` / ``attention``) plus the feed-forward:
``moe`` when ``num_local_experts > 0`` (softmax top-k plus the shared MLP), else ``dense`` (the
shared MLP). Residual branches are scaled by ``residual_multiplier``, embeddings by
``embedding_multiplier``, logits divided by ``logits_scaling``; attention's softmax scale is
``attention_multiplier``. RoPE only if ``position_embedding_type == "rope"``. Norms are plain.

Quirk of current transformers: ``time_step_limit`` is saved as ``[0.0, {"__float__":
"Infinity"}]`` (read with ``hf_float``).

Parameters: input_norm, mamba or attn (``mamba2_common.py``), post_norm, and with experts moe
(``models/moe.py``'s layout without a shared gate: router ``[D, E]``, gate_up ``[E, D, 2*Im]``
gate | up, down ``[E, Im, D]``, shared_gate_up ``[D, 2*Is]`` pair-interleaved, shared_down
``[Is, D]``), without experts mlp (the shared SwiGLU alone: gate_up, down). Checkpoint names:
``model.embed_tokens``, ``layers.i.{input_layernorm, post_attention_layernorm, mamba.*,
self_attn.*, shared_mlp.*, block_sparse_moe.*}``, ``model.norm``; experts in the released
checkpoints' names (``input_linear``, ``output_linear``, ``router.layer``) or transformers 5's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from models.families.base import (
    INF,
    Family,
    check_mixer_and_mlp_everywhere,
    default_rope,
    hf_float,
    require,
    unsupported,
)
from models.families.mamba2_common import (
    MIXER_TYPES,
    common_fields,
    load_mamba,
    load_plain_attn,
    mamba_sizes,
    mixer_shapes,
    validate_mamba2,
)
from models.hf_tensors import fused_t
from models.layers import rms_norm_plain
from models.mamba2_blocks import granite_ffn
from models.mixer_registry import MIXERS
from models.safetensors_io import TensorSource

if TYPE_CHECKING:
    from models.config import ModelConfig


def _rope(hf: Mapping[str, Any]) -> dict[str, Any]:
    if hf.get("position_embedding_type") != "rope":
        return dict(use_rope=False, partial_rotary_factor=1.0)
    theta, partial = default_rope(hf, 1.0)
    return dict(use_rope=True, rope_theta=theta, partial_rotary_factor=partial)


def _mamba_head_dim(hf: Mapping[str, Any], d: int, heads: int) -> int:
    inner = int(hf.get("mamba_expand", 2)) * d
    d_head = hf.get("mamba_d_head", "auto")
    d_head = inner // heads if d_head == "auto" else int(d_head)
    require(d_head * heads == inner,
            f"mamba_d_head ({d_head}) * mamba_n_heads ({heads}) must equal "
            f"mamba_expand * hidden_size ({inner})")
    return d_head


def _load_layer(cfg: ModelConfig, src: TensorSource, pre: str, i: int) -> dict[str, Any]:
    d, is_ = cfg.hidden_size, cfg.shared_expert_intermediate_size
    layer: dict[str, Any] = {"input_norm": src.get(pre + "input_layernorm.weight", (d,)),
                             "post_norm": src.get(pre + "post_attention_layernorm.weight", (d,))}
    if cfg.layer_types[i] == "linear_attention":
        layer["mamba"] = load_mamba(cfg, src, pre + "mamba.")
    else:
        layer["attn"] = load_plain_attn(cfg, src, pre + "self_attn.")
    gate, up = np.split(np.asarray(src.get(pre + "shared_mlp.input_linear.weight", (2 * is_, d))),
                        2)
    shared = {"gate_up": np.stack([gate, up], axis=1).reshape(2 * is_, d).T,
              "down": src.get(pre + "shared_mlp.output_linear.weight", (d, is_)).T}
    if cfg.mlp_types[i] != "moe":
        layer["mlp"] = shared
        return layer
    e, im, m = cfg.num_experts, cfg.moe_intermediate_size, pre + "block_sparse_moe."
    legacy = m + "input_linear.weight" in src  # released checkpoints; else transformers 5
    layer["moe"] = {
        "router": src.get(m + ("router.layer.weight" if legacy else "router.weight"), (e, d)).T,
        "gate_up": fused_t(src, m + ("input_linear.weight" if legacy
                                     else "experts.gate_up_proj"), e, (2 * im, d)),
        "down": fused_t(src, m + ("output_linear.weight" if legacy else "experts.down_proj"),
                        e, (d, im)),
        "shared_gate_up": shared["gate_up"], "shared_down": shared["down"],
    }
    return layer


class GraniteFamily(Family):
    name = "granitemoehybrid"
    architectures = ("GraniteMoeHybridForCausalLM",)
    model_types = ("granitemoehybrid",)
    linear_groups_replicate = True
    mixers = {"linear_attention": MIXERS["mamba2"], "full_attention": MIXERS["attention"]}
    norm = staticmethod(rms_norm_plain)
    ffn = staticmethod(granite_ffn)

    def config_fields(self, hf: Mapping[str, Any]) -> dict[str, Any]:
        unsupported(hf, {"hidden_act": "silu", "attention_bias": False, "mamba_proj_bias": False,
                         "mamba_conv_bias": True}, self.name)
        d, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
        n = int(hf.get("num_hidden_layers") or len(hf["layer_types"]))
        kinds = list(hf.get("layer_types") or hf.get("layers_block_type") or ["mamba"] * n)[:n]
        bad = sorted(set(kinds) - set(MIXER_TYPES))
        require(not bad, f"unknown Granite layer types {bad}")
        mamba_heads = int(hf.get("mamba_n_heads", 128))
        experts = int(hf.get("num_local_experts") or 0)
        shared = int(hf.get("shared_intermediate_size") or 0)
        limit = tuple(hf_float(v) for v in (hf.get("time_step_limit") or (0.0, INF)))
        return common_fields(hf, dict(
            family=self.name, layer_types=tuple(MIXER_TYPES[k] for k in kinds),
            mlp_types=("moe" if experts > 0 else "dense",) * n,
            num_attention_heads=heads,
            num_key_value_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or d // heads),
            **mamba_sizes(groups=hf.get("mamba_n_groups", 1), heads=mamba_heads,
                          state=hf.get("mamba_d_state", 256),
                          head_dim=_mamba_head_dim(hf, d, mamba_heads),
                          kernel=hf.get("mamba_d_conv", 4)),
            time_step_limit=limit, **_rope(hf),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            intermediate_size=shared, num_experts=experts,
            num_experts_per_tok=int(hf.get("num_experts_per_tok") or 0) if experts else 0,
            moe_intermediate_size=int(hf.get("intermediate_size") or 0) if experts else 0,
            shared_expert_intermediate_size=shared,
            embedding_multiplier=float(hf.get("embedding_multiplier", 1.0)),
            residual_multiplier=float(hf.get("residual_multiplier", 1.0)),
            attention_multiplier=float(hf.get("attention_multiplier", 1.0)),
            logits_scaling=float(hf.get("logits_scaling", 1.0))))

    def validate(self, cfg: ModelConfig) -> None:
        validate_mamba2(cfg)
        check_mixer_and_mlp_everywhere(cfg)

    def layer_shapes(self, cfg: ModelConfig, kind: str, mlp: str) -> dict[str, Any]:
        d, is_, im, e = (cfg.hidden_size, cfg.shared_expert_intermediate_size,
                         cfg.moe_intermediate_size, cfg.num_experts)
        layer: dict[str, Any] = {"input_norm": (d,), **mixer_shapes(cfg, kind), "post_norm": (d,)}
        if mlp == "moe":  # the shared MLP rides in the MoE dict (models/moe.py's layout)
            layer["moe"] = {"router": (d, e), "gate_up": (e, d, 2 * im), "down": (e, im, d),
                            "shared_gate_up": (d, 2 * is_), "shared_down": (is_, d)}
        else:
            layer["mlp"] = {"gate_up": (d, 2 * is_), "down": (is_, d)}
        return layer

    def load_trunk(self, cfg: ModelConfig, src: TensorSource) -> dict[str, Any]:
        v, d = cfg.vocab_size, cfg.hidden_size
        return {"embed": src.get("model.embed_tokens.weight", (v, d)),
                "final_norm": src.get("model.norm.weight", (d,)),
                "layers": tuple(_load_layer(cfg, src, f"model.layers.{i}.", i)
                                for i in range(cfg.num_hidden_layers))}


GRANITE = GraniteFamily()
