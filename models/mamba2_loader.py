"""Hugging Face tensors of the Mamba2 hybrids -> the layout of ``models/mamba2_params.py``.

Nemotron-H checkpoints name the trunk ``backbone.`` (released) or ``model.`` (transformers 5 in
memory): ``embeddings``, ``layers.i.norm``, ``layers.i.mixer.*``, ``norm_f``. Granite 4.0-H:
``model.embed_tokens``, ``layers.i.{input_layernorm, post_attention_layernorm, mamba.*,
self_attn.*, shared_mlp.*, block_sparse_moe.*}``, ``model.norm``. Experts come per expert or
fused (either naming); a missing or mis-shaped tensor is the ``TensorSource`` ``ValueError``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from models.config import ModelConfig
from models.loader import _grouped_t
from models.safetensors_io import TensorSource


def mamba_conv_channel_order(cfg: ModelConfig) -> np.ndarray:
    """Indices into HF's conv channels ``x | B | C`` giving the group-major order: per group
    ``j`` its ``x_j (r*P) | B_j (N) | C_j (N)``. ``[C]`` int."""
    h, p, g, n = (cfg.linear_num_value_heads, cfg.linear_value_head_dim,
                  cfg.linear_num_key_heads, cfg.linear_key_head_dim)
    rp = h * p // g
    return np.concatenate([np.concatenate([np.arange(j * rp, (j + 1) * rp),
                                           h * p + np.arange(j * n, (j + 1) * n),
                                           h * p + g * n + np.arange(j * n, (j + 1) * n)])
                           for j in range(g)])


def _mamba(cfg: ModelConfig, src: TensorSource, pre: str) -> dict[str, np.ndarray]:
    d, h, p = cfg.hidden_size, cfg.linear_num_value_heads, cfg.linear_value_head_dim
    g, n, k, c = (cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_conv_kernel_dim,
                  cfg.linear_conv_dim)
    w = np.asarray(src.get(pre + "in_proj.weight", (2 * h * p + 2 * g * n + h, d)))
    z, x, b, cc, dt = np.split(w, np.cumsum([h * p, h * p, g * n, g * n]))
    order = mamba_conv_channel_order(cfg)
    return {
        "in_proj": _grouped_t(g, z, x, b, cc, dt),
        "conv_w": np.asarray(src.get(pre + "conv1d.weight", (c, 1, k)))[:, 0, :].T[:, order],
        "conv_b": np.asarray(src.get(pre + "conv1d.bias", (c,)))[order],
        "A_log": src.get(pre + "A_log", (h,)), "dt_bias": src.get(pre + "dt_bias", (h,)),
        "D": src.get(pre + "D", (h,)), "norm": src.get(pre + "norm.weight", (h * p,)),
        "out_proj": src.get(pre + "out_proj.weight", (d, h * p)).T,
    }


def _attn(cfg: ModelConfig, src: TensorSource, pre: str) -> dict[str, np.ndarray]:
    d, hd, hq, hkv = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    return {
        "qkv_proj": _grouped_t(hkv, src.get(pre + "q_proj.weight", (hq * hd, d)),
                               src.get(pre + "k_proj.weight", (hkv * hd, d)),
                               src.get(pre + "v_proj.weight", (hkv * hd, d))),
        "o_proj": src.get(pre + "o_proj.weight", (d, hq * hd)).T,
    }


def _fused(src: TensorSource, name: str, e: int, shape: tuple[int, int]) -> np.ndarray:
    """``[E, in, out]`` from a fused ``[E, out, in]`` expert tensor."""
    return np.asarray(src.get(name, (e, *shape))).transpose(0, 2, 1)


def _stacked(src: TensorSource, fused: str, per_expert: str, e: int, shape: tuple[int, int]):
    """``[E, in, out]`` from a fused ``[E, out, in]`` tensor or per-expert ``[out, in]`` ones."""
    if fused in src:
        return _fused(src, fused, e, shape)
    return np.stack([np.asarray(src.get(per_expert.format(j), shape)).T for j in range(e)])


def _nemotron_ffn(cfg: ModelConfig, src: TensorSource, pre: str, kind: str) -> dict[str, Any]:
    d = cfg.hidden_size
    if kind == "dense":
        i = cfg.intermediate_size
        return {"mlp": {"up": src.get(pre + "up_proj.weight", (i, d)).T,
                        "down": src.get(pre + "down_proj.weight", (d, i)).T}}
    e, im, is_ = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    ex = pre + "experts."
    return {"moe": {
        "router": src.get(pre + "gate.weight", (e, d)).T,
        "router_bias": src.get(pre + "gate.e_score_correction_bias", (e,)),
        "up": _stacked(src, ex + "up_proj", ex + "{}.up_proj.weight", e, (im, d)),
        "down": _stacked(src, ex + "down_proj", ex + "{}.down_proj.weight", e, (d, im)),
        "shared_up": src.get(pre + "shared_experts.up_proj.weight", (is_, d)).T,
        "shared_down": src.get(pre + "shared_experts.down_proj.weight", (d, is_)).T,
    }}


def _nemotron_layer(cfg: ModelConfig, src: TensorSource, pre: str, i: int) -> dict[str, Any]:
    layer: dict[str, Any] = {"input_norm": src.get(pre + "norm.weight", (cfg.hidden_size,))}
    kind, mlp = cfg.layer_types[i], cfg.mlp_types[i]
    if kind == "linear_attention":
        layer["mamba"] = _mamba(cfg, src, pre + "mixer.")
    elif kind == "full_attention":
        layer["attn"] = _attn(cfg, src, pre + "mixer.")
    else:
        layer.update(_nemotron_ffn(cfg, src, pre + "mixer.", mlp))
    return layer


def _granite_layer(cfg: ModelConfig, src: TensorSource, pre: str, i: int) -> dict[str, Any]:
    d, is_ = cfg.hidden_size, cfg.shared_expert_intermediate_size
    layer: dict[str, Any] = {"input_norm": src.get(pre + "input_layernorm.weight", (d,)),
                             "post_norm": src.get(pre + "post_attention_layernorm.weight", (d,))}
    if cfg.layer_types[i] == "linear_attention":
        layer["mamba"] = _mamba(cfg, src, pre + "mamba.")
    else:
        layer["attn"] = _attn(cfg, src, pre + "self_attn.")
    gate, up = np.split(np.asarray(src.get(pre + "shared_mlp.input_linear.weight", (2 * is_, d))),
                        2)
    shared = {"gate_up": np.stack([gate, up], axis=1).reshape(2 * is_, d).T,
              "down": src.get(pre + "shared_mlp.output_linear.weight", (d, is_)).T}
    if cfg.mlp_types[i] != "moe":
        layer["mlp"] = shared
    else:
        e, im, m = cfg.num_experts, cfg.moe_intermediate_size, pre + "block_sparse_moe."
        legacy = m + "input_linear.weight" in src  # released checkpoints; else transformers 5
        layer["moe"] = {
            "router": src.get(m + ("router.layer.weight" if legacy else "router.weight"),
                              (e, d)).T,
            "gate_up": _fused(src, m + ("input_linear.weight" if legacy
                                        else "experts.gate_up_proj"), e, (2 * im, d)),
            "down": _fused(src, m + ("output_linear.weight" if legacy else "experts.down_proj"),
                           e, (d, im)),
            "shared_gate_up": shared["gate_up"], "shared_down": shared["down"],
        }
    return layer


def mamba2_tree(cfg: ModelConfig, src: TensorSource) -> dict[str, Any]:
    """``embed``, ``final_norm`` and ``layers`` (numpy) of a Nemotron-H or Granite 4.0-H
    checkpoint; the caller adds ``lm_head`` and checks for unused tensors."""
    v, d = cfg.vocab_size, cfg.hidden_size
    if cfg.family == "nemotron_h":
        pre = "backbone." if "backbone.embeddings.weight" in src else "model."
        embed, final, layer = "embeddings.weight", "norm_f.weight", _nemotron_layer
    else:
        pre, embed, final, layer = "model.", "embed_tokens.weight", "norm.weight", _granite_layer
    return {
        "embed": src.get(pre + embed, (v, d)),
        "final_norm": src.get(pre + final, (d,)),
        "layers": tuple(layer(cfg, src, f"{pre}layers.{i}.", i)
                        for i in range(cfg.num_hidden_layers)),
    }
