"""Causal attention over ragged packed sequences whose K/V live in pages (prefill and decode).

Token i of sequence b sits at position ``seq_lens[b] - n_b + (i - cu_seqlens[b])`` and attends
to positions ``0..its own``; position p lives at ``page_table[b, p // page_size]``, row
``p % page_size``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels._common import check, chunk_layout, max_chunks, token_seq_ids
from pallas_kernels.attention_kernel import attention_call


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


def paged_attention_reference(q, k_pages, v_pages, cu_seqlens, seq_lens, page_table, *, scale):
    """Plain-jnp form: per query token, gather its sequence's pages and attend (fp32 softmax).

    q ``[T, Hq, D]``; pages ``[N, page_size, Hkv, D]``; page_table ``[B, P]``. Returns
    ``[T, Hq, D]`` in q.dtype, 0 for padding tokens.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    page_size, num_kv_heads = k_pages.shape[1], k_pages.shape[2]
    group = num_q_heads // num_kv_heads
    seq, pos, valid = token_positions(cu_seqlens, seq_lens, num_tokens)

    def one(args):
        qt, b, p = args                                            # [Hq, D], (), ()
        pages = page_table[b]
        kt = k_pages[pages].reshape(-1, num_kv_heads, head_dim).astype(jnp.float32)
        vt = v_pages[pages].reshape(-1, num_kv_heads, head_dim).astype(jnp.float32)
        qg = qt.astype(jnp.float32).reshape(num_kv_heads, group, head_dim)
        s = jnp.einsum("hgd,lhd->hgl", qg, kt) * scale
        s = jnp.where(jnp.arange(kt.shape[0]) <= p, s, -jnp.inf)
        w = jax.nn.softmax(s, axis=-1)
        return jnp.einsum("hgl,lhd->hgd", w, vt).reshape(num_q_heads, head_dim)

    del page_size
    o = jax.lax.map(one, (q, seq, pos), batch_size=min(num_tokens, 32))
    return jnp.where(valid[:, None, None], o, 0.0).astype(q.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "block_q", "pages_per_block",
                                             "interpret"))
def paged_attention(q, k_pages, v_pages, cu_seqlens, seq_lens, page_table, *, scale: float,
                    block_q: int = 8, pages_per_block: int | None = None,
                    interpret: bool = False):
    """Pallas ragged paged attention; same contract as ``paged_attention_reference``."""
    num_tokens, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_pages.shape
    num_seqs, pages_per_seq = page_table.shape
    check(k_pages.shape == v_pages.shape and k_pages.shape[3] == head_dim,
          f"k_pages {k_pages.shape} / v_pages {v_pages.shape} must be [N, ps, Hkv, {head_dim}]")
    check(num_q_heads % num_kv_heads == 0,
          f"query heads {num_q_heads} must be a multiple of kv heads {num_kv_heads}")
    check(block_q % 8 == 0 and block_q > 0, f"block_q {block_q} must be a multiple of 8")
    ppb = pages_per_block or max(1, min(pages_per_seq, 16, -(-128 // page_size)))
    group = num_q_heads // num_kv_heads
    num_chunks = max_chunks(num_tokens, block_q, num_seqs)
    gather, cseq, _, chunk_off = chunk_layout(cu_seqlens, num_tokens, block_q, num_chunks)
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    inner = jnp.arange(num_chunks) - chunk_off[cseq]
    pos0 = seq_lens[cseq] - lens[cseq] + inner * block_q
    count = jnp.clip(lens[cseq] - inner * block_q, 0, block_q)
    count = jnp.where(jnp.arange(num_chunks) < chunk_off[-1], count, 0)
    nblk = jnp.where(count > 0, -(-(pos0 + count) // (page_size * ppb)), 0)
    q_c = jnp.concatenate([q, jnp.zeros((1,) + q.shape[1:], q.dtype)])[gather]
    q_c = q_c.reshape(num_chunks, block_q, num_kv_heads, group, head_dim)
    q_c = q_c.transpose(0, 2, 3, 1, 4).reshape(num_chunks, num_kv_heads, group * block_q, -1)
    o_c = attention_call(page_table.reshape(-1), cseq, pos0.astype(jnp.int32),
                         nblk.astype(jnp.int32), q_c, k_pages, v_pages, scale=scale,
                         block_q=block_q, pages_per_block=ppb, pages_per_seq=pages_per_seq,
                         interpret=interpret)
    o_c = o_c.reshape(num_chunks, num_kv_heads, group, block_q, head_dim)
    seq, valid = token_seq_ids(cu_seqlens, num_tokens)
    tok = jnp.arange(num_tokens) - cu_seqlens[seq]
    o = o_c[chunk_off[seq] + tok // block_q, :, :, tok % block_q]       # [T, Hkv, G, D]
    o = jnp.where(valid[:, None, None, None], o, 0).astype(q.dtype)
    return o.reshape(num_tokens, num_q_heads, head_dim)
