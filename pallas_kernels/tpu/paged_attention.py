"""TPU (Mosaic) causal flash attention of ragged query chunks over paged K/V.

Same contract as ``reference.paged_attention.paged_attention_reference``, and every page table
entry must be a page id in ``[0, N)`` (the engine pads rows with 0): blocks DMA whole table
ranges, also past a sequence's last page. Layout (built by ``paged_attention``): queries are cut
into chunks of ``BQ`` tokens that never span two sequences; chunk c holds, per KV head, its
``G * BQ`` query rows (row ``g * BQ + t``: group member g of token t). The grid is ``(NC,)``,
one chunk a step; a step loops over the chunk's KV blocks of ``L = ppb * page_size`` positions
(``nblk[c]``, none past its last position). Pools and page table stay in HBM. Block ``g``
(counted over the grid, ``blk0``) is ``ppb`` page DMAs into VMEM buffer ``g % 2``, started
during block ``g - 1`` (across chunks too) and waited once per buffer; its page ids are a DMA of
table rows into SMEM row ``g % 2``, started during block ``g - 2``. So the grid is sequential
("arbitrary"). K and V reach the MXU per head as contiguous ``[L, D]`` tiles in the pool dtype
(``_kv_blocks``); softmax statistics and the accumulator are f32; V rows past the chunk's last
position are zeroed, so stale page rows (NaN included) never reach an output.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._common import check, chunk_layout, max_chunks, token_seq_ids
from pallas_kernels.reference.paged_attention import check_attention
from pallas_kernels.tpu._kv_blocks import block_shape, head_tiles, page_copy

_F32 = jnp.float32
_MASKED = -1e30


def _attn_kernel(cseq_ref, pos0_ref, end_ref, nblk_ref, blk0_ref,  # SMEM scalars
                 q_ref,          # [Hkv, G*BQ, D] query rows of this chunk
                 table_hbm,      # [X, 1, 128] flattened page table in rows of 128 (HBM)
                 k_hbm, v_hbm,   # [N, ps, Hkv, D] pools (HBM)
                 o_ref,          # [Hkv, G*BQ, D]
                 k_buf, v_buf,   # [2, *block_shape] VMEM block buffers (K, V)
                 sem,            # DMA semaphores [2], one per buffer
                 ids_ref,        # [2, R, 1, 128] SMEM table rows of the next two blocks
                 ids_sem,        # DMA semaphores [2], one per ids row
                 m_ref, l_ref,   # [Hkv, G*BQ, 1] f32 running max / sum
                 acc_ref,        # [Hkv, G*BQ, D] f32
                 *, scale: float, block_q: int, pages_per_block: int, pages_per_seq: int,
                 interpret: bool):
    c, num_chunks = pl.program_id(0), pl.num_programs(0)
    num_kv_heads, rows, _ = q_ref.shape
    page_size, ppb = k_hbm.shape[1], pages_per_block
    span = ppb * page_size
    table_rows, ids_rows = table_hbm.shape[0], ids_ref.shape[1]

    def ids_row0(chunk, kb):    # first table row fetched for block (chunk, kb); in range
        first = cseq_ref[chunk] * pages_per_seq + kb * ppb
        return jnp.minimum(jax.lax.shift_right_logical(first, 7), table_rows - ids_rows)

    def ids_copy(chunk, kb, slot):
        return pltpu.make_async_copy(table_hbm.at[pl.ds(ids_row0(chunk, kb), ids_rows)],
                                     ids_ref.at[slot], ids_sem.at[slot])

    def start(chunk, kb, slot):   # the block's page DMAs; its ids are in ids_ref[slot]
        shift = cseq_ref[chunk] * pages_per_seq + kb * ppb - 128 * ids_row0(chunk, kb)
        for i in range(ppb):   # past the chunk's pages: other valid ids (0-padded rows)
            j = shift + i
            page = ids_ref[slot, jax.lax.shift_right_logical(j, 7), 0, j & 127]
            for pool, buf in ((k_hbm, k_buf), (v_hbm, v_buf)):
                page_copy(pool.at[page], buf.at[slot], i * page_size, sem.at[slot],
                           interpret).start()

    def wait(slot):   # one wait per buffer: the semaphore counts the bytes of all its pages
        pltpu.make_async_copy(k_buf.at[slot], k_buf.at[slot], sem.at[slot]).wait()
        pltpu.make_async_copy(v_buf.at[slot], v_buf.at[slot], sem.at[slot]).wait()

    def following(chunk, kb):     # the block after (chunk, kb) in grid order
        last = kb + 1 == nblk_ref[chunk]
        return jnp.where(last, chunk + 1, chunk), jnp.where(last, 0, kb + 1)

    num_blocks = nblk_ref[c]
    total = blk0_ref[num_chunks]

    @pl.when(jnp.logical_and(c == 0, total > 0))
    def _first():            # chunks with blocks are a prefix: block 0 is chunk 0's first
        ids_copy(0, 0, 0).start()
        ids_copy(0, 0, 0).wait()
        start(0, 0, 0)

        @pl.when(total > 1)
        def _():
            ids_copy(*following(0, 0), 1).start()

    m_ref[...] = jnp.full(m_ref.shape, _MASKED, _F32)
    l_ref[...] = jnp.zeros(l_ref.shape, _F32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, _F32)
    q_pos = pos0_ref[c] + jax.lax.rem(jax.lax.broadcasted_iota(jnp.int32, (rows, span), 0),
                                      block_q)
    col = jax.lax.broadcasted_iota(jnp.int32, (rows, span), 1)
    row = jax.lax.broadcasted_iota(jnp.int32, (span, 1), 0)

    def block(kb, carry):
        g = blk0_ref[c] + kb
        slot = jax.lax.rem(g, 2)
        wait(slot)
        nxt = following(c, kb)

        @pl.when(g + 1 < total)
        def _prefetch():     # block g + 1's pages (its ids came during block g - 1)
            ids_copy(*nxt, 1 - slot).wait()
            start(*nxt, 1 - slot)

            @pl.when(g + 2 < total)
            def _():         # block g + 2's ids, into the row block g's ids used
                ids_copy(*following(*nxt), slot).start()

        kv_pos = kb * span + col
        visible = kv_pos <= q_pos
        fresh = row < end_ref[c] - kb * span   # positions the chunk reads
        ks, vs = head_tiles(k_buf.at[slot]), head_tiles(v_buf.at[slot])   # [L, D] each
        for h in range(num_kv_heads):
            k, v = ks[h], jnp.where(fresh, vs[h], 0)    # stale rows: 0, not NaN
            s = jax.lax.dot_general(q_ref[h].astype(k.dtype), k, (((1,), (1,)), ((), ())),
                                    preferred_element_type=_F32) * scale
            s = jnp.where(visible, s, _MASKED)
            m_prev = m_ref[h]
            m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
            p = jnp.exp(s - m_new)
            alpha = jnp.exp(m_prev - m_new)
            l_ref[h] = alpha * l_ref[h] + jnp.sum(p, axis=1, keepdims=True)
            acc_ref[h] = alpha * acc_ref[h] + jnp.dot(p.astype(v.dtype), v,
                                                      preferred_element_type=_F32)
            m_ref[h] = m_new
        return carry

    jax.lax.fori_loop(0, num_blocks, block, 0)
    denom = l_ref[...]
    o_ref[...] = jnp.where(denom > 0, acc_ref[...] / jnp.maximum(denom, 1e-30),
                           0.0).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "block_q", "pages_per_block",
                                             "pages_per_seq", "interpret"))
def attention_call(cseq, pos0, kv_end, nblk, blk0, table, q_c, k_pages, v_pages, *,
                   scale: float, block_q: int, pages_per_block: int, pages_per_seq: int,
                   interpret: bool = False):
    """q_c ``[NC, Hkv, G*BQ, D]``; pages ``[N, ps, Hkv, D]``; table ``[X, 1, 128]`` int32 (the
    flattened ``[B, P]`` page table, ``_table_rows``); per chunk ``cseq``, ``pos0`` (position of
    its first token), ``kv_end`` (1 + its last token's position), ``nblk`` (KV blocks) and
    ``blk0 [NC+1]`` (blocks before it; ``blk0[NC]`` the total). Returns ``[NC, Hkv, G*BQ, D]``."""
    num_chunks, num_kv_heads, rows, head_dim = q_c.shape
    page_size = k_pages.shape[1]
    span = pages_per_block * page_size
    sq = pl.Squeezed()
    q_spec = pl.BlockSpec((sq, num_kv_heads, rows, head_dim), lambda c, *_: (c, 0, 0, 0))
    ids_rows = -(-pages_per_block // 128) + 1     # table rows holding a block's page ids
    hbm = pl.BlockSpec(memory_space=pltpu.HBM)   # table and pools: DMA sources, never VMEM
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=5, grid=(num_chunks,),
        in_specs=[q_spec, hbm, hbm, hbm],
        out_specs=q_spec,
        scratch_shapes=[pltpu.VMEM((2,) + block_shape(span, page_size, num_kv_heads, head_dim,
                                                      k_pages.dtype), k_pages.dtype),
                        pltpu.VMEM((2,) + block_shape(span, page_size, num_kv_heads, head_dim,
                                                      v_pages.dtype), v_pages.dtype),
                        pltpu.SemaphoreType.DMA((2,)),
                        pltpu.SMEM((2, table.shape[0] if table.shape[0] < ids_rows else ids_rows,
                                    1, 128), jnp.int32),
                        pltpu.SemaphoreType.DMA((2,)),
                        pltpu.VMEM((num_kv_heads, rows, 1), _F32),
                        pltpu.VMEM((num_kv_heads, rows, 1), _F32),
                        pltpu.VMEM((num_kv_heads, rows, head_dim), _F32)])
    kernel = functools.partial(_attn_kernel, scale=scale, block_q=block_q,
                               pages_per_block=pages_per_block, pages_per_seq=pages_per_seq,
                               interpret=interpret)
    return pl.pallas_call(
        kernel, grid_spec=grid_spec, out_shape=jax.ShapeDtypeStruct(q_c.shape, q_c.dtype),
        interpret=interpret,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",),
                                             disable_bounds_checks=True),
    )(cseq, pos0, kv_end, nblk, blk0, q_c, table, k_pages, v_pages)


def _table_rows(page_table):
    """The page table flattened into ``[X, 1, 128]`` int32 rows (zero padded): a block's ids
    are a DMA of whole rows, and a leading-dim row slice is always tile-aligned."""
    flat = page_table.reshape(-1).astype(jnp.int32)
    flat = jnp.pad(flat, (0, -flat.shape[0] % 128))
    return flat.reshape(-1, 1, 128)


def default_pages_per_block(page_size: int, pages_per_seq: int) -> int:
    """Pages per KV block: 512 positions from pages of 16 or more (fewer loop steps), else
    256 (at most 256 page DMAs per block and buffer); at most a sequence."""
    span = 512 if page_size >= 16 else 256
    return max(1, min(pages_per_seq, -(-span // page_size)))


def default_block_q(num_tokens: int, num_seqs: int, group: int,
                    fixed_order: bool = False) -> int:
    """Query tokens per chunk: 8 for decode shapes (one token per sequence: the rows past it
    are padding), else the largest of 32 / 16 / 8 with at most 256 query rows (``G * BQ``):
    each chunk re-reads its KV, so longer chunks cut the DMA traffic and fill the MXU.
    [deterministic] ``fixed_order``: the latter whatever the step (a query's bits follow the
    chunk's shape)."""
    if num_tokens <= num_seqs and not fixed_order:
        return 8
    return next((bq for bq in (32, 16) if group * bq <= 256), 8)


@functools.partial(jax.jit, static_argnames=("scale", "block_q", "pages_per_block",
                                             "interpret", "fixed_order"))
def paged_attention(q, k_pages, v_pages, cu_seqlens, seq_lens, page_table, *, scale: float,
                    block_q: int | None = None, pages_per_block: int | None = None,
                    interpret: bool = False, fixed_order: bool = False):
    """Pallas ragged paged attention; same contract as ``paged_attention_reference``.
    ``block_q`` (query tokens per chunk) defaults to ``default_block_q`` (of ``fixed_order``),
    ``pages_per_block`` to ``default_pages_per_block``."""
    num_tokens, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_pages.shape
    num_seqs, pages_per_seq = page_table.shape
    check_attention(q, k_pages, v_pages)
    group = num_q_heads // num_kv_heads
    block_q = block_q or default_block_q(num_tokens, num_seqs, group, fixed_order)
    check(block_q % 8 == 0 and block_q > 0, f"block_q {block_q} must be a multiple of 8")
    ppb = pages_per_block or default_pages_per_block(page_size, pages_per_seq)
    check(0 < ppb <= pages_per_seq,
          f"pages_per_block {ppb} must be in 1..pages_per_seq ({pages_per_seq})")
    num_chunks = max_chunks(num_tokens, block_q, num_seqs)
    gather, cseq, _, chunk_off = chunk_layout(cu_seqlens, num_tokens, block_q, num_chunks)
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    inner = jnp.arange(num_chunks) - chunk_off[cseq]
    pos0 = seq_lens[cseq] - lens[cseq] + inner * block_q
    count = jnp.clip(lens[cseq] - inner * block_q, 0, block_q)
    count = jnp.where(jnp.arange(num_chunks) < chunk_off[-1], count, 0)
    kv_end = pos0 + count                                   # positions the chunk reads
    nblk = jnp.where(count > 0, -(-kv_end // (page_size * ppb)), 0).astype(jnp.int32)
    blk0 = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(nblk).astype(jnp.int32)])
    q_c = jnp.concatenate([q, jnp.zeros((1,) + q.shape[1:], q.dtype)])[gather]
    q_c = q_c.reshape(num_chunks, block_q, num_kv_heads, group, head_dim)
    q_c = q_c.transpose(0, 2, 3, 1, 4).reshape(num_chunks, num_kv_heads, group * block_q, -1)
    o_c = attention_call(cseq, pos0.astype(jnp.int32), kv_end.astype(jnp.int32), nblk, blk0,
                         _table_rows(page_table), q_c, k_pages, v_pages,
                         scale=scale, block_q=block_q, pages_per_block=ppb,
                         pages_per_seq=pages_per_seq, interpret=interpret)
    o_c = o_c.reshape(num_chunks, num_kv_heads, group, block_q, head_dim)
    seq, valid = token_seq_ids(cu_seqlens, num_tokens)
    tok = jnp.arange(num_tokens) - cu_seqlens[seq]
    o = o_c[chunk_off[seq] + tok // block_q, :, :, tok % block_q]       # [T, Hkv, G, D]
    o = jnp.where(valid[:, None, None, None], o, 0).astype(q.dtype)
    return o.reshape(num_tokens, num_q_heads, head_dim)
