"""Nemotron-H and Nemotron 3 (``NemotronHForCausalLM``): Mamba2 + attention + MLP / MoE blocks.

Each block holds one sublayer: ``layer_types[i]`` is ``linear_attention`` (Mamba2),
``full_attention`` (GQA, no RoPE) or ``none``, and ``mlp_types[i]`` is ``none``, ``dense``
(relu2 MLP) or ``moe`` (sigmoid routing with a correction bias, ``n_group`` groups, a relu2
shared expert), exactly one of the two not ``none``. The blocks come from
``layers_block_type`` or the released checkpoints' ``hybrid_override_pattern`` (``M`` Mamba2,
``*`` attention, ``-`` MLP, ``E`` MoE). Norms multiply by a plain weight in fp32.

Fields we do not implement are a ``ValueError`` naming them. Fields transformers itself ignores
are ignored too (``residual_in_fp32``, ``n_shared_experts``, ``time_step_limit``: transformers
clamps Nemotron's dt to ``(time_step_min, inf)``, and so do we).

Parameters: one norm per block (``input_norm``) and its sublayer: mamba / attn
(``mamba2_common.py``), mlp (up ``[D, I]``, down ``[I, D]``) or moe (router ``[D, E]``,
router_bias ``[E]``, up ``[E, D, Im]``, down ``[E, Im, D]``, shared_up ``[D, Is]``, shared_down
``[Is, D]``). Checkpoints name the trunk ``backbone.`` (released) or ``model.`` (transformers 5
in memory): ``embeddings``, ``layers.i.norm``, ``layers.i.mixer.*``, ``norm_f``; experts per
expert or fused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from models.families.base import INF, Family, require, unsupported
from models.families.mamba2_common import (
    MIXER_TYPES,
    common_fields,
    load_mamba,
    load_plain_attn,
    mamba_sizes,
    mixer_shapes,
    validate_mamba2,
)
from models.hf_tensors import stacked_t
from models.layers import rms_norm_f32_weight
from models.mamba2_blocks import nemotron_ffn
from models.mixer_registry import MIXERS
from models.safetensors_io import TensorSource

if TYPE_CHECKING:
    from models.config import ModelConfig

_PATTERN = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}


def _blocks(hf: Mapping[str, Any]) -> list[str]:
    blocks = hf.get("layers_block_type")
    if blocks is None and "hybrid_override_pattern" in hf:
        pattern = hf["hybrid_override_pattern"]
        bad = sorted(set(pattern) - set(_PATTERN))
        require(not bad, f"hybrid_override_pattern {pattern!r} has unknown symbols {bad}; "
                         f"known: {sorted(_PATTERN)}")
        blocks = [_PATTERN[s] for s in pattern]
    require(bool(blocks), "nemotron_h config needs layers_block_type or hybrid_override_pattern")
    names = {"linear_attention": "mamba", "full_attention": "attention"}
    blocks = [names.get(b, b) for b in blocks]
    bad = sorted(set(blocks) - {"mamba", "attention", "mlp", "moe"})
    require(not bad, f"unknown Nemotron-H block types {bad}")
    return blocks


def _ffn_shapes(cfg: ModelConfig, mlp: str) -> dict[str, Any]:
    d, e, im, is_ = (cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size,
                     cfg.shared_expert_intermediate_size)
    if mlp == "none":
        return {}
    if mlp == "dense":
        return {"mlp": {"up": (d, cfg.intermediate_size), "down": (cfg.intermediate_size, d)}}
    return {"moe": {"router": (d, e), "router_bias": (e,), "up": (e, d, im), "down": (e, im, d),
                    "shared_up": (d, is_), "shared_down": (is_, d)}}


def _load_ffn(cfg: ModelConfig, src: TensorSource, pre: str, kind: str) -> dict[str, Any]:
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
        "up": stacked_t(src, ex + "up_proj", ex + "{}.up_proj.weight", e, (im, d)),
        "down": stacked_t(src, ex + "down_proj", ex + "{}.down_proj.weight", e, (d, im)),
        "shared_up": src.get(pre + "shared_experts.up_proj.weight", (is_, d)).T,
        "shared_down": src.get(pre + "shared_experts.down_proj.weight", (d, is_)).T,
    }}


def _load_block(cfg: ModelConfig, src: TensorSource, pre: str, i: int) -> dict[str, Any]:
    layer: dict[str, Any] = {"input_norm": src.get(pre + "norm.weight", (cfg.hidden_size,))}
    kind, mlp = cfg.layer_types[i], cfg.mlp_types[i]
    if kind == "linear_attention":
        layer["mamba"] = load_mamba(cfg, src, pre + "mixer.")
    elif kind == "full_attention":
        layer["attn"] = load_plain_attn(cfg, src, pre + "mixer.")
    else:
        layer.update(_load_ffn(cfg, src, pre + "mixer.", mlp))
    return layer


class NemotronHFamily(Family):
    name = "nemotron_h"
    architectures = ("NemotronHForCausalLM",)
    model_types = ("nemotron_h",)
    linear_groups_replicate = True
    mixers = {"linear_attention": MIXERS["mamba2"], "full_attention": MIXERS["attention"]}
    norm = staticmethod(rms_norm_f32_weight)
    ffn = staticmethod(nemotron_ffn)

    def config_fields(self, hf: Mapping[str, Any]) -> dict[str, Any]:
        unsupported(hf, {"mamba_hidden_act": "silu", "mlp_hidden_act": "relu2",
                         "use_bias": False, "mlp_bias": False, "attention_bias": False,
                         "use_conv_bias": True, "mamba_conv_bias": True,
                         "moe_latent_size": None, "sliding_window": None}, self.name)
        blocks = _blocks(hf)
        heads = int(hf["num_attention_heads"])
        return common_fields(hf, dict(
            family=self.name,
            layer_types=tuple("none" if b in ("mlp", "moe") else MIXER_TYPES[b] for b in blocks),
            mlp_types=tuple({"mlp": "dense", "moe": "moe"}.get(b, "none") for b in blocks),
            num_attention_heads=heads,
            num_key_value_heads=int(hf.get("num_key_value_heads", heads)),
            head_dim=int(hf.get("head_dim") or hf.get("attention_head_dim")  # Nemotron-H-8B
                         or int(hf["hidden_size"]) // heads),
            **mamba_sizes(groups=hf.get("n_groups", hf.get("mamba_n_groups", 8)),
                          heads=hf["mamba_num_heads"], state=hf["ssm_state_size"],
                          head_dim=hf["mamba_head_dim"],
                          kernel=hf.get("conv_kernel", hf.get("mamba_d_conv", 4))),
            time_step_limit=(float(hf.get("time_step_min", hf.get("mamba_dt_min", 0.001))), INF),
            use_rope=False, partial_rotary_factor=1.0,
            rms_norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
            intermediate_size=int(hf.get("intermediate_size") or 0),
            num_experts=int(hf.get("n_routed_experts") or 0),
            num_experts_per_tok=int(hf.get("num_experts_per_tok") or 0),
            moe_intermediate_size=int(hf.get("moe_intermediate_size") or 0),
            shared_expert_intermediate_size=int(
                hf.get("moe_shared_expert_intermediate_size") or 0),
            norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
            n_group=int(hf.get("n_group", 1)), topk_group=int(hf.get("topk_group", 1)),
            routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0))))

    def validate(self, cfg: ModelConfig) -> None:
        validate_mamba2(cfg)
        pairs = list(zip(cfg.layer_types, cfg.mlp_types, strict=True))
        bad = [i for i, (k, m) in enumerate(pairs) if (k == "none") == (m == "none")]
        require(not bad, f"Nemotron-H blocks {bad} must have exactly one of a mixer and an MLP")
        if "moe" in cfg.mlp_types:
            e = cfg.num_experts
            require(e % cfg.n_group == 0 and 1 <= cfg.topk_group <= cfg.n_group,
                    f"n_routed_experts ({e}) must split into n_group ({cfg.n_group}) groups "
                    f"with 1 <= topk_group ({cfg.topk_group}) <= n_group")

    def layer_shapes(self, cfg: ModelConfig, kind: str, mlp: str) -> dict[str, Any]:
        return {"input_norm": (cfg.hidden_size,), **mixer_shapes(cfg, kind),
                **_ffn_shapes(cfg, mlp)}

    def load_trunk(self, cfg: ModelConfig, src: TensorSource) -> dict[str, Any]:
        pre = "backbone." if "backbone.embeddings.weight" in src else "model."
        v, d = cfg.vocab_size, cfg.hidden_size
        return {"embed": src.get(pre + "embeddings.weight", (v, d)),
                "final_norm": src.get(pre + "norm_f.weight", (d,)),
                "layers": tuple(_load_block(cfg, src, f"{pre}layers.{i}.", i)
                                for i in range(cfg.num_hidden_layers))}


NEMOTRON_H = NemotronHFamily()
