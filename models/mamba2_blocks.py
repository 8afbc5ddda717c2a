"""The non-Mamba blocks of the Mamba2 hybrids: plain GQA attention over paged KV (optional RoPE,
Granite's attention multiplier), Nemotron-H's squared-ReLU MLP and sigmoid-routed MoE, Granite's
softmax top-k MoE with its shared SwiGLU (``models/moe.py``, grouped on GPU / TPU).

Params (``[in, out]`` weights, ``models/families/``): attention ``qkv_proj`` group-major
per KV head (``r`` query heads, then k, then v, ``D`` each) and ``o_proj``; Nemotron MLP ``up``,
``down``; Nemotron MoE ``router [D, E]``, ``router_bias [E]``, ``up [E, D, I]``, ``down [E, I,
D]``, ``shared_up``, ``shared_down``; Granite MoE in ``models/moe.py``'s layout without a shared
gate (router, gate_up ``[E, D, 2I]`` gate | up, down, shared_gate_up pair-interleaved,
shared_down), or without experts the shared MLP alone (``gate_up``, ``down``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from models.config import ModelConfig
from models.layers import F32, apply_rope, rope_cos_sin, swiglu
from models.moe import dense_moe, moe_dense_reference, moe_grouped, route, routed_experts
from pallas_kernels import ops


def relu2(x: jax.Array) -> jax.Array:
    """Squared ReLU (transformers' ``relu2``)."""
    return jnp.square(jax.nn.relu(x))


def plain_attention(cfg: ModelConfig, p: dict[str, jax.Array], x: jax.Array,
                    k_pages: jax.Array, v_pages: jax.Array, batch: Any, *, impl: str,
                    mesh: Mesh | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """GQA without q/k norms or output gate. x ``[T, D]`` -> (out, k_pages, v_pages).

    RoPE (full NeoX over ``rotary_dim``) only if ``cfg.use_rope``; the softmax scale is
    ``cfg.attention_multiplier`` when set (Granite), else ``head_dim ** -0.5``.
    """
    t = x.shape[0]
    d, hq, hkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    r = hq // hkv
    proj = (x @ p["qkv_proj"]).reshape(t, hkv, (r + 2) * d)
    q = proj[..., :r * d].reshape(t, hq, d)
    k, v = proj[..., r * d:(r + 1) * d], proj[..., (r + 1) * d:]
    if cfg.use_rope:
        cos, sin = rope_cos_sin(batch.positions, cfg.rotary_dim, cfg.rope_theta, x.dtype)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    k_pages, v_pages = ops.write_kv(k_pages, v_pages, k, v, batch.out_cache_loc)
    scale = cfg.attention_multiplier or d ** -0.5
    o = ops.paged_attention(q, k_pages, v_pages, batch.cu_seqlens, batch.seq_lens,
                            batch.page_table, scale=scale, impl=impl, mesh=mesh,
                            fixed_order=cfg.deterministic)
    return o.reshape(t, hq * d) @ p["o_proj"], k_pages, v_pages


def nemotron_mlp(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    """``down(relu2(up(x)))``; x ``[T, D]``."""
    return relu2(x @ p["up"]) @ p["down"]


def _weights(top_vals: jax.Array, top_idx: jax.Array, num_experts: int) -> jax.Array:
    """Dense per-expert weights ``[T, E]`` float32 (0 outside the top-k)."""
    one_hot = jax.nn.one_hot(top_idx, num_experts, dtype=F32)
    return jnp.einsum("tk,tke->te", top_vals.astype(F32), one_hot)


def nemotron_moe(cfg: ModelConfig, p: dict[str, jax.Array], x: jax.Array, impl: str = "reference",
                 mesh: Mesh | None = None) -> jax.Array:
    """Sigmoid-scored, group-limited top-k over non-gated relu2 experts, plus the shared expert
    on the same input; routing in fp32 as transformers. With the references the dense form
    (every expert on every token, weight 0 outside the top-k: exact, ``T * E`` evaluations);
    with the Pallas kernels the grouped matmul kernel (``models/moe.py``, ``T * k``)."""
    num_experts = p["router"].shape[-1]
    top_vals, top_idx = route(x.astype(F32), p["router"].astype(F32), cfg.num_experts_per_tok,
                              cfg.norm_topk_prob, bias=p["router_bias"],
                              groups=(cfg.n_group, cfg.topk_group),
                              scale=cfg.routed_scaling_factor, fixed_order=cfg.deterministic)
    if dense_moe(cfg, impl):
        w = _weights(top_vals, top_idx, num_experts)                 # [T, E]
        h = relu2(jnp.einsum("td,edi->tei", x, p["up"]))
        per_expert = jnp.einsum("tei,eid->ted", h, p["down"]).astype(F32)
        routed = jnp.einsum("ted,te->td", per_expert, w)
    else:
        routed = routed_experts(x, top_vals, top_idx, p["up"], p["down"], activation="relu2",
                                mesh=mesh, impl=impl)
    return routed.astype(x.dtype) + relu2(x @ p["shared_up"]) @ p["shared_down"]


def nemotron_ffn(cfg: ModelConfig, layer: dict[str, Any], x: jax.Array, impl: str,
                 mesh: Mesh | None) -> jax.Array:
    """The sublayer of a Nemotron-H MLP (``layer["mlp"]``) or MoE (``layer["moe"]``) block."""
    if "moe" in layer:
        return nemotron_moe(cfg, layer["moe"], x, impl, mesh)
    return nemotron_mlp(layer["mlp"], x)


def granite_ffn(cfg: ModelConfig, layer: dict[str, Any], x: jax.Array, impl: str,
                mesh: Mesh | None) -> jax.Array:
    """Granite's feed-forward: the MoE plus the shared SwiGLU (``models/moe.py``: softmax over
    the top-k router logits equals the top-k of the full softmax renormalised), grouped with
    the Pallas kernels, dense with the references; or the shared SwiGLU alone."""
    if "moe" not in layer:
        return swiglu(x, layer["mlp"]["gate_up"], layer["mlp"]["down"])
    if dense_moe(cfg, impl):
        return moe_dense_reference(x, layer["moe"], cfg.num_experts_per_tok, True,
                                   fixed_order=cfg.deterministic)
    return moe_grouped(x, layer["moe"], cfg.num_experts_per_tok, True, mesh=mesh, impl=impl,
                       fixed_order=cfg.deterministic)
