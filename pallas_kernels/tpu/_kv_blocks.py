"""VMEM block buffers of paged K/V for the TPU attention kernel: their layout, the page DMA that
fills one, and the per-head ``[L, D]`` tiles read from one.

A block buffer holds ``L`` positions of every KV head. Fast path (``D % 128 == 0`` and ``Hkv`` a
multiple of the dtype's packing; f32 and bf16): shape ``[L, Hkv / packing, packing, D]``, whose
32-bit view ``[L, Hkv / packing, 1, D]`` is row-major in rows of 128 lanes, so one
sublane-strided load per 128-lane fold gathers a head (f32) or a bf16 head pair (even head in
the low 16 bits) for all L positions in the MXU's native layout, with no relayout and no
head-major pages. One f32 KV head (MLA) in pages of 8k rows: ``[L, D]``. Otherwise
``[L, Hkv, D]``, read as f32 and sliced (a relayout). Pages always split a buffer along whole
tiles: one wait for the whole buffer counts exactly the bytes of its page DMAs.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

_F32 = jnp.float32


def _packing(dtype) -> int:
    return 4 // jnp.dtype(dtype).itemsize


def _word_layout(num_kv_heads: int, head_dim: int, dtype) -> bool:
    """Whether a block is kept as 32-bit words (``_head_tiles``' fast path)."""
    packing = _packing(dtype)
    return head_dim % 128 == 0 and num_kv_heads % packing == 0 and packing in (1, 2)


def block_shape(span: int, page_size: int, num_kv_heads: int, head_dim: int,
                dtype) -> tuple[int, ...]:
    """One VMEM block buffer: ``[L, Hkv / packing, packing, D]`` on the fast path (the unit or
    packing second-minor dim makes its 32-bit view row-major in 128-lane rows); ``[L, D]`` for
    one 32-bit KV head (MLA's latent rows) in pages of whole 8-row tiles; else
    ``[L, Hkv, D]``. Pages split every layout along whole tiles, so one wait for the whole
    buffer counts exactly the bytes of its page DMAs."""
    if _word_layout(num_kv_heads, head_dim, dtype):
        packing = _packing(dtype)
        return (span, num_kv_heads // packing, packing, head_dim)
    if num_kv_heads == 1 and _packing(dtype) == 1 and page_size % 8 == 0:
        return (span, head_dim)
    return (span, num_kv_heads, head_dim)


def page_copy(page_ref, buf, first: int, sem, interpret: bool):
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


def head_tiles(buf) -> list:
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
