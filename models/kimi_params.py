"""Parameter shapes of the Kimi Linear layers (KDA, MLA, DeepSeek-style MoE); see
``models/params.py`` for the conventions (``[in, out]`` weights, group-major projections).

  kda: in_proj ``[H, Hl*3*D]`` group-major per head (``q_h | k_h | v_h``, D each), conv_w
    ``[K, Hl*3*D]`` (same channel order; the conv pool too), f_a ``[H, D]``, f_b ``[D, Hl*D]``,
    dt_bias ``[Hl, D]``, A_log ``[Hl]``, b_proj ``[H, Hl]``, g_a ``[H, D]``, g_b ``[D, Hl*D]``,
    norm ``[D]`` (plain weight), out_proj ``[Hl*D, H]``;
  mla: q_proj ``[H, Hq*(dn+dr)]`` (per head ``nope | rope``), kv_a ``[H, R+dr]`` (latent | shared
    key part), kv_norm ``[R]`` (plain), k_up ``[Hq, R, dn]``, v_up ``[Hq, R, dv]`` (HF's
    ``kv_b_proj`` split per head), o_proj ``[Hq*dv, H]``;
  moe: router ``[H, E]``, router_bias ``[E]`` (``e_score_correction_bias``), gate_up
    ``[E, H, 2*Im]`` (gate | up), down ``[E, Im, H]``, shared_gate_up ``[H, 2*Is]``
    pair-interleaved, shared_down ``[Is, H]`` (no shared gate).

With ``Hl`` the KDA heads, ``D`` their dim, ``R = kv_lora_rank``, ``dn / dr / dv`` the MLA nope /
rope / value dims. Head axes come first or as whole column groups, so a tensor-parallel split on
heads needs no regrouping.
"""

from __future__ import annotations

from typing import Any


def kda_shapes(cfg: Any) -> dict[str, tuple[int, ...]]:
    h, hl, d = cfg.hidden_size, cfg.linear_num_value_heads, cfg.linear_value_head_dim
    return {
        "in_proj": (h, hl * 3 * d), "conv_w": (cfg.linear_conv_kernel_dim, hl * 3 * d),
        "f_a": (h, d), "f_b": (d, hl * d), "dt_bias": (hl, d), "A_log": (hl,),
        "b_proj": (h, hl), "g_a": (h, d), "g_b": (d, hl * d), "norm": (d,),
        "out_proj": (hl * d, h),
    }


def mla_shapes(cfg: Any) -> dict[str, tuple[int, ...]]:
    h, hq, r = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank
    dn, dr, dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    return {
        "q_proj": (h, hq * (dn + dr)), "kv_a": (h, r + dr), "kv_norm": (r,),
        "k_up": (hq, r, dn), "v_up": (hq, r, dv), "o_proj": (hq * dv, h),
    }


def kimi_moe_shapes(cfg: Any) -> dict[str, tuple[int, ...]]:
    h, e, im = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    is_ = cfg.shared_expert_intermediate_size
    return {
        "router": (h, e), "router_bias": (e,), "gate_up": (e, h, 2 * im), "down": (e, im, h),
        "shared_gate_up": (h, 2 * is_), "shared_down": (is_, h),
    }


def kimi_layer_shapes(cfg: Any, kind: str, mlp: str) -> dict[str, Any]:
    """The mixer and MLP entries of one Kimi Linear decoder layer."""
    layer: dict[str, Any] = ({"kda": kda_shapes(cfg)} if kind == "linear_attention"
                             else {"mla": mla_shapes(cfg)})
    if mlp == "moe":
        layer["moe"] = kimi_moe_shapes(cfg)
    else:
        h, i = cfg.hidden_size, cfg.intermediate_size
        layer["mlp"] = {"gate_up": (h, 2 * i), "down": (i, h)}
    return layer
