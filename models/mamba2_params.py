"""Parameter shapes of the Mamba2 hybrids (``nemotron_h``, ``granitemoehybrid``); conventions as
``models/params.py`` (``[in, out]`` weights, group-major projections, plain-weight norms).

With ``H, P, G, N`` the Mamba2 heads, head dim, groups, state size (``r = H / G``), ``C = H*P +
2*G*N`` the conv channels and ``D`` the hidden size:

  mamba: in_proj ``[D, 2*H*P + 2*G*N + H]`` (``G`` groups ``z_j | x_j | B_j | C_j | dt_j``),
    conv_w ``[K, C]`` and conv_b ``[C]`` (``G`` groups ``x_j | B_j | C_j``; the conv pool too),
    A_log, dt_bias, D ``[H]``, norm ``[H*P]`` (grouped gated RMSNorm), out_proj ``[H*P, D]``;
  attn: qkv_proj ``[D, (Hq + 2*Hkv)*hd]`` (per KV head its ``Hq/Hkv`` query heads, k, v),
    o_proj ``[Hq*hd, D]``;
  Nemotron-H: one sublayer per block with one norm (``input_norm``): mamba, attn, mlp (up
    ``[D, I]``, down ``[I, D]``, relu2) or moe (router ``[D, E]``, router_bias ``[E]``, up
    ``[E, D, Im]``, down ``[E, Im, D]``, shared_up ``[D, Is]``, shared_down ``[Is, D]``);
  Granite 4.0-H: input_norm, mamba or attn, post_norm, and with experts moe (``models/moe.py``'s
    layout without a shared gate: router ``[D, E]``, gate_up ``[E, D, 2*Im]`` gate | up, down
    ``[E, Im, D]``, shared_gate_up ``[D, 2*Is]`` pair-interleaved, shared_down ``[Is, D]``),
    without experts mlp (the shared SwiGLU alone: gate_up, down).
"""

from __future__ import annotations

from typing import Any

MAMBA2_FAMILIES = ("nemotron_h", "granitemoehybrid")


def mamba_shapes(cfg: Any) -> dict[str, tuple[int, ...]]:
    d, h, p = cfg.hidden_size, cfg.linear_num_value_heads, cfg.linear_value_head_dim
    c = cfg.linear_conv_dim
    return {
        "in_proj": (d, h * p + c + h), "conv_w": (cfg.linear_conv_kernel_dim, c), "conv_b": (c,),
        "A_log": (h,), "dt_bias": (h,), "D": (h,), "norm": (h * p,), "out_proj": (h * p, d),
    }


def plain_attn_shapes(cfg: Any) -> dict[str, tuple[int, ...]]:
    d, hq, hkv, hd = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                      cfg.head_dim)
    return {"qkv_proj": (d, (hq + 2 * hkv) * hd), "o_proj": (hq * hd, d)}


def _nemotron_ffn(cfg: Any, mlp: str) -> dict[str, Any]:
    d, e, im, is_ = (cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size,
                     cfg.shared_expert_intermediate_size)
    if mlp == "dense":
        return {"mlp": {"up": (d, cfg.intermediate_size), "down": (cfg.intermediate_size, d)}}
    return {"moe": {"router": (d, e), "router_bias": (e,), "up": (e, d, im), "down": (e, im, d),
                    "shared_up": (d, is_), "shared_down": (is_, d)}}


def mamba2_layer_shapes(cfg: Any, kind: str, mlp: str) -> dict[str, Any]:
    """The whole parameter dict of one decoder layer (norms included)."""
    d = cfg.hidden_size
    layer: dict[str, Any] = {"input_norm": (d,)}
    if kind == "linear_attention":
        layer["mamba"] = mamba_shapes(cfg)
    elif kind == "full_attention":
        layer["attn"] = plain_attn_shapes(cfg)
    if cfg.family == "nemotron_h":
        return layer if mlp == "none" else {**layer, **_nemotron_ffn(cfg, mlp)}
    is_, im, e = cfg.shared_expert_intermediate_size, cfg.moe_intermediate_size, cfg.num_experts
    layer["post_norm"] = (d,)
    if mlp == "moe":  # the shared MLP rides in the MoE dict (models/moe.py's layout)
        layer["moe"] = {"router": (d, e), "gate_up": (e, d, 2 * im), "down": (e, im, d),
                        "shared_gate_up": (d, 2 * is_), "shared_down": (is_, d)}
    else:
        layer["mlp"] = {"gate_up": (d, 2 * is_), "down": (is_, d)}
    return layer
