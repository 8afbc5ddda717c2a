"""``load_checkpoint(path, dtype) -> (cfg, params)`` from a Hugging Face directory.

Reads ``config.json`` and ``model.safetensors`` (or a sharded ``model.safetensors.index.json``)
and maps the tensors onto the layout of ``models/params.py``: linear weights transposed to
``[in, out]``; ``in_proj``, ``conv_w`` and ``qkv_proj`` in its group-major order (Qwen3-Next's
``in_proj_qkvz`` / ``in_proj_ba`` are grouped per key head already and stay so; Qwen3.5's
separate ``in_proj_qkv/z/b/a``, HF's ``conv1d`` channels q | k | v and attention q/k/v are
regrouped per key / KV head); experts stacked (from either per-expert tensors or transformers'
fused ``gate_up_proj``/``down_proj``). A missing, unexpected or mis-shaped tensor is a
``ValueError`` naming it.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from models.config import MTP_FAMILIES, ModelConfig
from models.params import check_params
from models.safetensors_io import TensorSource, checkpoint_files

IGNORED = (re.compile(r"^mtp\."), re.compile(r"^model\.visual\."), re.compile(r"\.rotary_emb\."))


def _cat_t(*parts: np.ndarray) -> np.ndarray:
    """torch ``[out, in]`` pieces -> one ``[in, sum(out)]`` matrix."""
    return np.concatenate([np.asarray(p) for p in parts], axis=0).T


def _grouped_t(groups: int, *parts: np.ndarray) -> np.ndarray:
    """torch ``[out, in]`` pieces, each ``groups`` contiguous row blocks -> ``[in, sum(out)]``
    with columns group-major: group 0 of every piece (in argument order), then group 1, ..."""
    blocks = [np.asarray(p).reshape(groups, -1, np.shape(p)[-1]) for p in parts]
    return np.concatenate(blocks, axis=1).reshape(-1, blocks[0].shape[-1]).T


def gdn_conv_channel_order(cfg: ModelConfig) -> np.ndarray:
    """Indices into HF's conv channels ``q | k | v`` giving the group-major order: per key head
    ``j`` its ``q_j (Dk) | k_j (Dk) | v_j (r*Dv)``. ``[C]`` int."""
    hk, dk, kd = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_key_dim
    rdv = cfg.linear_value_dim // hk
    return np.concatenate([np.concatenate([np.arange(j * dk, (j + 1) * dk),
                                           kd + np.arange(j * dk, (j + 1) * dk),
                                           2 * kd + np.arange(j * rdv, (j + 1) * rdv)])
                           for j in range(hk)])


def _gdn(cfg: ModelConfig, src: TensorSource, pre: str) -> dict[str, np.ndarray]:
    h, hk, hv = cfg.hidden_size, cfg.linear_num_key_heads, cfg.linear_num_value_heads
    kd, vd = cfg.linear_key_dim, cfg.linear_value_dim
    order = gdn_conv_channel_order(cfg)
    if cfg.family == "qwen3_next":  # already grouped per key head: [q k v z]_j and [b a]_j
        in_proj = _grouped_t(hk, src.get(pre + "in_proj_qkvz.weight", (2 * kd + 2 * vd, h)),
                             src.get(pre + "in_proj_ba.weight", (2 * hv, h)))
    else:
        qkv = np.asarray(src.get(pre + "in_proj_qkv.weight", (cfg.linear_conv_dim, h)))[order]
        in_proj = _grouped_t(hk, qkv, src.get(pre + "in_proj_z.weight", (vd, h)),
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


def _attn(cfg: ModelConfig, src: TensorSource, pre: str) -> dict[str, np.ndarray]:
    """``qkv_proj`` group-major per KV head: its query heads' ``(q D | gate D)`` as HF's q_proj
    packs them, then ``k_j``, then ``v_j``."""
    h, d, hq, hkv = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    return {
        "qkv_proj": _grouped_t(hkv, src.get(pre + "q_proj.weight", (hq * 2 * d, h)),
                               src.get(pre + "k_proj.weight", (hkv * d, h)),
                               src.get(pre + "v_proj.weight", (hkv * d, h))),
        "q_norm": src.get(pre + "q_norm.weight", (d,)),
        "k_norm": src.get(pre + "k_norm.weight", (d,)),
        "o_proj": src.get(pre + "o_proj.weight", (h, hq * d)).T,
    }


def _swiglu(src: TensorSource, pre: str, h: int, i: int,
            interleave: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """``(gate_up [H, 2I], down [I, H])``; gate_up pair-interleaved (``layers.swiglu``) or, for
    stacked experts (``interleave=False``), gate | up."""
    gate = np.asarray(src.get(pre + "gate_proj.weight", (i, h)))
    up = np.asarray(src.get(pre + "up_proj.weight", (i, h)))
    gate_up = np.stack([gate, up], axis=1).reshape(2 * i, h).T if interleave else _cat_t(gate, up)
    return gate_up, src.get(pre + "down_proj.weight", (h, i)).T


def _experts(cfg: ModelConfig, src: TensorSource, pre: str) -> tuple[np.ndarray, np.ndarray]:
    h, e, i = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    if pre + "gate_up_proj" in src:  # transformers' fused in-memory layout
        gate_up = src.get(pre + "gate_up_proj", (e, 2 * i, h)).transpose(0, 2, 1)
        return gate_up, src.get(pre + "down_proj", (e, h, i)).transpose(0, 2, 1)
    pairs = [_swiglu(src, f"{pre}{j}.", h, i, interleave=False) for j in range(e)]
    return np.stack([p[0] for p in pairs]), np.stack([p[1] for p in pairs])


def _moe(cfg: ModelConfig, src: TensorSource, pre: str) -> dict[str, np.ndarray]:
    h = cfg.hidden_size
    gate_up, down = _experts(cfg, src, pre + "experts.")
    s_gate_up, s_down = _swiglu(src, pre + "shared_expert.", h, cfg.shared_expert_intermediate_size)
    return {
        "router": src.get(pre + "gate.weight", (cfg.num_experts, h)).T,
        "gate_up": gate_up, "down": down,
        "shared_gate_up": s_gate_up, "shared_down": s_down,
        "shared_gate": src.get(pre + "shared_expert_gate.weight", (1, h)).T,
    }


def _layer(cfg: ModelConfig, src: TensorSource, pre: str, i: int) -> dict[str, Any]:
    if cfg.family == "kimi_linear":
        from models.kimi_loader import kimi_layer
        return kimi_layer(cfg, src, pre, i)
    h = cfg.hidden_size
    layer: dict[str, Any] = {
        "input_norm": src.get(pre + "input_layernorm.weight", (h,)),
        "post_norm": src.get(pre + "post_attention_layernorm.weight", (h,)),
    }
    if cfg.layer_types[i] == "linear_attention":
        layer["gdn"] = _gdn(cfg, src, pre + "linear_attn.")
    else:
        layer["attn"] = _attn(cfg, src, pre + "self_attn.")
    if cfg.mlp_types[i] == "moe":
        layer["moe"] = _moe(cfg, src, pre + "mlp.")
    else:
        gate_up, down = _swiglu(src, pre + "mlp.", h, cfg.intermediate_size)
        layer["mlp"] = {"gate_up": gate_up, "down": down}
    return layer


def _prefix(src: TensorSource) -> str:
    for pre in ("model.language_model.", "model."):
        if pre + "embed_tokens.weight" in src:
            return pre
    raise ValueError("checkpoint tensor 'model.embed_tokens.weight' is missing")


def _mtp(cfg: ModelConfig, src: TensorSource) -> dict[str, Any]:
    """Qwen3-Next / Qwen3.5 ``mtp.*`` -> ``params["mtp"]`` (``params.mtp_shapes``)."""
    h, pre = cfg.hidden_size, "mtp.layers.0."
    layer: dict[str, Any] = {"input_norm": src.get(pre + "input_layernorm.weight", (h,)),
                             "post_norm": src.get(pre + "post_attention_layernorm.weight", (h,)),
                             "attn": _attn(cfg, src, pre + "self_attn.")}
    if cfg.mlp_types[-1] == "moe":
        layer["moe"] = _moe(cfg, src, pre + "mlp.")
    else:
        gate_up, down = _swiglu(src, pre + "mlp.", h, cfg.intermediate_size)
        layer["mlp"] = {"gate_up": gate_up, "down": down}
    return {"embed_norm": src.get("mtp.pre_fc_norm_embedding.weight", (h,)),
            "hidden_norm": src.get("mtp.pre_fc_norm_hidden.weight", (h,)),
            "fc": src.get("mtp.fc.weight", (h, 2 * h)).T, "layer": layer,
            "final_norm": src.get("mtp.norm.weight", (h,))}


def load_checkpoint(path: str | Path, dtype: Any = jnp.float32,
                    mtp: bool = False) -> tuple[ModelConfig, dict]:
    """Load ``(cfg, params)`` from a Hugging Face checkpoint directory, params cast to ``dtype``.
    ``mtp``: also load the multi-token-prediction head (``mtp.*``, ``models/mtp.py``); a
    ``ValueError`` if the checkpoint has none. Without it ``mtp.*`` is ignored."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"no config.json in {str(path)!r}")
    cfg = ModelConfig.from_hf_config(json.loads((path / "config.json").read_text()))
    src = TensorSource(checkpoint_files(path))
    v, h = cfg.vocab_size, cfg.hidden_size
    if cfg.family in ("nemotron_h", "granitemoehybrid"):
        from models.mamba2_loader import mamba2_tree
        tree: dict[str, Any] = mamba2_tree(cfg, src)
    else:
        pre = _prefix(src)
        tree = {
            "embed": src.get(pre + "embed_tokens.weight", (v, h)),
            "final_norm": src.get(pre + "norm.weight", (h,)),
            "layers": tuple(_layer(cfg, src, f"{pre}layers.{i}.", i)
                            for i in range(cfg.num_hidden_layers)),
        }
    if "lm_head.weight" in src or not cfg.tie_word_embeddings:
        tree["lm_head"] = src.get("lm_head.weight", (v, h)).T
    else:
        tree["lm_head"] = np.asarray(tree["embed"]).T
    if mtp:
        if cfg.family not in MTP_FAMILIES or "mtp.fc.weight" not in src:
            raise ValueError(f"speculative.method 'mtp' needs an MTP head (mtp.* tensors); "
                             f"the {cfg.family} checkpoint in {str(path)!r} has none")
        cfg = dataclasses.replace(cfg, num_mtp_layers=1)
        tree["mtp"] = _mtp(cfg, src)
    extra = sorted(k for k in src.keys() - src.used if not any(p.search(k) for p in IGNORED))
    if extra:
        raise ValueError(f"unexpected checkpoint tensor(s) {extra[:8]}"
                         f"{' ...' if len(extra) > 8 else ''} for {cfg.family}")
    params = _to_jax(tree, dtype)
    check_params(cfg, params)
    return cfg, params


def _to_jax(tree: Any, dtype: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _to_jax(v, dtype) for k, v in tree.items()}
    if isinstance(tree, tuple):
        return tuple(_to_jax(v, dtype) for v in tree)
    return jnp.asarray(np.ascontiguousarray(tree), dtype=dtype)
