"""``ModelConfig`` for the Mamba2 hybrids: Nemotron-H / Nemotron 3 (``nemotron_h``) and IBM
Granite 4.0-H (``granitemoehybrid``), read from a Hugging Face ``config.json``.

The Mamba2 sizes live in ``ModelConfig``'s linear_* fields, so the pools, the tensor-parallel
specs and the tree need no Mamba2-specific code: key heads = ``n_groups`` (G), key dim =
``ssm_state_size`` (N), value heads = ``mamba_num_heads`` (H), value dim = ``mamba_head_dim``
(P), conv kernel = ``conv_kernel``; ``linear_conv_dim = H*P + 2*G*N`` is Mamba2's conv width and
the SSM pool row ``[H, N, P]``.

Nemotron-H blocks hold one sublayer each: ``layer_types[i]`` is ``linear_attention`` (Mamba2),
``full_attention`` or ``none``, and ``mlp_types[i]`` is ``none``, ``dense`` (relu2 MLP) or
``moe``, exactly one of the two not ``none``. Granite layers are a mixer plus the shared MLP
(``dense``) or the MoE with the shared MLP (``moe``).

Fields we do not implement are a ``ValueError`` naming them (no silent approximation). Fields
transformers itself ignores are ignored too (Nemotron's ``residual_in_fp32``, ``n_shared_experts``,
``time_step_limit``: transformers clamps Nemotron's dt to ``(time_step_min, inf)``, and so do we).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

_MIXER = {"mamba": "linear_attention", "linear_attention": "linear_attention", "M": "mamba",
          "attention": "full_attention", "full_attention": "full_attention"}
_PATTERN = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
_INF = float("inf")


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def hf_float(value: Any) -> float:
    """A float as transformers writes it: a number, or ``{"__float__": "Infinity"}`` (its JSON
    encoding of the non-finite floats since 5.x), or the strings ``"inf"`` / ``"Infinity"``."""
    if isinstance(value, Mapping) and "__float__" in value:
        value = value["__float__"]
    return float(value)


def _unsupported(hf: Mapping[str, Any], checks: dict[str, Any]) -> None:
    """``ValueError`` for every key whose value differs from the one we implement."""
    bad = {k: hf[k] for k, ok in checks.items() if k in hf and hf[k] is not None and hf[k] != ok}
    _require(not bad, f"unsupported config values {bad}; supported: "
                      f"{ {k: checks[k] for k in bad} }")


def _nemotron_blocks(hf: Mapping[str, Any]) -> list[str]:
    blocks = hf.get("layers_block_type")
    if blocks is None and "hybrid_override_pattern" in hf:
        pattern = hf["hybrid_override_pattern"]
        bad = sorted(set(pattern) - set(_PATTERN))
        _require(not bad, f"hybrid_override_pattern {pattern!r} has unknown symbols {bad}; "
                          f"known: {sorted(_PATTERN)}")
        blocks = [_PATTERN[s] for s in pattern]
    _require(bool(blocks), "nemotron_h config needs layers_block_type or hybrid_override_pattern")
    names = {"linear_attention": "mamba", "full_attention": "attention"}
    blocks = [names.get(b, b) for b in blocks]
    bad = sorted(set(blocks) - {"mamba", "attention", "mlp", "moe"})
    _require(not bad, f"unknown Nemotron-H block types {bad}")
    return blocks


def _mamba_sizes(**sizes: Any) -> dict[str, int]:
    keys = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
            "linear_value_head_dim", "linear_conv_kernel_dim")
    return {k: int(sizes[k]) for k in keys}


def nemotron_from_hf(hf: Mapping[str, Any]) -> dict[str, Any]:
    """``ModelConfig`` keyword arguments for a ``NemotronHForCausalLM`` config."""
    _unsupported(hf, {"mamba_hidden_act": "silu", "mlp_hidden_act": "relu2", "use_bias": False,
                      "mlp_bias": False, "attention_bias": False, "use_conv_bias": True,
                      "mamba_conv_bias": True, "moe_latent_size": None, "sliding_window": None})
    blocks = _nemotron_blocks(hf)
    heads = int(hf["num_attention_heads"])
    return dict(
        family="nemotron_h",
        layer_types=tuple("none" if b in ("mlp", "moe") else _MIXER[b] for b in blocks),
        mlp_types=tuple({"mlp": "dense", "moe": "moe"}.get(b, "none") for b in blocks),
        num_attention_heads=heads, num_key_value_heads=int(hf.get("num_key_value_heads", heads)),
        head_dim=int(hf.get("head_dim") or hf.get("attention_head_dim")  # Nemotron-H-8B's name
                     or int(hf["hidden_size"]) // heads),
        **_mamba_sizes(linear_num_key_heads=hf.get("n_groups", hf.get("mamba_n_groups", 8)),
                       linear_num_value_heads=hf["mamba_num_heads"],
                       linear_key_head_dim=hf["ssm_state_size"],
                       linear_value_head_dim=hf["mamba_head_dim"],
                       linear_conv_kernel_dim=hf.get("conv_kernel", hf.get("mamba_d_conv", 4))),
        time_step_limit=(float(hf.get("time_step_min", hf.get("mamba_dt_min", 0.001))), _INF),
        use_rope=False, partial_rotary_factor=1.0,
        rms_norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
        intermediate_size=int(hf.get("intermediate_size") or 0),
        num_experts=int(hf.get("n_routed_experts") or 0),
        num_experts_per_tok=int(hf.get("num_experts_per_tok") or 0),
        moe_intermediate_size=int(hf.get("moe_intermediate_size") or 0),
        shared_expert_intermediate_size=int(hf.get("moe_shared_expert_intermediate_size") or 0),
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)), n_group=int(hf.get("n_group", 1)),
        topk_group=int(hf.get("topk_group", 1)),
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
    )


def _granite_rope(hf: Mapping[str, Any]) -> dict[str, Any]:
    if hf.get("position_embedding_type") != "rope":
        return dict(use_rope=False, partial_rotary_factor=1.0)
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    _require(rope_type == "default", f"only default RoPE is supported, got {rope_type!r}")
    return dict(use_rope=True, rope_theta=float(params.get("rope_theta",
                                                           hf.get("rope_theta", 10000.0))),
                partial_rotary_factor=float(params.get("partial_rotary_factor", 1.0)))


def granite_from_hf(hf: Mapping[str, Any]) -> dict[str, Any]:
    """``ModelConfig`` keyword arguments for a ``GraniteMoeHybridForCausalLM`` config."""
    _unsupported(hf, {"hidden_act": "silu", "attention_bias": False, "mamba_proj_bias": False,
                      "mamba_conv_bias": True})
    d, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    n = int(hf.get("num_hidden_layers") or len(hf["layer_types"]))
    kinds = list(hf.get("layer_types") or hf.get("layers_block_type") or ["mamba"] * n)[:n]
    bad = sorted(set(kinds) - set(_MIXER))
    _require(not bad, f"unknown Granite layer types {bad}")
    mamba_heads = int(hf.get("mamba_n_heads", 128))
    inner = int(hf.get("mamba_expand", 2)) * d
    d_head = hf.get("mamba_d_head", "auto")
    d_head = inner // mamba_heads if d_head == "auto" else int(d_head)
    _require(d_head * mamba_heads == inner,
             f"mamba_d_head ({d_head}) * mamba_n_heads ({mamba_heads}) must equal "
             f"mamba_expand * hidden_size ({inner})")
    experts = int(hf.get("num_local_experts") or 0)
    shared = int(hf.get("shared_intermediate_size") or 0)
    limit = tuple(hf_float(v) for v in (hf.get("time_step_limit") or (0.0, _INF)))
    return dict(
        family="granitemoehybrid", layer_types=tuple(_MIXER[k] for k in kinds),
        mlp_types=("moe" if experts > 0 else "dense",) * n,
        num_attention_heads=heads, num_key_value_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or d // heads),
        **_mamba_sizes(linear_num_key_heads=hf.get("mamba_n_groups", 1),
                       linear_num_value_heads=mamba_heads,
                       linear_key_head_dim=hf.get("mamba_d_state", 256),
                       linear_value_head_dim=d_head,
                       linear_conv_kernel_dim=hf.get("mamba_d_conv", 4)),
        time_step_limit=limit, **_granite_rope(hf),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        intermediate_size=shared, num_experts=experts,
        num_experts_per_tok=int(hf.get("num_experts_per_tok") or 0) if experts else 0,
        moe_intermediate_size=int(hf.get("intermediate_size") or 0) if experts else 0,
        shared_expert_intermediate_size=shared,
        embedding_multiplier=float(hf.get("embedding_multiplier", 1.0)),
        residual_multiplier=float(hf.get("residual_multiplier", 1.0)),
        attention_multiplier=float(hf.get("attention_multiplier", 1.0)),
        logits_scaling=float(hf.get("logits_scaling", 1.0)),
    )


def mamba2_from_hf(cls: type, hf: Mapping[str, Any], family: str) -> Any:
    """Build a ``ModelConfig`` (``cls``) for a Mamba2-hybrid family."""
    fields = nemotron_from_hf(hf) if family == "nemotron_h" else granite_from_hf(hf)
    h, g = fields["linear_num_value_heads"], fields["linear_num_key_heads"]
    _require(h % g == 0, f"Mamba2 heads ({h}) must be a multiple of n_groups ({g})")
    return cls(vocab_size=int(hf["vocab_size"]), hidden_size=int(hf["hidden_size"]),
               max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
               tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)), **fields)


def validate_mamba2(cfg: Any) -> None:
    """``ValueError`` unless ``cfg`` is a consistent Mamba2-hybrid config."""
    h, g = cfg.linear_num_value_heads, cfg.linear_num_key_heads
    _require(h % g == 0, f"Mamba2 heads ({h}) must be a multiple of n_groups ({g})")
    lo, hi = cfg.time_step_limit
    _require(0.0 <= lo < hi, f"time_step_limit {cfg.time_step_limit} must satisfy 0 <= lo < hi")
    pairs = list(zip(cfg.layer_types, cfg.mlp_types, strict=True))
    if cfg.family == "nemotron_h":
        bad = [i for i, (k, m) in enumerate(pairs) if (k == "none") == (m == "none")]
        _require(not bad, f"Nemotron-H blocks {bad} must have exactly one of a mixer and an MLP")
    else:
        _require("none" not in cfg.layer_types + cfg.mlp_types,
                 "Granite layers need a mixer and an MLP in every layer")
    if "moe" in cfg.mlp_types and cfg.family == "nemotron_h":
        e = cfg.num_experts
        _require(e % cfg.n_group == 0 and 1 <= cfg.topk_group <= cfg.n_group,
                 f"n_routed_experts ({e}) must split into n_group ({cfg.n_group}) groups with "
                 f"1 <= topk_group ({cfg.topk_group}) <= n_group")
