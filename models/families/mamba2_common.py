"""What the two Mamba2 hybrid families (``nemotron_h.py``, ``granite.py``) share: the mapping of
Mamba2 sizes onto ``ModelConfig``'s linear_* fields and the Mamba2 validation.

The Mamba2 sizes live in the linear_* fields, so the pools, the tensor-parallel specs and the
tree need no Mamba2-specific code: key heads = ``n_groups`` (G), key dim = ``ssm_state_size``
(N), value heads = ``mamba_num_heads`` (H), value dim = ``mamba_head_dim`` (P), conv kernel =
``conv_kernel``; ``linear_conv_dim = H*P + 2*G*N`` is Mamba2's conv width and the SSM pool row
``[H, N, P]``.

Parameters shared by both (``[in, out]`` weights, ``C = H*P + 2*G*N`` conv channels, ``D`` the
hidden size, ``r = H / G``):

  mamba: in_proj ``[D, 2*H*P + 2*G*N + H]`` (``G`` groups ``z_j | x_j | B_j | C_j | dt_j``),
    conv_w ``[K, C]`` and conv_b ``[C]`` (``G`` groups ``x_j | B_j | C_j``; the conv pool too),
    A_log, dt_bias, D ``[H]``, norm ``[H*P]`` (grouped gated RMSNorm), out_proj ``[H*P, D]``;
  attn: qkv_proj ``[D, (Hq + 2*Hkv)*hd]`` (per KV head its ``Hq/Hkv`` query heads, k, v),
    o_proj ``[Hq*hd, D]``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from models.families.base import check_rotary, require
from models.hf_tensors import grouped_t
from models.safetensors_io import TensorSource

if TYPE_CHECKING:
    from models.config import ModelConfig

# config.json mixer names (both spellings transformers has used) -> ModelConfig layer types
MIXER_TYPES = {"mamba": "linear_attention", "linear_attention": "linear_attention",
               "attention": "full_attention", "full_attention": "full_attention"}


def mamba_sizes(*, groups: Any, heads: Any, state: Any, head_dim: Any,
                kernel: Any) -> dict[str, int]:
    """The linear_* fields holding the Mamba2 sizes G, H, N, P and the conv kernel."""
    return dict(linear_num_key_heads=int(groups), linear_num_value_heads=int(heads),
                linear_key_head_dim=int(state), linear_value_head_dim=int(head_dim),
                linear_conv_kernel_dim=int(kernel))


def common_fields(hf: Mapping[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    """``fields`` plus vocabulary, width, context and tying, after the head / group check."""
    h, g = fields["linear_num_value_heads"], fields["linear_num_key_heads"]
    require(h % g == 0, f"Mamba2 heads ({h}) must be a multiple of n_groups ({g})")
    return dict(vocab_size=int(hf["vocab_size"]), hidden_size=int(hf["hidden_size"]),
                max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)), **fields)


def validate_mamba2(cfg: ModelConfig) -> None:
    """Heads split into groups, a sane dt clamp, RoPE dims when RoPE is on."""
    h, g = cfg.linear_num_value_heads, cfg.linear_num_key_heads
    require(h % g == 0, f"Mamba2 heads ({h}) must be a multiple of n_groups ({g})")
    lo, hi = cfg.time_step_limit
    require(0.0 <= lo < hi, f"time_step_limit {cfg.time_step_limit} must satisfy 0 <= lo < hi")
    check_rotary(cfg)


def mamba_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    d, h, p = cfg.hidden_size, cfg.linear_num_value_heads, cfg.linear_value_head_dim
    c = cfg.linear_conv_dim
    return {
        "in_proj": (d, h * p + c + h), "conv_w": (cfg.linear_conv_kernel_dim, c), "conv_b": (c,),
        "A_log": (h,), "dt_bias": (h,), "D": (h,), "norm": (h * p,), "out_proj": (h * p, d),
    }


def plain_attn_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    d, hq, hkv, hd = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                      cfg.head_dim)
    return {"qkv_proj": (d, (hq + 2 * hkv) * hd), "o_proj": (hq * hd, d)}


def mixer_shapes(cfg: ModelConfig, kind: str) -> dict[str, Any]:
    """``{"mamba": ...}``, ``{"attn": ...}`` or nothing (a Nemotron-H MLP-only block)."""
    if kind == "linear_attention":
        return {"mamba": mamba_shapes(cfg)}
    if kind == "full_attention":
        return {"attn": plain_attn_shapes(cfg)}
    return {}


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


def load_mamba(cfg: ModelConfig, src: TensorSource, pre: str) -> dict[str, np.ndarray]:
    d, h, p = cfg.hidden_size, cfg.linear_num_value_heads, cfg.linear_value_head_dim
    g, n, k, c = (cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_conv_kernel_dim,
                  cfg.linear_conv_dim)
    w = np.asarray(src.get(pre + "in_proj.weight", (2 * h * p + 2 * g * n + h, d)))
    z, x, b, cc, dt = np.split(w, np.cumsum([h * p, h * p, g * n, g * n]))
    order = mamba_conv_channel_order(cfg)
    return {
        "in_proj": grouped_t(g, z, x, b, cc, dt),
        "conv_w": np.asarray(src.get(pre + "conv1d.weight", (c, 1, k)))[:, 0, :].T[:, order],
        "conv_b": np.asarray(src.get(pre + "conv1d.bias", (c,)))[order],
        "A_log": src.get(pre + "A_log", (h,)), "dt_bias": src.get(pre + "dt_bias", (h,)),
        "D": src.get(pre + "D", (h,)), "norm": src.get(pre + "norm.weight", (h * p,)),
        "out_proj": src.get(pre + "out_proj.weight", (d, h * p)).T,
    }


def load_plain_attn(cfg: ModelConfig, src: TensorSource, pre: str) -> dict[str, np.ndarray]:
    d, hd, hq, hkv = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    return {
        "qkv_proj": grouped_t(hkv, src.get(pre + "q_proj.weight", (hq * hd, d)),
                              src.get(pre + "k_proj.weight", (hkv * hd, d)),
                              src.get(pre + "v_proj.weight", (hkv * hd, d))),
        "o_proj": src.get(pre + "o_proj.weight", (d, hq * hd)).T,
    }
