"""GPU (Pallas Triton) causal attention of ragged packed queries over paged K/V.

Same contract as ``reference.paged_attention`` (its ``paged_attention_reference`` is the test
oracle): token i of sequence b sits at position ``seq_lens[b] - n_b + (i - cu_seqlens[b])``
and attends to positions ``0..its own``; position p lives at ``page_table[b, p // page_size]``,
row ``p % page_size``.

Grid ``(NC, Hkv)``, both parallel. Program (c, h) takes query chunk c (``BQ`` tokens of one
sequence, restarting at every sequence start) and stacks the ``G = Hq / Hkv`` query heads of
KV head h as rows ``g * BQ + t`` (padded to a power of two >= 16, so the dots are tensor-core
sized), gathered straight from the packed ``q``. It loops over the sequence's KV tiles of
``BK`` positions up to its last query (``lax.fori_loop``, online softmax in fp32 registers);
each tile row is gathered from its own page, so any ``page_size >= 1`` works and a tile may span
pages. Head dims are padded to a power of two >= 16 with masked (zero) columns.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels._common import check, chunk_layout, max_chunks

_F32 = jnp.float32
_MASKED = -1e30


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _load_kv(pages_ref, table_ref, seq, h, kv_pos, kv_ok, dims, num_dims):
    """K or V tile ``[BK, DP]`` (pages dtype; 0 where masked) of positions ``kv_pos [BK]``.

    pages_ref ``[N, ps, Hkv, D]``; table_ref ``[B, P]``; dims ``[DP]`` head-dim indices.
    """
    page_size = pages_ref.shape[1]
    pages_per_seq = table_ref.shape[1]
    col = jnp.clip(kv_pos // page_size, 0, pages_per_seq - 1)
    page = pltr.load(table_ref.at[jnp.full(col.shape, seq, jnp.int32), col])
    shape = (kv_pos.shape[0], dims.shape[0])
    mask = kv_ok[:, None] & (dims < num_dims)[None, :]
    idx = (jnp.broadcast_to(page[:, None], shape),
           jnp.broadcast_to((kv_pos % page_size)[:, None], shape),
           jnp.full(shape, h, jnp.int32),
           jnp.broadcast_to(jnp.minimum(dims, num_dims - 1)[None, :], shape))
    return pltr.load(pages_ref.at[idx], mask=mask, other=0)


def _attn_kernel(meta_ref,   # [4, NC] int32 per chunk: seq, first packed token, pos of it, count
                 lens_ref,   # [B] int32 seq_lens: cached prefix + extend
                 table_ref,  # [B, P] int32 page table
                 q_ref,      # [T, Hq, D]
                 k_ref,      # [N, ps, Hkv, D]
                 v_ref,      # [N, ps, Hkv, D]
                 o_ref,      # [T + RP, Hq, DP] outputs; rows >= T absorb masked rows
                 *, scale: float, block_q: int, block_kv: int, num_rows: int, group: int):
    c, h = pl.program_id(0), pl.program_id(1)
    num_tokens, _, head_dim = q_ref.shape
    dims = jnp.arange(o_ref.shape[2], dtype=jnp.int32)
    seq, start, pos0, count = meta_ref[0, c], meta_ref[1, c], meta_ref[2, c], meta_ref[3, c]
    kv_len = lens_ref[seq]
    row = jnp.arange(num_rows, dtype=jnp.int32)
    g, t = row // block_q, row % block_q
    ok = (t < count) & (g < group)
    shape = (num_rows, dims.shape[0])
    tok = jnp.broadcast_to(jnp.where(ok, start + t, 0)[:, None], shape)
    head = jnp.broadcast_to((h * group + jnp.minimum(g, group - 1))[:, None], shape)
    d_idx = jnp.broadcast_to(jnp.minimum(dims, head_dim - 1)[None, :], shape)
    q_mask = ok[:, None] & (dims < head_dim)[None, :]
    q = pltr.load(q_ref.at[tok, head, d_idx], mask=q_mask, other=0)
    q_pos = pos0 + t
    exact = q_ref.dtype == jnp.float32

    def body(kb, carry):
        m, denom, acc = carry                                 # [RP], [RP], [RP, DP] f32
        kv_pos = kb * block_kv + jnp.arange(block_kv, dtype=jnp.int32)
        kv_ok = kv_pos < kv_len
        k = _load_kv(k_ref, table_ref, seq, h, kv_pos, kv_ok, dims, head_dim)
        v = _load_kv(v_ref, table_ref, seq, h, kv_pos, kv_ok, dims, head_dim)
        s = pltr.dot(q, k, trans_b=True, allow_tf32=not exact).astype(_F32) * scale
        s = jnp.where((kv_pos[None, :] <= q_pos[:, None]) & kv_ok[None, :], s, _MASKED)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.exp(s - m_new[:, None])
        alpha = jnp.exp(m - m_new)
        pv = pltr.dot(p.astype(v.dtype), v, allow_tf32=not exact).astype(_F32)
        return m_new, alpha * denom + jnp.sum(p, axis=1), alpha[:, None] * acc + pv

    last = pos0 + count                                     # positions < last are needed
    num_blocks = jnp.where(count > 0, (last + block_kv - 1) // block_kv, 0)
    init = (jnp.full((num_rows,), _MASKED, _F32), jnp.zeros((num_rows,), _F32),
            jnp.zeros(shape, _F32))
    _, denom, acc = jax.lax.fori_loop(0, num_blocks, body, init)
    o = jnp.where(denom[:, None] > 0, acc / jnp.maximum(denom, 1e-30)[:, None], 0.0)
    out_tok = jnp.broadcast_to(jnp.where(ok, start + t, num_tokens + row)[:, None], shape)
    out_dims = jnp.broadcast_to(dims[None, :], shape)
    pltr.store(o_ref.at[out_tok, head, out_dims], o.astype(o_ref.dtype),
               mask=jnp.broadcast_to(ok[:, None], shape))


@functools.partial(jax.jit, static_argnames=("scale", "block_q", "pages_per_block",
                                             "interpret"))
def paged_attention(q, k_pages, v_pages, cu_seqlens, seq_lens, page_table, *, scale: float,
                    block_q: int = 8, pages_per_block: int | None = None,
                    interpret: bool = False):
    """Pallas-Triton ragged paged attention; same contract as ``paged_attention_reference``.

    q ``[T, Hq, D]``; pages ``[N, page_size, Hkv, D]``; page_table ``[B, P]`` int32. The KV
    tile is ``pages_per_block * page_size`` positions rounded up to a power of two >= 16
    (default 64 positions). Returns ``[T, Hq, D]`` in q.dtype, 0 for padding tokens.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_pages.shape
    num_seqs = page_table.shape[0]
    check(k_pages.shape == v_pages.shape and k_pages.shape[3] == head_dim,
          f"k_pages {k_pages.shape} / v_pages {v_pages.shape} must be [N, ps, Hkv, {head_dim}]")
    check(num_q_heads % num_kv_heads == 0,
          f"query heads {num_q_heads} must be a multiple of kv heads {num_kv_heads}")
    check(block_q % 8 == 0 and block_q > 0, f"block_q {block_q} must be a multiple of 8")
    ppb = pages_per_block or max(1, 64 // page_size)
    block_kv = max(16, _pow2_at_least(ppb * page_size))
    group = num_q_heads // num_kv_heads
    num_rows = max(16, _pow2_at_least(group * block_q))
    padded_dim = max(16, _pow2_at_least(head_dim))
    num_chunks = max_chunks(num_tokens, block_q, num_seqs)
    _, cseq, _, chunk_off = chunk_layout(cu_seqlens, num_tokens, block_q, num_chunks)
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    c = jnp.arange(num_chunks, dtype=jnp.int32)
    loc = (c - chunk_off[cseq]) * block_q
    count = jnp.where(c < chunk_off[-1], jnp.clip(lens[cseq] - loc, 0, block_q), 0)
    pos0 = seq_lens[cseq] - lens[cseq] + loc
    meta = jnp.stack([cseq, cu_seqlens[cseq] + loc, pos0, count]).astype(jnp.int32)
    kernel = functools.partial(_attn_kernel, scale=scale, block_q=block_q, block_kv=block_kv,
                               num_rows=num_rows, group=group)
    o = pl.pallas_call(
        kernel, grid=(num_chunks, num_kv_heads),
        out_shape=jax.ShapeDtypeStruct((num_tokens + num_rows, num_q_heads, padded_dim),
                                       q.dtype),
        interpret=interpret,
        compiler_params=pltr.CompilerParams(num_warps=4, num_stages=2),
    )(meta, seq_lens.astype(jnp.int32), page_table.astype(jnp.int32), q, k_pages, v_pages)
    valid = jnp.arange(num_tokens) < cu_seqlens[-1]
    return jnp.where(valid[:, None, None], o[:num_tokens, :, :head_dim], 0).astype(q.dtype)
