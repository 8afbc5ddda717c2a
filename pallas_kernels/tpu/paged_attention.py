"""TPU (Mosaic) causal flash attention of ragged query chunks over paged K/V.

Same contract as ``reference.paged_attention.paged_attention_reference``. Layout (built by
``paged_attention``): queries are cut into chunks of ``BQ`` tokens that never span two sequences;
chunk c holds, per KV head, its ``G * BQ`` query rows (row ``g * BQ + t``: group member g of
token t). The grid is ``(NC,)``, one chunk per step; a step walks the chunk's KV blocks of
``L = ppb * page_size`` positions (``nblk[c]`` of them, no dead steps past the sequence end) in a
loop. The pools stay in HBM; a block is ``ppb`` page DMAs (``[page_size, Hkv, D]`` each) into one
of two VMEM buffers, started one block ahead (across chunks too: the last block of a chunk starts
the next chunk's first), so the DMAs of block g+1 run under the compute of block g. Invariants:
every block DMAs exactly ``ppb`` pages (pages past the chunk's last one repeat it) and is waited
once for the whole buffer; block ``g`` (counted over the whole grid, ``blk0``) lives in buffer
``g % 2``; the grid is sequential ("arbitrary") because of that chain.

Per KV head, K and V reach the MXU as contiguous ``[L, D]`` tiles in the pool dtype (bf16 stays
bf16; f32 accumulation): an f32 head is a sublane-strided load of the page-major buffer, a bf16
head of an even ``Hkv`` is the low or high half of a strided load of the buffer bitcast to u32
(two heads per 32-bit row). Softmax statistics and the accumulator are f32.
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


def _packing(dtype) -> int:
    return 4 // jnp.dtype(dtype).itemsize


def _word_layout(num_kv_heads: int, head_dim: int, dtype) -> bool:
    """Whether a block is kept as 32-bit words (``_head_tiles``' fast path)."""
    packing = _packing(dtype)
    return head_dim % 128 == 0 and num_kv_heads % packing == 0 and packing in (1, 2)


def block_shape(span: int, num_kv_heads: int, head_dim: int, dtype) -> tuple[int, ...]:
    """One VMEM block buffer: ``[L, Hkv / packing, packing, D]`` on the fast path (the unit or
    packing second-minor dim makes its 32-bit view row-major in 128-lane rows); ``[L, D]`` for
    one 32-bit KV head (MLA's latent rows); else ``[L, Hkv, D]``."""
    if _word_layout(num_kv_heads, head_dim, dtype):
        packing = _packing(dtype)
        return (span, num_kv_heads // packing, packing, head_dim)
    if num_kv_heads == 1 and _packing(dtype) == 1:
        return (span, head_dim)
    return (span, num_kv_heads, head_dim)


def _page_copy(page_ref, buf, first: int, sem, interpret: bool):
    """DMA descriptor: pool page ``page_ref [ps, Hkv, D]`` (HBM) to rows ``first ..`` of one
    block buffer. The fast-path buffer is written through a ``[ps, Hkv, D]`` view (Mosaic
    emits a strided DMA when the tilings differ); interpret mode cannot write through a
    reshaped ref and reshapes the source instead (the same elements either way)."""
    page_size = page_ref.shape[0]
    dst = buf.at[pl.ds(first, page_size)]
    if len(buf.shape) == 2:
        page_ref = page_ref.at[:, 0]
    elif len(buf.shape) == 4 and interpret:
        page_ref = page_ref.reshape(dst.shape)
    elif len(buf.shape) == 4:
        dst = dst.reshape(page_ref.shape)
    return pltpu.make_async_copy(page_ref, dst, sem)


def _head_tiles(buf) -> list:
    """The KV heads of one block buffer (see ``block_shape``) as ``[L, D]`` values in the pool
    dtype (rows are positions), in the native layout the MXU takes.

    Fast path: the buffer read as 32-bit rows of 128 lanes, row ``(p * W + w) * F + f`` = fold
    ``f`` of word ``w`` of position ``p`` (``F = D / 128`` folds, ``W = Hkv / packing`` words;
    a bf16 word holds heads ``2w`` (low half) and ``2w + 1``): per fold, one sublane-strided
    load gathers a word for all L positions; bf16 heads are the halves, packed back to bf16.
    One KV head: the ``[L, D]`` buffer itself. Otherwise the whole ``[L, Hkv, D]`` block is
    loaded as f32 and sliced (a relayout; packed dtypes relayout far worse)."""
    if len(buf.shape) == 2:
        return [buf[...]]
    if len(buf.shape) == 3:
        block = buf[...].astype(_F32)
        return [block[:, h, :] for h in range(buf.shape[1])]
    span, words, packing, head_dim = buf.shape
    folds = head_dim // 128
    rows = buf if packing == 1 else buf.bitcast(jnp.uint32)       # [L, W, 1, D] 32-bit
    rows = rows.reshape(span * words * folds, 128)

    def gather(word):                                              # [L, D] 32-bit
        return jnp.concatenate([rows[pl.ds(word * folds + f, span, stride=words * folds)]
                                for f in range(folds)], axis=1)
    if packing == 1:
        return [gather(w) for w in range(words)]
    tiles = []
    for w in range(words):
        bits = gather(w)
        for half in (bits, bits >> 16):
            tiles.append(pltpu.bitcast(half.astype(jnp.uint16), buf.dtype))
    return tiles


def _attn_kernel(table_ref, cseq_ref, pos0_ref, end_ref, nblk_ref, blk0_ref,  # SMEM scalars
                 q_ref,          # [Hkv, G*BQ, D] query rows of this chunk
                 k_hbm, v_hbm,   # [N, ps, Hkv, D] pools (HBM)
                 o_ref,          # [Hkv, G*BQ, D]
                 k_buf, v_buf,   # [2, *block_shape] VMEM block buffers (K, V)
                 sem,            # DMA semaphores [2], one per buffer
                 m_ref, l_ref,   # [Hkv, G*BQ, 1] f32 running max / sum
                 acc_ref,        # [Hkv, G*BQ, D] f32
                 *, scale: float, block_q: int, pages_per_block: int, pages_per_seq: int,
                 interpret: bool):
    c, num_chunks = pl.program_id(0), pl.num_programs(0)
    num_kv_heads, rows, _ = q_ref.shape
    page_size, ppb = k_hbm.shape[1], pages_per_block
    span = ppb * page_size

    def copies(chunk, kb, slot):
        base = cseq_ref[chunk] * pages_per_seq
        last = jnp.minimum(jax.lax.div(end_ref[chunk] - 1, page_size), pages_per_seq - 1)
        out = []
        for i in range(ppb):
            page = table_ref[base + jnp.minimum(kb * ppb + i, last)]
            out += [_page_copy(k_hbm.at[page], k_buf.at[slot], i * page_size, sem.at[slot],
                               interpret),
                    _page_copy(v_hbm.at[page], v_buf.at[slot], i * page_size, sem.at[slot],
                               interpret)]
        return out

    def start(chunk, kb, slot):
        for cp in copies(chunk, kb, slot):
            cp.start()

    def wait(slot):   # one wait per buffer: the semaphore counts the bytes of all its pages
        pltpu.make_async_copy(k_buf.at[slot], k_buf.at[slot], sem.at[slot]).wait()
        pltpu.make_async_copy(v_buf.at[slot], v_buf.at[slot], sem.at[slot]).wait()

    num_blocks = nblk_ref[c]
    total = blk0_ref[num_chunks]

    @pl.when(jnp.logical_and(c == 0, total > 0))
    def _first():            # chunks with blocks are a prefix: block 0 is chunk 0's first
        start(0, 0, 0)

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
        last = kb + 1 == num_blocks
        nxt_c = jnp.where(last, c + 1, c)

        @pl.when(g + 1 < total)
        def _prefetch():
            start(nxt_c, jnp.where(last, 0, kb + 1), 1 - slot)

        kv_pos = kb * span + col
        visible = kv_pos <= q_pos
        fresh = row < end_ref[c] - kb * span   # positions the chunk reads
        ks, vs = _head_tiles(k_buf.at[slot]), _head_tiles(v_buf.at[slot])   # [L, D] each
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
def attention_call(table, cseq, pos0, kv_end, nblk, blk0, q_c, k_pages, v_pages, *,
                   scale: float, block_q: int, pages_per_block: int, pages_per_seq: int,
                   interpret: bool = False):
    """q_c ``[NC, Hkv, G*BQ, D]``; pages ``[N, ps, Hkv, D]``; table ``[B*P]`` flattened page
    table; per chunk ``cseq``, ``pos0`` (position of its first token), ``kv_end`` (1 + its
    last token's position), ``nblk`` (KV blocks) and ``blk0``
    ``[NC+1]`` (blocks before it; ``blk0[NC]`` the total). Returns ``[NC, Hkv, G*BQ, D]``."""
    num_chunks, num_kv_heads, rows, head_dim = q_c.shape
    page_size = k_pages.shape[1]
    span = pages_per_block * page_size
    sq = pl.Squeezed()
    q_spec = pl.BlockSpec((sq, num_kv_heads, rows, head_dim), lambda c, *_: (c, 0, 0, 0))
    any_spec = pl.BlockSpec(memory_space=pltpu.HBM)   # the pools: DMA sources, never VMEM
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=6, grid=(num_chunks,),
        in_specs=[q_spec, any_spec, any_spec],
        out_specs=q_spec,
        scratch_shapes=[pltpu.VMEM((2,) + block_shape(span, num_kv_heads, head_dim,
                                                      k_pages.dtype), k_pages.dtype),
                        pltpu.VMEM((2,) + block_shape(span, num_kv_heads, head_dim,
                                                      v_pages.dtype), v_pages.dtype),
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
    )(table, cseq, pos0, kv_end, nblk, blk0, q_c, k_pages, v_pages)


def default_pages_per_block(page_size: int, pages_per_seq: int) -> int:
    """Pages per KV block: 512 positions from pages of 16 or more (fewer loop steps), else
    256 (at most 256 page DMAs per block and buffer); at most a sequence."""
    span = 512 if page_size >= 16 else 256
    return max(1, min(pages_per_seq, -(-span // page_size)))


def default_block_q(num_tokens: int, num_seqs: int, group: int) -> int:
    """Query tokens per chunk: 8 for decode shapes (one token per sequence: the rows past it
    are padding), else the largest of 32 / 16 / 8 with at most 256 query rows (``G * BQ``):
    each chunk re-reads its KV, so longer chunks cut the DMA traffic and fill the MXU."""
    if num_tokens <= num_seqs:
        return 8
    return next((bq for bq in (32, 16) if group * bq <= 256), 8)


@functools.partial(jax.jit, static_argnames=("scale", "block_q", "pages_per_block",
                                             "interpret"))
def paged_attention(q, k_pages, v_pages, cu_seqlens, seq_lens, page_table, *, scale: float,
                    block_q: int | None = None, pages_per_block: int | None = None,
                    interpret: bool = False):
    """Pallas ragged paged attention; same contract as ``paged_attention_reference``.
    ``block_q`` (query tokens per chunk) defaults to ``default_block_q``, ``pages_per_block``
    to ``default_pages_per_block``."""
    num_tokens, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_pages.shape
    num_seqs, pages_per_seq = page_table.shape
    check_attention(q, k_pages, v_pages)
    group = num_q_heads // num_kv_heads
    block_q = block_q or default_block_q(num_tokens, num_seqs, group)
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
    o_c = attention_call(page_table.reshape(-1), cseq, pos0.astype(jnp.int32),
                         kv_end.astype(jnp.int32), nblk, blk0, q_c, k_pages, v_pages,
                         scale=scale, block_q=block_q, pages_per_block=ppb,
                         pages_per_seq=pages_per_seq, interpret=interpret)
    o_c = o_c.reshape(num_chunks, num_kv_heads, group, block_q, head_dim)
    seq, valid = token_seq_ids(cu_seqlens, num_tokens)
    tok = jnp.arange(num_tokens) - cu_seqlens[seq]
    o = o_c[chunk_off[seq] + tok // block_q, :, :, tok % block_q]       # [T, Hkv, G, D]
    o = jnp.where(valid[:, None, None, None], o, 0).astype(q.dtype)
    return o.reshape(num_tokens, num_q_heads, head_dim)
