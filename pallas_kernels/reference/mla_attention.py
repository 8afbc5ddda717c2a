"""Plain-jnp reference of weight-absorbed MLA over the paged latent cache (prefill and decode).

MLA with the up-projections absorbed is attention with one shared KV head: its key is the latent
row ``[c | k_r]`` (``kv_lora_rank`` latent values, then the rope part) and its value is ``c``.
So the reference is ``paged_attention_reference`` with the latent pages as both K and V, the
trailing rope values of the output dropped (``latent_as_kv``, which also runs the TPU family's
paged attention kernel as its MLA kernel). The ragged layout, positions and causal rule are
``reference.paged_attention``'s.
"""

from __future__ import annotations

from collections.abc import Callable

from pallas_kernels._common import check
from pallas_kernels.reference.paged_attention import paged_attention_reference


def check_latent(q, latent_pages, kv_lora_rank: int) -> None:
    """``ValueError`` unless q ``[T, Hq, R + dr]`` and latent_pages ``[N, ps, 1, R + dr]`` agree
    and ``0 < R < R + dr``."""
    width = q.shape[2]
    check(latent_pages.ndim == 4 and latent_pages.shape[2] == 1
          and latent_pages.shape[3] == width,
          f"latent_pages {latent_pages.shape} must be [N, page_size, 1, {width}] (q {q.shape})")
    check(0 < kv_lora_rank < width,
          f"kv_lora_rank {kv_lora_rank} must be in (0, {width}): rows are [latent | rope]")


def latent_as_kv(attention: Callable) -> Callable:
    """MLA through a paged attention function ``attention(q, k_pages, v_pages, cu_seqlens,
    seq_lens, page_table, *, scale, **kw)``: the latent pages as K and V, output ``[..., :R]``."""
    def mla(q, latent_pages, cu_seqlens, seq_lens, page_table, *, kv_lora_rank: int,
            scale: float, **kw):
        check_latent(q, latent_pages, kv_lora_rank)
        o = attention(q, latent_pages, latent_pages, cu_seqlens, seq_lens, page_table,
                      scale=scale, **kw)
        return o[..., :kv_lora_rank]
    return mla


def mla_attention_reference(q, latent_pages, cu_seqlens, seq_lens, page_table, *,
                            kv_lora_rank: int, scale: float, fixed_order: bool = False):
    """q ``[T, Hq, R + dr]``; latent_pages ``[N, page_size, 1, R + dr]``; page_table ``[B, P]``.
    Returns ``[T, Hq, R]`` in q.dtype: ``softmax(scale q . row) @ row[:R]``, 0 for padding."""
    return latent_as_kv(paged_attention_reference)(q, latent_pages, cu_seqlens, seq_lens,
                                                   page_table, kv_lora_rank=kv_lora_rank,
                                                   scale=scale, fixed_order=fixed_order)
