"""Plain-jnp reference of causal attention over ragged packed sequences whose K/V live in pages
(prefill and decode), ``write_kv``, ``token_positions`` and the shared shape check.

Token i of sequence b sits at position ``seq_lens[b] - n_b + (i - cu_seqlens[b])`` and attends
to positions ``0..its own``; position p lives at ``page_table[b, p // page_size]``, row
``p % page_size``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels._common import check, dot_precision, token_seq_ids
from pallas_kernels.fixed_order import softmax


def token_positions(cu_seqlens: jax.Array, seq_lens: jax.Array, num_tokens: int):
    """``(seq [T], pos [T], valid [T])`` int32/int32/bool of every packed query token."""
    seq, valid = token_seq_ids(cu_seqlens, num_tokens)
    ext = cu_seqlens[1:] - cu_seqlens[:-1]
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    pos = seq_lens[seq] - ext[seq] + (t - cu_seqlens[seq])
    return seq, pos, valid


def write_kv(k_pages, v_pages, k, v, out_cache_loc):
    """Scatter ``k, v [T, Hkv, D]`` into pages ``[N, page_size, Hkv, D]`` at ``out_cache_loc``."""
    n, page_size = k_pages.shape[:2]
    page, row = out_cache_loc // page_size, out_cache_loc % page_size
    k_pages = k_pages.at[page, row].set(k.astype(k_pages.dtype))
    v_pages = v_pages.at[page, row].set(v.astype(v_pages.dtype))
    return k_pages, v_pages


def paged_attention_reference(q, k_pages, v_pages, cu_seqlens, seq_lens, page_table, *, scale,
                              fixed_order: bool = False):
    """Plain-jnp form: per query token, gather its sequence's pages and attend (fp32 softmax).

    q ``[T, Hq, D]``; pages ``[N, page_size, Hkv, D]``; page_table ``[B, P]``. Returns
    ``[T, Hq, D]`` in q.dtype, 0 for padding tokens. ``fixed_order``: the softmax's sum in a
    fixed tree (``model.deterministic``). Dots at ``dot_precision(q.dtype)`` (fp32: HIGHEST).
    """
    num_tokens, num_q_heads, head_dim = q.shape
    page_size, num_kv_heads = k_pages.shape[1], k_pages.shape[2]
    group = num_q_heads // num_kv_heads
    seq, pos, valid = token_positions(cu_seqlens, seq_lens, num_tokens)
    precision = dot_precision(q.dtype)

    def one(args):
        qt, b, p = args                                            # [Hq, D], (), ()
        pages = page_table[b]
        kt = k_pages[pages].reshape(-1, num_kv_heads, head_dim).astype(jnp.float32)
        vt = v_pages[pages].reshape(-1, num_kv_heads, head_dim).astype(jnp.float32)
        qg = qt.astype(jnp.float32).reshape(num_kv_heads, group, head_dim)
        s = jnp.einsum("hgd,lhd->hgl", qg, kt, precision=precision) * scale
        s = jnp.where(jnp.arange(kt.shape[0]) <= p, s, -jnp.inf)
        w = softmax(s, fixed_order=fixed_order)
        return jnp.einsum("hgl,lhd->hgd", w, vt, precision=precision).reshape(num_q_heads,
                                                                              head_dim)

    del page_size
    o = jax.lax.map(one, (q, seq, pos), batch_size=min(num_tokens, 32))
    return jnp.where(valid[:, None, None], o, 0.0).astype(q.dtype)


def check_attention(q, k_pages, v_pages) -> None:
    """``ValueError`` unless q ``[T, Hq, D]`` and pages ``[N, ps, Hkv, D]`` agree (Hkv | Hq)."""
    num_q_heads, head_dim = q.shape[1:]
    num_kv_heads = k_pages.shape[2]
    check(k_pages.shape == v_pages.shape and k_pages.shape[3] == head_dim,
          f"k_pages {k_pages.shape} / v_pages {v_pages.shape} must be [N, ps, Hkv, {head_dim}]")
    check(num_q_heads % num_kv_heads == 0,
          f"query heads {num_q_heads} must be a multiple of kv heads {num_kv_heads}")
