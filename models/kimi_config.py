"""Kimi Linear (``KimiLinearForCausalLM``) in ``ModelConfig`` terms: the HF config read, checked.

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
naming the key and the supported value.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

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


def kimi_from_hf(cls: type, hf: Mapping[str, Any]) -> Any:
    """``ModelConfig`` for a ``KimiLinearForCausalLM`` ``config.json`` (transformers' key names
    or the original checkpoint's: ``linear_attn_config``, ``num_experts_per_token``, ...)."""
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
    return cls(
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


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def validate_kimi(cfg: Any) -> None:
    """``ValueError`` unless ``cfg`` (a ``ModelConfig`` of family ``kimi_linear``) is coherent."""
    _require(cfg.linear_num_key_heads == cfg.linear_num_value_heads
             and cfg.linear_key_head_dim == cfg.linear_value_head_dim,
             f"KDA uses one head count and dim for q, k, v: got key heads "
             f"{cfg.linear_num_key_heads} x {cfg.linear_key_head_dim}, value heads "
             f"{cfg.linear_num_value_heads} x {cfg.linear_value_head_dim}")
    if cfg.num_full_layers:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            value = getattr(cfg, name)
            _require(isinstance(value, int) and value > 0,
                     f"MLA needs {name} > 0, got {value!r}")
        _require(cfg.num_key_value_heads == cfg.num_attention_heads,
                 f"MLA: num_key_value_heads ({cfg.num_key_value_heads}) must equal "
                 f"num_attention_heads ({cfg.num_attention_heads})")
        _require(cfg.head_dim == cfg.qk_nope_head_dim + cfg.qk_rope_head_dim,
                 f"MLA: head_dim ({cfg.head_dim}) must be qk_nope_head_dim + qk_rope_head_dim "
                 f"({cfg.qk_nope_head_dim} + {cfg.qk_rope_head_dim})")
    if "moe" in cfg.mlp_types:
        e, g = cfg.num_experts, cfg.n_group
        _require(g >= 1 and e % g == 0 and e // g >= 2,
                 f"n_group ({g}) must divide num_experts ({e}) into groups of >= 2 experts")
        _require(1 <= cfg.topk_group <= g,
                 f"topk_group ({cfg.topk_group}) must be in [1, n_group={g}]")
        _require(cfg.num_experts_per_tok <= cfg.topk_group * (e // g),
                 f"num_experts_per_tok ({cfg.num_experts_per_tok}) exceeds the experts of "
                 f"topk_group ({cfg.topk_group}) groups of {e // g}")
