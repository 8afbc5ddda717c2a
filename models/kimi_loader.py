"""Kimi Linear checkpoint tensors -> the layout of ``models/kimi_params.py``.

The on-disk names (what Moonshot publishes and what transformers' ``save_pretrained`` writes):
``self_attn.{q,k,v}_proj``, ``{q,k,v}_conv1d`` (one depthwise conv each), ``f_a_proj``,
``f_b_proj``, ``dt_bias [H*D]``, ``A_log [1, 1, H, 1]``, ``b_proj``, ``g_a_proj``, ``g_b_proj``,
``o_norm``, ``o_proj`` for KDA; ``q_proj``, ``kv_a_proj_with_mqa``, ``kv_a_layernorm``,
``kv_b_proj`` (per head ``k_nope | v``), ``o_proj`` for MLA; ``block_sparse_moe.`` for the dense
MLP and the MoE (``gate.weight``, ``gate.e_score_correction_bias``, ``experts.{e}.w1/w2/w3`` =
gate / down / up, ``shared_experts.*``). q / k / v (projections and conv channels) are regrouped
per head (``q_h | k_h | v_h``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from models.config import ModelConfig
from models.safetensors_io import TensorSource


def _kda(cfg: ModelConfig, src: TensorSource, pre: str) -> dict[str, np.ndarray]:
    h, hl, d, k = (cfg.hidden_size, cfg.linear_num_value_heads, cfg.linear_value_head_dim,
                   cfg.linear_conv_kernel_dim)
    hd = hl * d

    def per_head(parts: list[np.ndarray]) -> np.ndarray:  # 3 x [H*D, ...] -> [H*3*D, ...]
        return np.stack([np.asarray(p).reshape(hl, d, -1) for p in parts], 1).reshape(3 * hd, -1)

    proj = per_head([src.get(f"{pre}{n}_proj.weight", (hd, h)) for n in "qkv"])
    conv = per_head([src.get(f"{pre}{n}_conv1d.weight", (hd, 1, k))[:, 0, :] for n in "qkv"])
    return {
        "in_proj": proj.T, "conv_w": conv.T,
        "f_a": src.get(pre + "f_a_proj.weight", (d, h)).T,
        "f_b": src.get(pre + "f_b_proj.weight", (hd, d)).T,
        "dt_bias": np.asarray(src.get(pre + "dt_bias", (hd,))).reshape(hl, d),
        "A_log": np.asarray(src.get(pre + "A_log", (1, 1, hl, 1))).reshape(hl),
        "b_proj": src.get(pre + "b_proj.weight", (hl, h)).T,
        "g_a": src.get(pre + "g_a_proj.weight", (d, h)).T,
        "g_b": src.get(pre + "g_b_proj.weight", (hd, d)).T,
        "norm": src.get(pre + "o_norm.weight", (d,)),
        "out_proj": src.get(pre + "o_proj.weight", (h, hd)).T,
    }


def _mla(cfg: ModelConfig, src: TensorSource, pre: str) -> dict[str, np.ndarray]:
    h, hq, r = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank
    dn, dr, dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    kv_b = np.asarray(src.get(pre + "kv_b_proj.weight", (hq * (dn + dv), r)))
    kv_b = kv_b.reshape(hq, dn + dv, r).transpose(0, 2, 1)                # [Hq, R, dn + dv]
    return {
        "q_proj": src.get(pre + "q_proj.weight", (hq * (dn + dr), h)).T,
        "kv_a": src.get(pre + "kv_a_proj_with_mqa.weight", (r + dr, h)).T,
        "kv_norm": src.get(pre + "kv_a_layernorm.weight", (r,)),
        "k_up": kv_b[..., :dn], "v_up": kv_b[..., dn:],
        "o_proj": src.get(pre + "o_proj.weight", (h, hq * dv)).T,
    }


def _moe(cfg: ModelConfig, src: TensorSource, pre: str) -> dict[str, np.ndarray]:
    from models.loader import _swiglu
    h, e, im = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    gate_up, down = [], []
    for j in range(e):
        w1 = np.asarray(src.get(f"{pre}experts.{j}.w1.weight", (im, h)))
        w3 = np.asarray(src.get(f"{pre}experts.{j}.w3.weight", (im, h)))
        gate_up.append(np.concatenate([w1, w3]).T)
        down.append(np.asarray(src.get(f"{pre}experts.{j}.w2.weight", (h, im))).T)
    s_gate_up, s_down = _swiglu(src, pre + "shared_experts.", h,
                                cfg.shared_expert_intermediate_size)
    return {
        "router": src.get(pre + "gate.weight", (e, h)).T,
        "router_bias": src.get(pre + "gate.e_score_correction_bias", (e,)),
        "gate_up": np.stack(gate_up), "down": np.stack(down),
        "shared_gate_up": s_gate_up, "shared_down": s_down,
    }


def kimi_layer(cfg: ModelConfig, src: TensorSource, pre: str, i: int) -> dict[str, Any]:
    """Decoder layer ``i`` (``pre`` = ``model.layers.{i}.``) in the params layout."""
    from models.loader import _swiglu
    h = cfg.hidden_size
    layer: dict[str, Any] = {
        "input_norm": src.get(pre + "input_layernorm.weight", (h,)),
        "post_norm": src.get(pre + "post_attention_layernorm.weight", (h,)),
    }
    if cfg.layer_types[i] == "linear_attention":
        layer["kda"] = _kda(cfg, src, pre + "self_attn.")
    else:
        layer["mla"] = _mla(cfg, src, pre + "self_attn.")
    mlp = pre + ("block_sparse_moe." if pre + "block_sparse_moe.down_proj.weight" in src
                 or cfg.mlp_types[i] == "moe" else "mlp.")
    if cfg.mlp_types[i] == "moe":
        layer["moe"] = _moe(cfg, src, mlp)
    else:
        gate_up, down = _swiglu(src, mlp, h, cfg.intermediate_size)
        layer["mlp"] = {"gate_up": gate_up, "down": down}
    return layer
