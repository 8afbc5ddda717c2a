"""Paged attention Pallas kernel vs its reference (prefill, decode, GQA, page sizes).

Tolerances: fp32 1e-5 (online vs. one-pass softmax); bf16 2e-2 (outputs are bf16, one ulp
is 2^-8 relative; the TPU kernel also rounds the softmax weights to bf16 for the P V matmul,
measured ~1 ulp).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import ops
from pallas_kernels._common import interpret_default
from pallas_kernels.reference import paged_attention as attn_ref
from pallas_kernels.testing import paged_attention_case
from pallas_kernels.tpu import paged_attention as attn

INTERPRET = interpret_default()
TOL = {"float32": 1e-5, "bfloat16": 2e-2}


def _case(rng, ext, prefix, page_size, hq, hkv, d, dtype, pad_tokens=2):
    q, kp, vp, cu, seq_lens, table = paged_attention_case(rng, ext, prefix, page_size, hq, hkv,
                                                          d, pad_tokens)
    arr = lambda a: jnp.asarray(a, dtype)
    return arr(q), arr(kp), arr(vp), jnp.asarray(cu), jnp.asarray(seq_lens), jnp.asarray(table)


@pytest.mark.parametrize("ext,prefix,page_size,hq,hkv,d,dtype", [
    ([3, 1, 17, 1], [4, 7, 0, 20], 1, 2, 2, 8, "float32"),       # prefill + decode, ps 1
    ([9, 2, 5], [0, 30, 3], 4, 4, 1, 16, "bfloat16"),            # GQA 4, ps 4
    ([1, 1, 1, 1, 1], [0, 5, 12, 33, 2], 16, 6, 2, 8, "float32"),  # pure decode, ps 16
])
def test_paged_attention_kernel_matches_reference(ext, prefix, page_size, hq, hkv, d, dtype):
    rng = np.random.default_rng(page_size)
    args = _case(rng, ext, prefix, page_size, hq, hkv, d, dtype)
    o_ref = attn_ref.paged_attention_reference(*args, scale=d ** -0.5)
    o = attn.paged_attention(*args, scale=d ** -0.5, interpret=INTERPRET)
    assert o.dtype == jnp.dtype(dtype)
    np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(o_ref, np.float32),
                               atol=TOL[dtype], rtol=TOL[dtype])
    assert not np.any(np.asarray(o, np.float32)[int(args[3][-1]):])


def _poison_unused_rows(k_pages, v_pages, seq_lens, table):
    """NaN in every page row no sequence position maps to (stale rows past a sequence end)."""
    page_size = k_pages.shape[1]
    used = np.zeros(k_pages.shape[:2], bool)
    for b, n in enumerate(np.asarray(seq_lens)):
        pos = np.arange(n)
        used[np.asarray(table)[b, pos // page_size], pos % page_size] = True
    k, v = np.array(k_pages, np.float32), np.array(v_pages, np.float32)
    k[~used], v[~used] = np.nan, np.nan
    return jnp.asarray(k, k_pages.dtype), jnp.asarray(v, v_pages.dtype)


@pytest.mark.parametrize("page_size,hq,hkv,d,dtype,ppb", [
    (1, 8, 2, 128, "bfloat16", 4),      # 32-bit words of two heads, blocks of 4 positions
    (2, 8, 4, 128, "float32", 3),       # strided f32 rows, 4 heads
    (3, 6, 6, 128, "bfloat16", 2),      # 3 words per position
    (8, 4, 1, 32, "float32", 2),        # one f32 KV head in 8-row pages: [L, D] buffers (MLA)
])
def test_paged_attention_blocks_and_stale_rows(page_size, hq, hkv, d, dtype, ppb):
    """Several KV blocks per chunk and several chunks per sequence (the DMA chain across blocks
    and chunks), the kernel's head-tile layouts, and NaN in every page row past the sequences:
    outputs stay exact."""
    rng = np.random.default_rng(hkv)
    q, kp, vp, cu, seq_lens, table = _case(rng, [3, 1, 17, 1], [4, 7, 0, 20], page_size, hq,
                                           hkv, d, dtype)
    o_ref = attn_ref.paged_attention_reference(q, kp, vp, cu, seq_lens, table, scale=d ** -0.5)
    kp, vp = _poison_unused_rows(kp, vp, seq_lens, table)
    o = attn.paged_attention(q, kp, vp, cu, seq_lens, table, scale=d ** -0.5,
                             block_q=8, pages_per_block=ppb, interpret=INTERPRET)
    o, o_ref = np.asarray(o, np.float32), np.asarray(o_ref, np.float32)
    assert np.isfinite(o).all()
    np.testing.assert_allclose(o, o_ref, atol=TOL[dtype], rtol=TOL[dtype])


def test_paged_attention_ops_and_shape_check():
    rng = np.random.default_rng(0)
    args = _case(rng, [2, 3], [1, 0], 2, 2, 1, 8, "float32")
    o_p = ops.paged_attention(*args, scale=0.3, impl="pallas")
    o_r = ops.paged_attention(*args, scale=0.3, impl="reference")
    np.testing.assert_allclose(np.asarray(o_p), np.asarray(o_r), atol=1e-5)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        attn.paged_attention(args[0][:, :1], args[1][:, :, :1].repeat(2, 2),
                             args[2][:, :, :1].repeat(2, 2), *args[3:], scale=0.3)
    # decode shapes: chunks of 8; prefill: the longest chunk with at most 256 query rows
    assert [attn.default_block_q(t, 64, g) for t, g in [(64, 8), (2048, 8), (2048, 16),
                                                         (2048, 32)]] == [8, 32, 16, 8]
    with pytest.raises(ValueError, match="pages_per_block"):
        attn.paged_attention(*args, scale=0.3, pages_per_block=args[5].shape[1] + 1)
