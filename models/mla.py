"""Multi-head latent attention (MLA) of Kimi Linear over a paged latent cache.

Per token the KV pool keeps one row ``[R + dr]``: the latent ``c = rmsnorm(x @ kv_a[:, :R])``
(``kv_lora_rank`` R, plain norm with eps 1e-6 as transformers' ``kv_a_layernorm``) and the key
part shared by all heads, ``k_r = (x @ kv_a)[:, R:]`` (``qk_rope_head_dim`` dr; Kimi Linear's MLA
is NoPE: it is not rotated). Head h's key is ``[W_uk_h c | k_r]`` and value ``W_uv_h c``, so

  ``score_h(i, j) = q_nope_h,i . W_uk_h c_j + q_r_h,i . k_r_j = [W_uk_h^T q_nope_h,i | q_r_h,i]
  . [c_j | k_r_j]`` and ``o_h,i = W_uv_h sum_j p_h(i, j) c_j``:

attention over the latent rows with one shared KV head (``ops.mla_attention``), the per-head
up-projections applied to the query before and to the output after (the weight-absorbed form),
scale ``(dn + dr)^-0.5``. Used for prefill and decode alike: no per-head K/V is ever stored or
expanded (576 values per token at Kimi Linear's sizes against 10,240 for expanded K and V).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from models.config import ModelConfig
from models.layers import rms_norm_plain
from pallas_kernels import ops

KV_NORM_EPS = 1e-6  # transformers builds kv_a_layernorm with its default eps


def mla_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Parameter shapes of one MLA layer (``models/families/kimi_linear.py`` documents them)."""
    h, hq, r = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank
    dn, dr, dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    return {
        "q_proj": (h, hq * (dn + dr)), "kv_a": (h, r + dr), "kv_norm": (r,),
        "k_up": (hq, r, dn), "v_up": (hq, r, dv), "o_proj": (hq * dv, h),
    }


def mla_attention_layer(cfg: ModelConfig, p: dict[str, jax.Array], x: jax.Array,
                        latent_pages: jax.Array, batch: Any, *, impl: str,
                        mesh: Mesh | None = None) -> tuple[jax.Array, jax.Array]:
    """One MLA layer. x ``[T, H]`` -> (out ``[T, H]``, latent_pages ``[N, ps, 1, R + dr]``).

    This step's latent rows are written at ``batch.out_cache_loc`` before attending."""
    t, hq, r = x.shape[0], cfg.num_attention_heads, cfg.kv_lora_rank
    dn, dr, dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    q = (x @ p["q_proj"]).reshape(t, hq, dn + dr)
    kv = x @ p["kv_a"]
    latent = rms_norm_plain(kv[:, :r], p["kv_norm"], KV_NORM_EPS, fixed_order=cfg.deterministic)
    latent_pages = ops.write_latent(latent_pages, jnp.concatenate([latent, kv[:, r:]], -1),
                                    batch.out_cache_loc)
    q_lat = jnp.einsum("thn,hrn->thr", q[..., :dn], p["k_up"])
    q_abs = jnp.concatenate([q_lat, q[..., dn:]], axis=-1)
    o_lat = ops.mla_attention(q_abs, latent_pages, batch.cu_seqlens, batch.seq_lens,
                              batch.page_table, kv_lora_rank=r, scale=(dn + dr) ** -0.5,
                              impl=impl, mesh=mesh, fixed_order=cfg.deterministic)
    o = jnp.einsum("thr,hrv->thv", o_lat, p["v_up"]).reshape(t, hq * dv)
    return o @ p["o_proj"], latent_pages
