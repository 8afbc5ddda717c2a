"""Qwen3-Next and Qwen3.5 (dense and MoE): Gated DeltaNet + gated attention hybrids.

* ``qwen3_next``  (``Qwen3NextForCausalLM``): packed ``in_proj_qkvz`` / ``in_proj_ba`` grouped per
  key head, sparse MoE with a sigmoid-gated shared expert (dense MLP on ``mlp_only_layers`` and
  off the ``decoder_sparse_step``).
* ``qwen3_5``     (``Qwen3_5ForCausalLM`` / ``...ForConditionalGeneration``, the text model):
  separate ``in_proj_qkv/z/b/a``, dense MLP on every layer.
* ``qwen3_5_moe`` (``Qwen3_5MoeForCausalLM`` / ``...ForConditionalGeneration``): separate
  projections, MoE on every layer (top-k renormalised).

A vision-language ``config.json`` is read through its ``text_config`` (``tie_word_embeddings``
from either level). Norms are zero-centred (``1 + w``); attention has partial NeoX RoPE.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from models.families.base import (
    Family,
    check_mixer_and_mlp_everywhere,
    check_rotary,
    default_rope,
    require,
)
from models.hf_tensors import grouped_t, swiglu_experts_t, swiglu_t
from models.layers import rms_norm
from models.mixer_registry import MIXERS
from models.moe import mlp_block
from models.params import attn_shapes, gdn_shapes, mlp_shapes, moe_shapes
from models.safetensors_io import TensorSource

if TYPE_CHECKING:
    from models.config import ModelConfig


def _text_config(hf: Mapping[str, Any]) -> Mapping[str, Any]:
    if "text_config" in hf and isinstance(hf["text_config"], Mapping):
        text = hf["text_config"]
        tied = text.get("tie_word_embeddings", hf.get("tie_word_embeddings", False))
        return {**text, "tie_word_embeddings": tied}
    return hf


def gdn_conv_channel_order(cfg: ModelConfig) -> np.ndarray:
    """Indices into HF's conv channels ``q | k | v`` giving the group-major order: per key head
    ``j`` its ``q_j (Dk) | k_j (Dk) | v_j (r*Dv)``. ``[C]`` int."""
    hk, dk, kd = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_key_dim
    rdv = cfg.linear_value_dim // hk
    return np.concatenate([np.concatenate([np.arange(j * dk, (j + 1) * dk),
                                           kd + np.arange(j * dk, (j + 1) * dk),
                                           2 * kd + np.arange(j * rdv, (j + 1) * rdv)])
                           for j in range(hk)])


def _gdn(cfg: ModelConfig, src: TensorSource, pre: str, packed: bool) -> dict[str, np.ndarray]:
    """``packed``: Qwen3-Next's ``in_proj_qkvz`` / ``in_proj_ba``, already grouped per key head
    (``[q k v z]_j`` and ``[b a]_j``); else Qwen3.5's separate ``in_proj_qkv/z/b/a``."""
    h, hk, hv = cfg.hidden_size, cfg.linear_num_key_heads, cfg.linear_num_value_heads
    kd, vd = cfg.linear_key_dim, cfg.linear_value_dim
    order = gdn_conv_channel_order(cfg)
    if packed:
        in_proj = grouped_t(hk, src.get(pre + "in_proj_qkvz.weight", (2 * kd + 2 * vd, h)),
                            src.get(pre + "in_proj_ba.weight", (2 * hv, h)))
    else:
        qkv = np.asarray(src.get(pre + "in_proj_qkv.weight", (cfg.linear_conv_dim, h)))[order]
        in_proj = grouped_t(hk, qkv, src.get(pre + "in_proj_z.weight", (vd, h)),
                            src.get(pre + "in_proj_b.weight", (hv, h)),
                            src.get(pre + "in_proj_a.weight", (hv, h)))
    conv = src.get(pre + "conv1d.weight", (cfg.linear_conv_dim, 1, cfg.linear_conv_kernel_dim))
    return {
        "in_proj": in_proj,
        "conv_w": np.asarray(conv)[order, 0, :].T,
        "A_log": src.get(pre + "A_log", (hv,)),
        "dt_bias": src.get(pre + "dt_bias", (hv,)),
        "norm": src.get(pre + "norm.weight", (cfg.linear_value_head_dim,)),
        "out_proj": src.get(pre + "out_proj.weight", (h, vd)).T,
    }


def load_attn(cfg: ModelConfig, src: TensorSource, pre: str) -> dict[str, np.ndarray]:
    """``qkv_proj`` group-major per KV head: its query heads' ``(q D | gate D)`` as HF's q_proj
    packs them, then ``k_j``, then ``v_j``."""
    h, d, hq, hkv = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    return {
        "qkv_proj": grouped_t(hkv, src.get(pre + "q_proj.weight", (hq * 2 * d, h)),
                              src.get(pre + "k_proj.weight", (hkv * d, h)),
                              src.get(pre + "v_proj.weight", (hkv * d, h))),
        "q_norm": src.get(pre + "q_norm.weight", (d,)),
        "k_norm": src.get(pre + "k_norm.weight", (d,)),
        "o_proj": src.get(pre + "o_proj.weight", (h, hq * d)).T,
    }


def load_ffn(cfg: ModelConfig, src: TensorSource, pre: str, mlp: str) -> dict[str, Any]:
    """``{"moe": ...}`` (experts, router, sigmoid-gated shared expert) or ``{"mlp": ...}``."""
    h = cfg.hidden_size
    if mlp != "moe":
        gate_up, down = swiglu_t(src, pre, h, cfg.intermediate_size)
        return {"mlp": {"gate_up": gate_up, "down": down}}
    gate_up, down = swiglu_experts_t(src, pre + "experts.", cfg.num_experts, h,
                                     cfg.moe_intermediate_size)
    s_gate_up, s_down = swiglu_t(src, pre + "shared_expert.", h,
                                 cfg.shared_expert_intermediate_size)
    return {"moe": {
        "router": src.get(pre + "gate.weight", (cfg.num_experts, h)).T,
        "gate_up": gate_up, "down": down, "shared_gate_up": s_gate_up, "shared_down": s_down,
        "shared_gate": src.get(pre + "shared_expert_gate.weight", (1, h)).T,
    }}


def _prefix(src: TensorSource) -> str:
    for pre in ("model.language_model.", "model."):
        if pre + "embed_tokens.weight" in src:
            return pre
    raise ValueError("checkpoint tensor 'model.embed_tokens.weight' is missing")


class QwenFamily(Family):
    """One of the three Qwen hybrids; ``mlp`` is ``"sparse_step"`` (Qwen3-Next's rule),
    ``"dense"`` or ``"moe"`` (every layer)."""

    supports_mtp = True
    plain_norms = False
    mixers = {"linear_attention": MIXERS["gated_delta_net"],
              "full_attention": MIXERS["gated_attention"]}
    norm = staticmethod(rms_norm)
    ffn = staticmethod(mlp_block)

    def __init__(self, name: str, architectures: tuple[str, ...], model_types: tuple[str, ...],
                 mlp: str):
        self.name, self.architectures, self.model_types, self.mlp = (
            name, architectures, model_types, mlp)

    def _mlp_types(self, hf: Mapping[str, Any], num_layers: int) -> tuple[str, ...]:
        if self.mlp != "sparse_step":
            return (self.mlp,) * num_layers
        only = set(hf.get("mlp_only_layers") or [])
        step = int(hf.get("decoder_sparse_step", 1))
        experts = int(hf.get("num_experts", 0))
        return tuple("moe" if i not in only and experts > 0 and (i + 1) % step == 0 else "dense"
                     for i in range(num_layers))

    def config_fields(self, hf: Mapping[str, Any]) -> dict[str, Any]:
        hf = _text_config(hf)
        act = hf.get("hidden_act", "silu")
        require(act == "silu", f"hidden_act must be 'silu', got {act!r}")
        require(not hf.get("attention_bias", False), "attention_bias=True is not supported")
        num_layers = int(hf["num_hidden_layers"])
        layer_types = hf.get("layer_types") or [
            "full_attention" if (i + 1) % int(hf.get("full_attention_interval", 4)) == 0
            else "linear_attention" for i in range(num_layers)]
        theta, partial = default_rope(hf, 0.25)
        heads = int(hf["num_attention_heads"])
        fields = dict(
            family=self.name, vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            layer_types=tuple(list(layer_types)[:num_layers]),
            mlp_types=self._mlp_types(hf, num_layers),
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
        if self.mlp != "dense":
            fields.update(
                num_experts=int(hf["num_experts"]),
                num_experts_per_tok=int(hf["num_experts_per_tok"]),
                moe_intermediate_size=int(hf["moe_intermediate_size"]),
                shared_expert_intermediate_size=int(hf["shared_expert_intermediate_size"]),
                norm_topk_prob=(bool(hf.get("norm_topk_prob", True))
                                if self.mlp == "sparse_step" else True))
        return fields

    def validate(self, cfg: ModelConfig) -> None:
        check_rotary(cfg)
        check_mixer_and_mlp_everywhere(cfg)

    def layer_shapes(self, cfg: ModelConfig, kind: str, mlp: str) -> dict[str, Any]:
        h = cfg.hidden_size
        layer: dict[str, Any] = {"input_norm": (h,), "post_norm": (h,)}
        if kind == "linear_attention":
            layer["gdn"] = gdn_shapes(cfg)
        else:
            layer["attn"] = attn_shapes(cfg)
        if mlp == "moe":
            layer["moe"] = moe_shapes(cfg)
        else:
            layer["mlp"] = mlp_shapes(cfg)
        return layer

    def load_trunk(self, cfg: ModelConfig, src: TensorSource) -> dict[str, Any]:
        pre, h = _prefix(src), cfg.hidden_size
        layers = []
        for i, (kind, mlp) in enumerate(zip(cfg.layer_types, cfg.mlp_types, strict=True)):
            p = f"{pre}layers.{i}."
            layer: dict[str, Any] = {
                "input_norm": src.get(p + "input_layernorm.weight", (h,)),
                "post_norm": src.get(p + "post_attention_layernorm.weight", (h,))}
            if kind == "linear_attention":
                layer["gdn"] = _gdn(cfg, src, p + "linear_attn.", self.name == "qwen3_next")
            else:
                layer["attn"] = load_attn(cfg, src, p + "self_attn.")
            layers.append({**layer, **load_ffn(cfg, src, p + "mlp.", mlp)})
        return {"embed": src.get(pre + "embed_tokens.weight", (cfg.vocab_size, h)),
                "final_norm": src.get(pre + "norm.weight", (h,)), "layers": tuple(layers)}

    def load_mtp(self, cfg: ModelConfig, src: TensorSource) -> dict[str, Any]:
        """``mtp.*`` -> ``params["mtp"]`` (``params.mtp_shapes``)."""
        h, pre = cfg.hidden_size, "mtp.layers.0."
        layer: dict[str, Any] = {
            "input_norm": src.get(pre + "input_layernorm.weight", (h,)),
            "post_norm": src.get(pre + "post_attention_layernorm.weight", (h,)),
            "attn": load_attn(cfg, src, pre + "self_attn."),
            **load_ffn(cfg, src, pre + "mlp.", cfg.mlp_types[-1])}
        return {"embed_norm": src.get("mtp.pre_fc_norm_embedding.weight", (h,)),
                "hidden_norm": src.get("mtp.pre_fc_norm_hidden.weight", (h,)),
                "fc": src.get("mtp.fc.weight", (h, 2 * h)).T, "layer": layer,
                "final_norm": src.get("mtp.norm.weight", (h,))}


QWEN3_NEXT = QwenFamily("qwen3_next", ("Qwen3NextForCausalLM",), ("qwen3_next",), "sparse_step")
QWEN3_5 = QwenFamily("qwen3_5", ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration"),
                     ("qwen3_5", "qwen3_5_text"), "dense")
QWEN3_5_MOE = QwenFamily("qwen3_5_moe",
                         ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"),
                         ("qwen3_5_moe", "qwen3_5_moe_text"), "moe")
