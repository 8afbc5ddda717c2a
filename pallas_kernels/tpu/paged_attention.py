"""TPU (Mosaic) causal flash attention of ragged query chunks over paged K/V.

Same contract as ``reference.paged_attention.paged_attention_reference``. Layout (built by
``paged_attention``): queries are cut into chunks of ``BQ``
tokens that never span two sequences; chunk c holds, per KV head, its ``G * BQ`` query rows
(row ``g * BQ + t``: group member g of token t). The grid is ``(NC, NKB)``: each step loads
``ppb`` pages (one BlockSpec per page, the page id taken from the scalar-prefetched page table)
and folds them into an online softmax kept in VMEM scratch.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._common import check, chunk_layout, max_chunks, token_seq_ids
from pallas_kernels.reference.paged_attention import check_attention

_F32 = jnp.float32
_MASKED = -1e30


def _attn_kernel(table_ref, cseq_ref, pos0_ref, nblk_ref,  # SMEM scalars
                 q_ref,        # [Hkv, G*BQ, D] query rows of this chunk
                 *refs,        # ppb K pages [ps, Hkv, D], ppb V pages, then o_ref and scratch
                 scale: float, block_q: int, pages_per_block: int):
    k_refs, v_refs = refs[:pages_per_block], refs[pages_per_block:2 * pages_per_block]
    o_ref, m_ref, l_ref, acc_ref = refs[2 * pages_per_block:]
    # o_ref [Hkv, G*BQ, D]; m_ref, l_ref [Hkv, G*BQ, 1] f32; acc_ref [Hkv, G*BQ, D] f32
    del table_ref, cseq_ref
    c, kb = pl.program_id(0), pl.program_id(1)
    num_kv_heads, rows, _ = q_ref.shape

    @pl.when(kb == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, _MASKED, _F32)
        l_ref[...] = jnp.zeros(l_ref.shape, _F32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, _F32)

    @pl.when(kb < nblk_ref[c])
    def _step():
        k = jnp.concatenate([r[...] for r in k_refs], axis=0).astype(_F32)   # [L, Hkv, D]
        v = jnp.concatenate([r[...] for r in v_refs], axis=0).astype(_F32)
        span = k.shape[0]
        q_pos = pos0_ref[c] + jax.lax.rem(
            jax.lax.broadcasted_iota(jnp.int32, (rows, span), 0), block_q)
        kv_pos = kb * span + jax.lax.broadcasted_iota(jnp.int32, (rows, span), 1)
        for h in range(num_kv_heads):
            q = q_ref[h].astype(_F32)
            s = jax.lax.dot_general(q, k[:, h, :], (((1,), (1,)), ((), ())),
                                    preferred_element_type=_F32) * scale
            s = jnp.where(kv_pos <= q_pos, s, _MASKED)
            m_prev = m_ref[h]
            m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
            p = jnp.exp(s - m_new)
            alpha = jnp.exp(m_prev - m_new)
            l_ref[h] = alpha * l_ref[h] + jnp.sum(p, axis=1, keepdims=True)
            acc_ref[h] = alpha * acc_ref[h] + jnp.dot(p, v[:, h, :],
                                                      preferred_element_type=_F32)
            m_ref[h] = m_new

    @pl.when(kb == pl.num_programs(1) - 1)
    def _finish():
        denom = l_ref[...]
        o_ref[...] = jnp.where(denom > 0, acc_ref[...] / jnp.maximum(denom, 1e-30),
                               0.0).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "block_q", "pages_per_block",
                                             "pages_per_seq", "interpret"))
def attention_call(table, cseq, pos0, nblk, q_c, k_pages, v_pages, *, scale: float,
                   block_q: int, pages_per_block: int, pages_per_seq: int,
                   interpret: bool = False):
    """q_c ``[NC, Hkv, G*BQ, D]``; pages ``[N, ps, Hkv, D]``; table ``[B*P]`` flattened page
    table; per chunk ``cseq, pos0`` (position of its first token) and ``nblk`` (KV blocks to
    visit). Returns ``[NC, Hkv, G*BQ, D]`` in q dtype."""
    num_chunks, num_kv_heads, rows, head_dim = q_c.shape
    page_size = k_pages.shape[1]
    ppb, pps = pages_per_block, pages_per_seq
    num_kv_blocks = -(-pps // ppb)
    sq = pl.Squeezed()

    def page_map(i):
        def index(c, kb, table_ref, cseq_ref, pos0_ref, nblk_ref):
            kb = jnp.minimum(kb, jnp.maximum(nblk_ref[c] - 1, 0))  # no refetch past the end
            return (table_ref[cseq_ref[c] * pps + jnp.minimum(kb * ppb + i, pps - 1)], 0, 0, 0)
        return pl.BlockSpec((sq, page_size, num_kv_heads, head_dim), index)

    q_spec = pl.BlockSpec((sq, num_kv_heads, rows, head_dim), lambda c, kb, *_: (c, 0, 0, 0))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=4, grid=(num_chunks, num_kv_blocks),
        in_specs=[q_spec] + [page_map(i) for i in range(ppb)] * 2,
        out_specs=q_spec,
        scratch_shapes=[pltpu.VMEM((num_kv_heads, rows, 1), _F32),
                        pltpu.VMEM((num_kv_heads, rows, 1), _F32),
                        pltpu.VMEM((num_kv_heads, rows, head_dim), _F32)])
    kernel = functools.partial(_attn_kernel, scale=scale, block_q=block_q,
                               pages_per_block=ppb)
    return pl.pallas_call(
        kernel, grid_spec=grid_spec, out_shape=jax.ShapeDtypeStruct(q_c.shape, q_c.dtype),
        interpret=interpret,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
    )(table, cseq, pos0, nblk, q_c, *([k_pages] * ppb), *([v_pages] * ppb))


@functools.partial(jax.jit, static_argnames=("scale", "block_q", "pages_per_block",
                                             "interpret"))
def paged_attention(q, k_pages, v_pages, cu_seqlens, seq_lens, page_table, *, scale: float,
                    block_q: int = 8, pages_per_block: int | None = None,
                    interpret: bool = False):
    """Pallas ragged paged attention; same contract as ``paged_attention_reference``."""
    num_tokens, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_pages.shape
    num_seqs, pages_per_seq = page_table.shape
    check_attention(q, k_pages, v_pages)
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
