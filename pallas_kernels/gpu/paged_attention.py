"""GPU (Pallas Triton) causal attention of ragged packed queries over paged K/V.

Same contract as ``reference.paged_attention`` (its ``paged_attention_reference`` is the test
oracle): token i of sequence b sits at position ``seq_lens[b] - n_b + (i - cu_seqlens[b])``
and attends to positions ``0..its own``; position p lives at ``page_table[b, p // page_size]``,
row ``p % page_size``.

Grid ``(NC, Hkv * head_splits, kv_splits)``, all parallel. Program (c, h', s) takes query chunk
c (``block_q`` tokens of one sequence, restarting at every sequence start) and stacks ``heads``
of the ``G = Hq / Hkv`` query heads of KV head ``h' // head_splits`` as rows ``g * block_q + t``
(padded to a power of two >= 16, so the dots are tensor-core sized), gathered straight from the
packed ``q``. It loops over its share of the sequence's KV tiles of ``block_kv`` positions up to
its last query (online softmax in fp32 registers). Each tile row is gathered from its own page,
so any ``page_size >= 1`` works and a tile may span pages; the gather offsets are per row and
contiguous along the head dim (no per-element clamps), so Triton emits 16-byte vector loads
and pipelines them with ``cp.async``. Head dims are padded to a power of two >= 16 with masked
columns.

Decode layout (``T <= B``, one query per sequence): ``block_q`` 1, rows = heads. When a call
has few programs (decode, or a short extend over a long prefix) the KV range of each chunk is
split over ``kv_splits`` programs (flash decoding): each writes its unnormalised fp32 partial
output with its running max and denominator, and ``_combine`` (jnp) merges them exactly.
Splits are balanced per chunk at run time (``ceil(tiles / kv_splits)`` of the chunk's own
tiles each); splits past a short sequence's end do nothing.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels._common import check, chunk_spans, max_chunks

_F32 = jnp.float32
_MASKED = -1e30
SPLIT_BELOW = 264       # split the KV range when a call has fewer programs (2 per H200 SM) ...
TARGET_PROGRAMS = 528   # ... until it has ~4 programs per SM (132 SMs)
MIN_SPLIT_TILES = 2     # each split covers at least this many KV tiles (static bound)


@dataclasses.dataclass(frozen=True)
class Tiles:
    """Static tiling of one call (hashable: a static argument of the jitted kernel call).

    block_q: query tokens per chunk (1 in the decode layout); heads: query heads per program;
    rows: ``heads * block_q`` rounded up to a power of two >= 16; block_kv: KV positions per
    tile (power of two >= 16); head_splits: programs per KV head (``ceil(G / heads)``);
    kv_splits: programs per KV range (flash decoding; 1 = no split).
    """

    block_q: int = 8
    heads: int = 8
    rows: int = 64
    block_kv: int = 64
    head_splits: int = 1
    kv_splits: int = 1
    num_warps: int = 4
    num_stages: int = 2


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def choose_tiles(dtype, group: int, head_dim: int, block_q: int, page_size: int,
                 pages_per_block: int | None, decode: bool, programs: int,
                 max_kv: int) -> Tiles:
    """Tiles that fit an H100/H200 program (255 registers, 227 KB of shared memory) without
    spilling at head_dim 256 (measured with the compile gate, docs/kernels.md). ``programs``:
    ``NC * Hkv`` before any split; ``max_kv``: the page table's positions (static)."""
    padded = max(16, _pow2_at_least(head_dim))
    exact = jnp.dtype(dtype) == jnp.float32
    big = padded >= 256
    bq = 1 if decode else block_q
    max_rows = max(16, 64 * 256 // max(padded, 256))      # [rows, DP] f32 accumulator
    heads = max(1, min(group, max_rows // bq))
    rows = max(16, _pow2_at_least(heads * bq))
    default_kv = (16 if big else 32) if exact else 64     # fp32 dots are FMA: small K/V tiles
    block_kv = max(16, _pow2_at_least(pages_per_block * page_size) if pages_per_block
                   else default_kv)
    head_splits = -(-group // heads)
    kv_splits = 1
    if programs * head_splits < SPLIT_BELOW:    # decode, or a short extend over a long prefix
        most = max(1, -(-max_kv // block_kv) // MIN_SPLIT_TILES)
        kv_splits = max(1, min(most, -(-TARGET_PROGRAMS // (programs * head_splits))))
    warps = 8 if big and (exact or not decode) else 4
    stages = 3 if decode and not exact else 2
    return Tiles(block_q=bq, heads=heads, rows=rows, block_kv=block_kv,
                 head_splits=head_splits, kv_splits=kv_splits, num_warps=warps,
                 num_stages=stages)


def _gather_rows(ref, idx, ok, dims, num_dims):
    """``ref[*idx, dims]`` ``[R, DP]`` (0 where masked). idx: per-row ``[R]`` indices of the
    leading dims; the head dim ``dims`` is left unclamped so the addresses stay contiguous."""
    shape = (idx[0].shape[0], dims.shape[0])
    full = tuple(jnp.broadcast_to(i[:, None], shape) for i in idx)
    mask = ok[:, None]
    if dims.shape[0] > num_dims:                  # padded head dim: mask the extra columns
        mask = mask & (dims < num_dims)[None, :]
    return pltr.load(ref.at[full + (jnp.broadcast_to(dims[None, :], shape),)],
                     mask=jnp.broadcast_to(mask, shape), other=0)


def _attn_kernel(meta_ref,   # [4, NC] int32 per chunk: seq, first packed token, pos of it, count
                 lens_ref,   # [B] int32 seq_lens: cached prefix + extend
                 table_ref,  # [B, P] int32 page table
                 q_ref,      # [T, Hq, D]
                 k_ref,      # [N, ps, Hkv, D]
                 v_ref,      # [N, ps, Hkv, D]
                 *out_refs,  # o [T + RP, Hq, DP] (q dtype); or, split: acc [T + RP, Hq, S, DP]
                             # f32 unnormalised, m and l [T + RP, Hq, S] f32
                 scale: float, tiles: Tiles, group: int):
    c, hh, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    h, part = hh // tiles.head_splits, hh % tiles.head_splits
    num_tokens, _, head_dim = q_ref.shape
    page_size, pages_per_seq = k_ref.shape[1], table_ref.shape[1]
    bq, bk = tiles.block_q, tiles.block_kv
    dims = jnp.arange(out_refs[0].shape[-1], dtype=jnp.int32)
    seq, start, pos0, count = meta_ref[0, c], meta_ref[1, c], meta_ref[2, c], meta_ref[3, c]
    kv_len = lens_ref[seq]
    row = jnp.arange(tiles.rows, dtype=jnp.int32)
    g, t = part * tiles.heads + row // bq, row % bq
    ok = (t < count) & (row // bq < tiles.heads) & (g < group)
    head = h * group + jnp.minimum(g, group - 1)
    q = _gather_rows(q_ref, (jnp.where(ok, start + t, 0), head), ok, dims, head_dim)
    q_pos = pos0 + t
    exact = q_ref.dtype == jnp.float32
    kv_h = jnp.full((bk,), h, jnp.int32)
    seq_b = jnp.full((bk,), seq, jnp.int32)

    def body(kb, carry):
        m, denom, acc = carry                                 # [RP], [RP], [RP, DP] f32
        kv_pos = kb * bk + jnp.arange(bk, dtype=jnp.int32)
        kv_ok = kv_pos < kv_len
        page = pltr.load(table_ref.at[seq_b, jnp.minimum(kv_pos // page_size,
                                                         pages_per_seq - 1)])
        idx = (page, kv_pos % page_size, kv_h)
        k = _gather_rows(k_ref, idx, kv_ok, dims, head_dim)
        v = _gather_rows(v_ref, idx, kv_ok, dims, head_dim)
        s = pltr.dot(q, k, trans_b=True, allow_tf32=not exact).astype(_F32) * scale
        live = (kv_pos[None, :] <= q_pos[:, None]) & kv_ok[None, :]
        m_new = jnp.maximum(m, jnp.max(jnp.where(live, s, _MASKED), axis=1))
        p = jnp.where(live, jnp.exp(s - m_new[:, None]), 0.0)
        alpha = jnp.exp(m - m_new)
        pv = pltr.dot(p.astype(v.dtype), v, allow_tf32=not exact).astype(_F32)
        return m_new, alpha * denom + jnp.sum(p, axis=1), alpha[:, None] * acc + pv

    last = pos0 + count                                     # positions < last are needed
    num_blocks = jnp.where(count > 0, (last + bk - 1) // bk, 0)
    per_split = (num_blocks + tiles.kv_splits - 1) // tiles.kv_splits
    lo = split * per_split
    hi = jnp.minimum(lo + per_split, num_blocks)
    shape = (tiles.rows, dims.shape[0])
    init = (jnp.full((tiles.rows,), _MASKED, _F32), jnp.zeros((tiles.rows,), _F32),
            jnp.zeros(shape, _F32))
    m, denom, acc = jax.lax.fori_loop(lo, jnp.maximum(lo, hi), body, init)
    out_tok = jnp.where(ok, start + t, num_tokens + row)
    _store_outputs(out_refs, split, out_tok, head, ok, dims, m, denom, acc)


def _store_outputs(out_refs, split, out_tok, head, ok, dims, m, denom, acc):
    """Rows ``out_tok [RP]``, heads ``head [RP]`` (masked by ``ok``): the normalised output, or
    with one ``out_refs`` per split statistic the unnormalised ``acc`` and its ``m``, ``denom``
    at split ``split``."""
    shape = acc.shape
    full = lambda a: jnp.broadcast_to(a[:, None], shape)  # noqa: E731
    cols = jnp.broadcast_to(dims, shape)
    if len(out_refs) == 1:
        o = jnp.where(denom[:, None] > 0, acc / jnp.maximum(denom, 1e-30)[:, None], 0.0)
        pltr.store(out_refs[0].at[full(out_tok), full(head), cols],
                   o.astype(out_refs[0].dtype), mask=full(ok))
        return
    acc_ref, m_ref, l_ref = out_refs
    s_idx = jnp.full(out_tok.shape, split, jnp.int32)
    pltr.store(acc_ref.at[full(out_tok), full(head), full(s_idx), cols], acc, mask=full(ok))
    pltr.store(m_ref.at[out_tok, head, s_idx], m, mask=ok)
    pltr.store(l_ref.at[out_tok, head, s_idx], denom, mask=ok)


def _combine(acc, m, denom):
    """Merge the splits: acc ``[T, Hq, S, DP]``, m, denom ``[T, Hq, S]`` f32 -> ``[T, Hq, DP]``."""
    top = jnp.max(m, axis=2, keepdims=True)
    w = jnp.exp(m - top)                                   # empty splits: m = -1e30 -> 0
    total = jnp.sum(w * denom, axis=2)
    o = jnp.sum(w[..., None] * acc, axis=2)
    return jnp.where(total[..., None] > 0, o / jnp.maximum(total, 1e-30)[..., None], 0.0)


@functools.partial(jax.jit, static_argnames=("scale", "tiles", "interpret"))
def attention_with_tiles(q, k_pages, v_pages, cu_seqlens, seq_lens, page_table, *, scale: float,
                         tiles: Tiles, interpret: bool = False):
    """``paged_attention`` with explicit ``tiles`` (the public wrapper picks them)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_pages.shape[2]
    num_seqs = page_table.shape[0]
    group = num_q_heads // num_kv_heads
    padded_dim = max(16, _pow2_at_least(head_dim))
    bq = tiles.block_q
    num_chunks = max_chunks(num_tokens, bq, num_seqs)
    cseq, loc, count = chunk_spans(cu_seqlens, num_tokens, bq, num_chunks)
    pos0 = seq_lens[cseq] - (cu_seqlens[cseq + 1] - cu_seqlens[cseq]) + loc
    meta = jnp.stack([cseq, cu_seqlens[cseq] + loc, pos0, count]).astype(jnp.int32)
    kernel = functools.partial(_attn_kernel, scale=scale, tiles=tiles, group=group)
    rows_out = num_tokens + tiles.rows
    splits = tiles.kv_splits
    if splits == 1:
        out_shape = [jax.ShapeDtypeStruct((rows_out, num_q_heads, padded_dim), q.dtype)]
    else:
        out_shape = [jax.ShapeDtypeStruct((rows_out, num_q_heads, splits, padded_dim), _F32),
                     jax.ShapeDtypeStruct((rows_out, num_q_heads, splits), _F32),
                     jax.ShapeDtypeStruct((rows_out, num_q_heads, splits), _F32)]
    outs = pl.pallas_call(
        kernel, grid=(num_chunks, num_kv_heads * tiles.head_splits, splits),
        out_shape=out_shape, interpret=interpret,
        compiler_params=pltr.CompilerParams(num_warps=tiles.num_warps,
                                            num_stages=tiles.num_stages),
    )(meta, seq_lens.astype(jnp.int32), page_table.astype(jnp.int32), q, k_pages, v_pages)
    o = outs[0] if splits == 1 else _combine(*(a[:num_tokens] for a in outs))
    valid = jnp.arange(num_tokens) < cu_seqlens[-1]
    return jnp.where(valid[:, None, None], o[:num_tokens, :, :head_dim], 0).astype(q.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "block_q", "pages_per_block",
                                             "interpret", "fixed_order"))
def paged_attention(q, k_pages, v_pages, cu_seqlens, seq_lens, page_table, *, scale: float,
                    block_q: int | None = None, pages_per_block: int | None = None,
                    interpret: bool = False, fixed_order: bool = False):
    """Pallas-Triton ragged paged attention; same contract as ``paged_attention_reference``.

    q ``[T, Hq, D]``; pages ``[N, page_size, Hkv, D]``; page_table ``[B, P]`` int32. The KV
    tile is ``pages_per_block * page_size`` positions rounded up to a power of two >= 16
    (default: ``choose_tiles``). ``block_q`` (query tokens per chunk, a multiple of 8) defaults
    to 8; ``T <= B`` takes the decode layout (one query per program row, split KV). Returns
    ``[T, Hq, D]`` in q.dtype, 0 for padding tokens. [deterministic] ``fixed_order``: the
    extend layout and no KV split whatever the step (both follow the batch otherwise, and a
    query's bits with them).
    """
    num_tokens, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_pages.shape
    num_seqs, pages_per_seq = page_table.shape
    check(k_pages.shape == v_pages.shape and k_pages.shape[3] == head_dim,
          f"k_pages {k_pages.shape} / v_pages {v_pages.shape} must be [N, ps, Hkv, {head_dim}]")
    check(num_q_heads % num_kv_heads == 0,
          f"query heads {num_q_heads} must be a multiple of kv heads {num_kv_heads}")
    block_q = 8 if block_q is None else block_q
    check(block_q % 8 == 0 and block_q > 0, f"block_q {block_q} must be a multiple of 8")
    decode = num_tokens <= num_seqs and not fixed_order
    bq = 1 if decode else block_q
    tiles = choose_tiles(q.dtype, num_q_heads // num_kv_heads, head_dim, block_q, page_size,
                         pages_per_block, decode,
                         max_chunks(num_tokens, bq, num_seqs) * num_kv_heads,
                         pages_per_seq * page_size)
    if fixed_order:
        tiles = dataclasses.replace(tiles, kv_splits=1)
    return attention_with_tiles(q, k_pages, v_pages, cu_seqlens, seq_lens, page_table,
                                scale=scale, tiles=tiles, interpret=interpret)
