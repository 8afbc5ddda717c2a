"""GPU (Pallas Triton) weight-absorbed MLA over the paged latent cache, prefill and decode.

Same contract as ``reference.mla_attention.mla_attention_reference`` (the test oracle): one
shared "KV head" whose key is the latent row ``[c | k_r]`` (``R = kv_lora_rank`` latent values,
then ``dr`` rope values) and whose value is ``c``; token i of sequence b sits at position
``seq_lens[b] - n_b + (i - cu_seqlens[b])`` and attends causally to positions ``0..its own``;
position p lives at ``page_table[b, p // page_size]``, row ``p % page_size``.

Why not the generic paged attention kernel: it pads the head dim to a power of two (576 ->
1024) and stacks all query heads as rows of one tile, which at Kimi Linear's sizes (32 heads,
R 512, dr 64) needs 512 KB of shared memory on sm_90. Here:

* grid ``(NC, ceil(Hq / BH), NV)``, all parallel: query chunk c (``BQ`` tokens of one
  sequence), a block of ``BH`` query heads stacked as rows ``h * BQ + t`` (padded to a power of
  two >= 16), and a value block;
* the row is never padded as a whole: the score ``q . [c | k_r]`` is accumulated over column
  blocks of the latent (``BD`` wide, one dot each) plus the rope part (its own dot), so no tile
  is wider than ``max(BD, BV)``;
* one value block (``BV >= R``, ``NV = 1``): one fp32 accumulator ``[rows, BD]`` per latent
  column block, fed by the same tiles as the score (the latent is read once);
  several (``BV < R``, ``NV = R / BV``): one accumulator ``[rows, BV]``, the program's value
  columns loaded apart and the score recomputed per value block (fewer accumulator registers
  for tensor-core-sized row blocks, at the price of ``NV`` times the score dots).

Online softmax in fp32 registers over key tiles of ``BK`` positions (each row gathered from its
own page, so any ``page_size >= 1`` works), fp32 accumulation; bf16 operands when the pool is
bf16 (tensor cores), exact fp32 dots when it is fp32. Dims that are not powers of two are masked.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels._common import check, chunk_layout, max_chunks
from pallas_kernels.reference.mla_attention import check_latent

_F32 = jnp.float32
_MASKED = -1e30
_EXACT = (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST)


@dataclasses.dataclass(frozen=True)
class MlaBlocks:
    """Tile sizes. ``block_v`` / ``block_d``: latent columns per value block / per score dot
    (clipped to R rounded up to a power of two); ``block_kv``: key positions per tile;
    ``kv_splits``: programs sharing one row block's key tiles (flash-decoding: each writes its
    normalised partial output and log-sum-exp, merged after the kernel)."""

    block_h: int = 16
    block_q: int = 1
    block_v: int = 512
    block_d: int = 512
    block_kv: int = 32
    num_warps: int = 4
    num_stages: int = 2
    kv_splits: int = 1


# Defaults per (phase, operand dtype), chosen on the sm_90 compile at Kimi Linear sizes (32
# heads, R 512, dr 64; docs/kernels.md has the numbers): no spills, shared memory < 227 KB.
BLOCKS = {
    # 16 heads x 1 token (M 16: warp MMA), the whole latent one value block, its tile reused
    ("decode", "bf16"): MlaBlocks(),
    # 8 heads x 8 tokens (M 64: warpgroup MMA), 2 value blocks of 256 (1.5x the score dots;
    # one block of 512 needs 128 accumulator registers a thread and spills)
    ("prefill", "bf16"): MlaBlocks(block_h=8, block_q=8, block_v=256, block_d=128,
                                   block_kv=16, num_warps=8),
    # exact fp32 dots run on the FMA units: narrow score dots, 16 rows, 8 warps
    ("decode", "f32"): MlaBlocks(block_d=64, block_kv=16, num_warps=8),
    ("prefill", "f32"): MlaBlocks(block_h=2, block_q=8, block_d=64, block_kv=16, num_warps=8),
}


PROGRAMS = 132   # H100 / H200 SMs: enough programs for one wave
MAX_SPLITS = 16  # partial outputs are f32 [S, B, Hq, R]: keep them small next to the pages


def _pow2_at_least_16(n: int) -> int:
    return max(16, 1 << (max(n, 1) - 1).bit_length())


def _cols(start, width: int, limit: int, exact: bool):
    """Column indices ``start + [0, width)`` and their mask (None when statically in range);
    masked columns are clamped to ``limit - 1`` so every address stays in bounds."""
    cols = start + jnp.arange(width, dtype=jnp.int32)
    if exact:
        return cols, None
    return jnp.minimum(cols, limit - 1), cols < limit


def _load(ref, lead: tuple, cols, col_ok, row_ok):
    """Tile ``[n, w]`` of ``ref[*lead, cols]`` (lead: ``[n]`` index arrays or scalars), 0 where
    ``row_ok [n]`` (and ``col_ok [w]``) is false."""
    shape = (row_ok.shape[0], cols.shape[0])
    idx = tuple(jnp.broadcast_to(jnp.asarray(i, jnp.int32).reshape(-1, 1), shape) for i in lead)
    mask = row_ok[:, None] if col_ok is None else row_ok[:, None] & col_ok[None, :]
    return pltr.load(ref.at[idx + (jnp.broadcast_to(cols[None, :], shape),)],
                     mask=jnp.broadcast_to(mask, shape), other=0)


def _dot(a, b, exact: bool, trans_b: bool = False):
    dims = (((1,), (1,)) if trans_b else ((1,), (0,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, precision=_EXACT if exact else None,
                               preferred_element_type=_F32)


def _key_tile(kb, carry, *, lat_ref, table_ref, seq, kv_len, q_pos, qs, spans, vspan,
              scale: float, block_kv: int):
    """One online-softmax step over key positions ``kb * BK + [0, BK)``.

    carry: running max ``[rows]``, denominator ``[rows]``, accumulators (one ``[rows, BV]``
    with ``vspan``, else one ``[rows, BD]`` per latent column block) f32; ``qs``: the query
    tiles of ``spans`` (latent column blocks, then the rope block).
    """
    m, denom, accs = carry
    page_size, pages_per_seq = lat_ref.shape[1], table_ref.shape[1]
    exact, dt = lat_ref.dtype == jnp.float32, lat_ref.dtype
    kv_pos = kb * block_kv + jnp.arange(block_kv, dtype=jnp.int32)
    kv_ok = kv_pos < kv_len
    col = jnp.clip(kv_pos // page_size, 0, pages_per_seq - 1)
    page = pltr.load(table_ref.at[jnp.full(col.shape, seq, jnp.int32), col])
    lead = (page, kv_pos % page_size, jnp.zeros_like(page))
    tiles = [_load(lat_ref, lead, cols, cok, kv_ok) for cols, cok in spans]
    s = functools.reduce(jnp.add, [_dot(qj, kj, exact, trans_b=True)
                                   for qj, kj in zip(qs, tiles, strict=True)]) * scale
    s = jnp.where((kv_pos[None, :] <= q_pos[:, None]) & kv_ok[None, :], s, _MASKED)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    p = jnp.exp(s - m_new[:, None]).astype(dt)
    alpha = jnp.exp(m - m_new)
    values = tiles[:-1] if vspan is None else [_load(lat_ref, lead, *vspan, kv_ok)]
    accs = tuple(alpha[:, None] * a + _dot(p, v, exact)
                 for a, v in zip(accs, values, strict=True))
    return m_new, alpha * denom + jnp.sum(p.astype(_F32), axis=1), accs


def _mla_kernel(meta_ref,   # [4, NC] i32 per chunk: seq, first packed token, its position, count
                lens_ref,   # [B] i32 seq_lens: cached prefix + extend
                table_ref,  # [B, P] i32 page table
                q_ref,      # [T, Hq, R + dr] absorbed queries | rope queries
                lat_ref,    # [N, ps, 1, R + dr] latent rows
                *outs,      # o [T + rows, Hq, W] (rows >= T, columns >= R absorb masks), or
                            # with key splits o [S, T + rows, Hq, W] f32 and lse [S, T + rows, Hq]
                scale: float, rank: int, blocks: MlaBlocks, rows: int, bd: int, bv: int,
                rope: int):
    c, hb = pl.program_id(0), pl.program_id(1)
    vb, part = pl.program_id(2) // blocks.kv_splits, pl.program_id(2) % blocks.kv_splits
    num_tokens, num_heads, width = q_ref.shape
    seq, start, pos0, count = meta_ref[0, c], meta_ref[1, c], meta_ref[2, c], meta_ref[3, c]
    row = jnp.arange(rows, dtype=jnp.int32)
    g, t = row // blocks.block_q, row % blocks.block_q
    head = hb * blocks.block_h + g
    ok = (t < count) & (g < blocks.block_h) & (head < num_heads)
    tok, head = jnp.where(ok, start + t, 0), jnp.minimum(head, num_heads - 1)
    spans = [_cols(d0, bd, rank, d0 + bd <= rank) for d0 in range(0, rank, bd)]
    spans.append(_cols(rank, rope, width, rope == width - rank))
    qs = [_load(q_ref, (tok, head), cols, cok, ok).astype(lat_ref.dtype) for cols, cok in spans]
    split = bv < rank  # several value blocks: this program's value columns loaded apart
    step = functools.partial(
        _key_tile, lat_ref=lat_ref, table_ref=table_ref, seq=seq, kv_len=lens_ref[seq],
        q_pos=pos0 + t, qs=qs, spans=spans, scale=scale, block_kv=blocks.block_kv,
        vspan=_cols(vb * bv, bv, rank, rank % bv == 0) if split else None)
    widths = [bv] if split else [bd] * (len(spans) - 1)
    init = (jnp.full((rows,), _MASKED, _F32), jnp.zeros((rows,), _F32),
            tuple(jnp.zeros((rows, w), _F32) for w in widths))
    num_blocks = jnp.where(count > 0, (pos0 + count + blocks.block_kv - 1) // blocks.block_kv, 0)
    per_split = (num_blocks + blocks.kv_splits - 1) // blocks.kv_splits
    lo = part * per_split
    m, denom, accs = jax.lax.fori_loop(lo, jnp.minimum(lo + per_split, num_blocks), step, init)
    inv = jnp.where(denom > 0, 1.0 / jnp.maximum(denom, 1e-30), 0.0)[:, None]
    out_tok = jnp.where(ok, tok, num_tokens + row)
    lead = (out_tok, head) if len(outs) == 1 else (jnp.full_like(row, part), out_tok, head)
    for j, (acc, w) in enumerate(zip(accs, widths, strict=True)):
        shape = (rows, w)
        idx = tuple(jnp.broadcast_to(i[:, None], shape) for i in lead)
        cols = jnp.broadcast_to(vb * bv + j * w + jnp.arange(w, dtype=jnp.int32)[None, :], shape)
        pltr.store(outs[0].at[idx + (cols,)], (acc * inv).astype(outs[0].dtype),
                   mask=jnp.broadcast_to(ok[:, None], shape))
    if len(outs) == 2:  # every value block stores the same log-sum-exp
        lse = jnp.where(denom > 0, m + jnp.log(jnp.maximum(denom, 1e-30)), _MASKED)
        pltr.store(outs[1].at[lead], lse, mask=ok)


def _merge_splits(o, lse):
    """Flash-decoding merge: o ``[S, T, Hq, R]`` f32 partial outputs, lse ``[S, T, Hq]``."""
    w = jnp.exp(lse - jnp.max(lse, axis=0))
    return jnp.sum(w[..., None] * o, axis=0) / jnp.sum(w, axis=0)[..., None]


def _chunk_meta(cu_seqlens, seq_lens, num_tokens: int, block_q: int, num_chunks: int):
    """``[4, NC]`` int32 per chunk: sequence, first packed token, position of it, token count."""
    _, cseq, _, chunk_off = chunk_layout(cu_seqlens, num_tokens, block_q, num_chunks)
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    c = jnp.arange(num_chunks, dtype=jnp.int32)
    loc = (c - chunk_off[cseq]) * block_q
    count = jnp.where(c < chunk_off[-1], jnp.clip(lens[cseq] - loc, 0, block_q), 0)
    pos0 = seq_lens[cseq] - lens[cseq] + loc
    return jnp.stack([cseq, cu_seqlens[cseq] + loc, pos0, count]).astype(jnp.int32)


def default_blocks(num_tokens: int, num_seqs: int, num_heads: int, dtype) -> MlaBlocks:
    """``BLOCKS`` of a decode step (no more tokens than sequences) or a prefill, for fp32 or
    16-bit pools; a decode step of few sequences splits the keys until about ``PROGRAMS``
    programs run. Any blocks are correct for any layout: this is only the faster guess."""
    phase = "decode" if num_tokens <= num_seqs else "prefill"
    blocks = BLOCKS[phase, "f32" if jnp.dtype(dtype) == jnp.float32 else "bf16"]
    if phase == "prefill":
        return blocks
    programs = max(num_seqs, 1) * pl.cdiv(num_heads, blocks.block_h)
    return dataclasses.replace(blocks, kv_splits=max(1, min(MAX_SPLITS, PROGRAMS // programs)))


@functools.partial(jax.jit, static_argnames=("kv_lora_rank", "scale", "blocks", "interpret",
                                             "fixed_order"))
def mla_attention(q, latent_pages, cu_seqlens, seq_lens, page_table, *, kv_lora_rank: int,
                  scale: float, blocks: MlaBlocks | None = None, interpret: bool = False,
                  fixed_order: bool = False):
    """Pallas-Triton MLA over the paged latent cache; same contract as
    ``mla_attention_reference``.

    q ``[T, Hq, R + dr]`` (per head ``W_uk^T q_nope | q_rope``); latent_pages ``[N, ps, 1,
    R + dr]`` holding this step's rows; page_table ``[B, P]`` int32. Returns ``[T, Hq, R]`` in
    q.dtype (``softmax(scale q . row) @ c``), 0 for padding tokens. ``blocks`` defaults to
    ``default_blocks(T, B, Hq, latent_pages.dtype)``; [deterministic] with ``fixed_order``
    the prefill blocks (no key split) whatever the step (the defaults follow the batch, and a
    query's bits with them).
    """
    num_tokens, num_heads, width = q.shape
    num_seqs = page_table.shape[0]
    check_latent(q, latent_pages, kv_lora_rank)
    if blocks is None and fixed_order:
        blocks = BLOCKS["prefill", "f32" if latent_pages.dtype == jnp.float32 else "bf16"]
    blocks = blocks or default_blocks(num_tokens, num_seqs, num_heads, latent_pages.dtype)
    rank_p = _pow2_at_least_16(kv_lora_rank)
    bd, bv = min(blocks.block_d, rank_p), min(blocks.block_v, rank_p)
    for name, b in (("block_d", bd), ("block_v", bv), ("block_kv", blocks.block_kv)):
        check(b >= 16 and b & (b - 1) == 0, f"{name} {b} must be a power of two >= 16")
    check(min(blocks.block_h, blocks.block_q, blocks.kv_splits) > 0,
          f"block_h {blocks.block_h}, block_q {blocks.block_q} and kv_splits "
          f"{blocks.kv_splits} must be positive")
    rows = _pow2_at_least_16(blocks.block_h * blocks.block_q)
    num_chunks = max_chunks(num_tokens, blocks.block_q, num_seqs)
    meta = _chunk_meta(cu_seqlens, seq_lens, num_tokens, blocks.block_q, num_chunks)
    kernel = functools.partial(_mla_kernel, scale=scale, rank=kv_lora_rank, blocks=blocks,
                               rows=rows, bd=bd, bv=bv,
                               rope=_pow2_at_least_16(width - kv_lora_rank))
    num_vblocks = pl.cdiv(kv_lora_rank, bv)
    out_width = num_vblocks * bv if bv < kv_lora_rank else pl.cdiv(kv_lora_rank, bd) * bd
    grid = (num_chunks, pl.cdiv(num_heads, blocks.block_h), num_vblocks * blocks.kv_splits)
    splits, lead = blocks.kv_splits, (num_tokens + rows, num_heads)
    out_shape = (jax.ShapeDtypeStruct(lead + (out_width,), q.dtype) if splits == 1 else
                 (jax.ShapeDtypeStruct((splits,) + lead + (out_width,), _F32),
                  jax.ShapeDtypeStruct((splits,) + lead, _F32)))
    out = pl.pallas_call(
        kernel, grid=grid, out_shape=out_shape, interpret=interpret,
        compiler_params=pltr.CompilerParams(num_warps=blocks.num_warps,
                                            num_stages=blocks.num_stages),
    )(meta, seq_lens.astype(jnp.int32), page_table.astype(jnp.int32), q, latent_pages)
    if splits == 1:
        o = out[:num_tokens, :, :kv_lora_rank]
    else:
        o = _merge_splits(out[0][:, :num_tokens, :, :kv_lora_rank], out[1][:, :num_tokens])
    valid = jnp.arange(num_tokens) < cu_seqlens[-1]
    return jnp.where(valid[:, None, None], o, 0).astype(q.dtype)
