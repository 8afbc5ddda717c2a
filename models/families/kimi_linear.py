"""Kimi Linear (``KimiLinearForCausalLM``): KDA + MLA hybrid with DeepSeek-style MoE.

The family reuses ``ModelConfig``'s fields where the meaning is the same and maps the rest:

* KDA layers (``layer_types == "linear_attention"``): ``linear_num_heads`` heads of
  ``linear_head_dim`` for q, k and v alike (``linear_num_key_heads == linear_num_value_heads``,
  ``linear_key_head_dim == linear_value_head_dim``), so the conv and state pools have the Gated
  DeltaNet shapes (conv channels ``3 * H * D``: q | k | v; state ``[H, D, D]``).
* MLA layers (``"full_attention"``): ``num_attention_heads`` heads, no RoPE (Kimi Linear's MLA is
  NoPE: the ``qk_rope_head_dim`` part of the key is shared by the heads but not rotated),
  ``head_dim = qk_nope_head_dim + qk_rope_head_dim``; the KV pool holds per token the latent
  (``kv_lora_rank``, after ``kv_a_layernorm``) and the shared key part (``qk_rope_head_dim``).
* MoE (``mlp_layer_types == "sparse"``): sigmoid scores, ``e_score_correction_bias`` for the
  choice only, ``n_group`` groups of which ``topk_group`` are kept (group score: the sum of its
  two best biased scores), top-k experts, renormalised if ``norm_topk_prob``, times
  ``routed_scaling_factor``; ``n_shared_experts`` shared experts of ``moe_intermediate_size``
  each, one ungated SwiGLU of ``n_shared_experts * moe_intermediate_size``.

Every norm of this family is plain (``w * x / rms(x)``). Unsupported options are a ``ValueError``
naming the key and the supported value. The MLA is NoPE, so Qwen's partial-RoPE rule does not
apply: any ``qk_rope_head_dim`` / ``qk_nope_head_dim`` / ``v_head_dim`` is legal.

Parameters (``[in, out]`` weights; ``Hl`` KDA heads of ``D``, ``R = kv_lora_rank``, ``dn / dr /
dv`` the MLA nope / rope / value dims; head axes first or whole column groups, so a
tensor-parallel split on heads needs no regrouping):

  kda: in_proj ``[H, Hl*3*D]`` per head ``q_h | k_h | v_h``, conv_w ``[K, Hl*3*D]`` (same channel
    order; the conv pool too), f_a ``[H, D]``, f_b ``[D, Hl*D]``, dt_bias ``[Hl, D]``, A_log
    ``[Hl]``, b_proj ``[H, Hl]``, g_a ``[H, D]``, g_b ``[D, Hl*D]``, norm ``[D]``, out_proj
    ``[Hl*D, H]``;
  mla: q_proj ``[H, Hq*(dn+dr)]`` (per head ``nope | rope``), kv_a ``[H, R+dr]``, kv_norm ``[R]``,
    k_up ``[Hq, R, dn]``, v_up ``[Hq, R, dv]`` (HF's ``kv_b_proj`` split per head), o_proj
    ``[Hq*dv, H]``;
  moe: router ``[H, E]``, router_bias ``[E]``, gate_up ``[E, H, 2*Im]`` (gate | up), down
    ``[E, Im, H]``, shared_gate_up ``[H, 2*Is]`` pair-interleaved, shared_down ``[Is, H]``.

Checkpoint names (Moonshot's and transformers' ``save_pretrained``): ``self_attn.{q,k,v}_proj``,
``{q,k,v}_conv1d``, ``f_a_proj``, ``f_b_proj``, ``dt_bias [H*D]``, ``A_log [1, 1, H, 1]``,
``b_proj``, ``g_a_proj``, ``g_b_proj``, ``o_norm``, ``o_proj`` for KDA; ``q_proj``,
``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj`` (per head ``k_nope | v``), ``o_proj``
for MLA; ``block_sparse_moe.`` (or ``mlp.``) for the dense MLP and the MoE (``gate.weight``,
``gate.e_score_correction_bias``, ``experts.{e}.w1/w2/w3`` = gate / down / up,
``shared_experts.*``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from models.families.base import Family, check_mixer_and_mlp_everywhere, require
from models.hf_tensors import swiglu_t
from models.kda import kda_shapes
from models.layers import rms_norm_plain
from models.mixer_registry import MIXERS
from models.mla import mla_shapes
from models.moe import mlp_block
from models.params import mlp_shapes
from models.safetensors_io import TensorSource

if TYPE_CHECKING:
    from models.config import ModelConfig

_MISSING = object()


def _get(hf: Mapping[str, Any], *names: str, default: Any = _MISSING) -> Any:
    """The first of ``names`` present (not None) in ``hf``; ``ValueError`` if none and no
    default."""
    for name in names:
        if hf.get(name) is not None:
            return hf[name]
    if default is _MISSING:
        raise ValueError(f"Kimi Linear config.json lacks {' / '.join(names)}")
    return default


def _unsupported(hf: Mapping[str, Any]) -> None:
    checks = (("hidden_act", "silu"), ("attention_bias", False), ("q_lora_rank", None),
              ("mla_use_nope", True), ("moe_router_activation_func", "sigmoid"),
              ("moe_layer_freq", 1), ("rope_scaling", None))
    for key, ok in checks:
        if key in hf and hf[key] != ok:
            raise ValueError(f"Kimi Linear: {key}={hf[key]!r} is not supported (only {ok!r})")


def _layer_types(hf: Mapping[str, Any], lin: Mapping[str, Any], n: int) -> list[str]:
    if hf.get("layer_types"):
        return list(hf["layer_types"])[:n]
    if "full_attn_layers" in lin and "kda_layers" in lin:  # 1-indexed in the checkpoint
        types = [""] * n
        for i in lin["full_attn_layers"]:
            types[i - 1] = "full_attention"
        for i in lin["kda_layers"]:
            types[i - 1] = "linear_attention"
        return types
    return ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n)]


def _mlp_types(hf: Mapping[str, Any], n: int) -> tuple[str, ...]:
    names = hf.get("mlp_layer_types")
    if not names:
        first = int(hf.get("first_k_dense_replace", 1))
        names = ["dense" if i < first else "sparse" for i in range(n)]
    bad = [t for t in names if t not in ("dense", "sparse")]
    if bad:
        raise ValueError(f"Kimi Linear mlp_layer_types entries must be 'dense' or 'sparse', "
                         f"got {bad}")
    return tuple("moe" if t == "sparse" else "dense" for t in names[:n])


def _config_fields(hf: Mapping[str, Any]) -> dict[str, Any]:
    """``ModelConfig`` fields of a ``KimiLinearForCausalLM`` ``config.json`` (transformers' key
    names or the original checkpoint's: ``linear_attn_config``, ``num_experts_per_token``,
    ...)."""
    _unsupported(hf)
    n = int(hf["num_hidden_layers"])
    lin = dict(hf.get("linear_attn_config") or {})
    heads = int(_get(lin, "num_heads", default=_get(hf, "linear_num_heads", default=32)))
    head_dim = int(_get(lin, "head_dim", default=_get(hf, "linear_head_dim", default=128)))
    kernel = int(_get(lin, "short_conv_kernel_size",
                      default=_get(hf, "linear_conv_kernel_dim", default=4)))
    nope, rope = int(_get(hf, "qk_nope_head_dim")), int(_get(hf, "qk_rope_head_dim"))
    attn_heads = int(hf["num_attention_heads"])
    moe_i = int(_get(hf, "moe_intermediate_size"))
    return dict(
        family="kimi_linear", vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]), layer_types=tuple(_layer_types(hf, lin, n)),
        mlp_types=_mlp_types(hf, n), num_attention_heads=attn_heads,
        num_key_value_heads=int(_get(hf, "num_key_value_heads", default=attn_heads)),
        head_dim=nope + rope, use_rope=False,  # MLA is NoPE
        linear_num_key_heads=heads, linear_num_value_heads=heads,
        linear_key_head_dim=head_dim, linear_value_head_dim=head_dim,
        linear_conv_kernel_dim=kernel, intermediate_size=int(hf.get("intermediate_size") or 0),
        num_experts=int(_get(hf, "num_experts", "num_local_experts")),
        num_experts_per_tok=int(_get(hf, "num_experts_per_token", "num_experts_per_tok")),
        moe_intermediate_size=moe_i,
        shared_expert_intermediate_size=moe_i * int(_get(hf, "num_shared_experts",
                                                         "n_shared_experts", default=1)),
        norm_topk_prob=bool(_get(hf, "moe_renormalize", "norm_topk_prob", default=True)),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
        max_position_embeddings=int(_get(hf, "model_max_length", "max_position_embeddings",
                                         default=1 << 20)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        kv_lora_rank=int(_get(hf, "kv_lora_rank")), qk_nope_head_dim=nope,
        qk_rope_head_dim=rope, v_head_dim=int(_get(hf, "v_head_dim")),
        n_group=int(_get(hf, "num_expert_group", "n_group", default=1)),
        topk_group=int(_get(hf, "topk_group", default=1)),
        routed_scaling_factor=float(_get(hf, "routed_scaling_factor", default=1.0)),
    )


def _validate(cfg: ModelConfig) -> None:
    """``ValueError`` unless ``cfg`` (a ``ModelConfig`` of family ``kimi_linear``) is coherent."""
    require(cfg.linear_num_key_heads == cfg.linear_num_value_heads
            and cfg.linear_key_head_dim == cfg.linear_value_head_dim,
            f"KDA uses one head count and dim for q, k, v: got key heads "
            f"{cfg.linear_num_key_heads} x {cfg.linear_key_head_dim}, value heads "
            f"{cfg.linear_num_value_heads} x {cfg.linear_value_head_dim}")
    if cfg.num_full_layers:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            value = getattr(cfg, name)
            require(isinstance(value, int) and value > 0,
                    f"MLA needs {name} > 0, got {value!r}")
        require(cfg.num_key_value_heads == cfg.num_attention_heads,
                f"MLA: num_key_value_heads ({cfg.num_key_value_heads}) must equal "
                f"num_attention_heads ({cfg.num_attention_heads})")
        require(cfg.head_dim == cfg.qk_nope_head_dim + cfg.qk_rope_head_dim,
                f"MLA: head_dim ({cfg.head_dim}) must be qk_nope_head_dim + qk_rope_head_dim "
                f"({cfg.qk_nope_head_dim} + {cfg.qk_rope_head_dim})")
    if "moe" in cfg.mlp_types:
        e, g = cfg.num_experts, cfg.n_group
        require(g >= 1 and e % g == 0 and e // g >= 2,
                f"n_group ({g}) must divide num_experts ({e}) into groups of >= 2 experts")
        require(1 <= cfg.topk_group <= g,
                f"topk_group ({cfg.topk_group}) must be in [1, n_group={g}]")
        require(cfg.num_experts_per_tok <= cfg.topk_group * (e // g),
                f"num_experts_per_tok ({cfg.num_experts_per_tok}) exceeds the experts of "
                f"topk_group ({cfg.topk_group}) groups of {e // g}")
    check_mixer_and_mlp_everywhere(cfg)


def _moe_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    h, e, im = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    is_ = cfg.shared_expert_intermediate_size
    return {
        "router": (h, e), "router_bias": (e,), "gate_up": (e, h, 2 * im), "down": (e, im, h),
        "shared_gate_up": (h, 2 * is_), "shared_down": (is_, h),
    }


def _load_kda(cfg: ModelConfig, src: TensorSource, pre: str) -> dict[str, np.ndarray]:
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


def _load_mla(cfg: ModelConfig, src: TensorSource, pre: str) -> dict[str, np.ndarray]:
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


def _load_moe(cfg: ModelConfig, src: TensorSource, pre: str) -> dict[str, np.ndarray]:
    h, e, im = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    gate_up, down = [], []
    for j in range(e):
        w1 = np.asarray(src.get(f"{pre}experts.{j}.w1.weight", (im, h)))
        w3 = np.asarray(src.get(f"{pre}experts.{j}.w3.weight", (im, h)))
        gate_up.append(np.concatenate([w1, w3]).T)
        down.append(np.asarray(src.get(f"{pre}experts.{j}.w2.weight", (h, im))).T)
    s_gate_up, s_down = swiglu_t(src, pre + "shared_experts.", h,
                                 cfg.shared_expert_intermediate_size)
    return {
        "router": src.get(pre + "gate.weight", (e, h)).T,
        "router_bias": src.get(pre + "gate.e_score_correction_bias", (e,)),
        "gate_up": np.stack(gate_up), "down": np.stack(down),
        "shared_gate_up": s_gate_up, "shared_down": s_down,
    }


def _load_layer(cfg: ModelConfig, src: TensorSource, pre: str, i: int) -> dict[str, Any]:
    """Decoder layer ``i`` (``pre`` = ``model.layers.{i}.``) in the params layout."""
    h = cfg.hidden_size
    layer: dict[str, Any] = {
        "input_norm": src.get(pre + "input_layernorm.weight", (h,)),
        "post_norm": src.get(pre + "post_attention_layernorm.weight", (h,)),
    }
    if cfg.layer_types[i] == "linear_attention":
        layer["kda"] = _load_kda(cfg, src, pre + "self_attn.")
    else:
        layer["mla"] = _load_mla(cfg, src, pre + "self_attn.")
    mlp = pre + ("block_sparse_moe." if pre + "block_sparse_moe.down_proj.weight" in src
                 or cfg.mlp_types[i] == "moe" else "mlp.")
    if cfg.mlp_types[i] == "moe":
        layer["moe"] = _load_moe(cfg, src, mlp)
    else:
        gate_up, down = swiglu_t(src, mlp, h, cfg.intermediate_size)
        layer["mlp"] = {"gate_up": gate_up, "down": down}
    return layer


class KimiLinearFamily(Family):
    name = "kimi_linear"
    architectures = ("KimiLinearForCausalLM",)
    model_types = ("kimi_linear",)
    mixers = {"linear_attention": MIXERS["kda"], "full_attention": MIXERS["mla"]}
    norm = staticmethod(rms_norm_plain)
    ffn = staticmethod(mlp_block)

    def config_fields(self, hf: Mapping[str, Any]) -> dict[str, Any]:
        return _config_fields(hf)

    def validate(self, cfg: ModelConfig) -> None:
        _validate(cfg)

    def layer_shapes(self, cfg: ModelConfig, kind: str, mlp: str) -> dict[str, Any]:
        h = cfg.hidden_size
        layer: dict[str, Any] = {"input_norm": (h,), "post_norm": (h,)}
        if kind == "linear_attention":
            layer["kda"] = kda_shapes(cfg)
        else:
            layer["mla"] = mla_shapes(cfg)
        if mlp == "moe":
            layer["moe"] = _moe_shapes(cfg)
        else:
            layer["mlp"] = mlp_shapes(cfg)
        return layer

    def load_trunk(self, cfg: ModelConfig, src: TensorSource) -> dict[str, Any]:
        h = cfg.hidden_size
        return {"embed": src.get("model.embed_tokens.weight", (cfg.vocab_size, h)),
                "final_norm": src.get("model.norm.weight", (h,)),
                "layers": tuple(_load_layer(cfg, src, f"model.layers.{i}.", i)
                                for i in range(cfg.num_hidden_layers))}


KIMI_LINEAR = KimiLinearFamily()
