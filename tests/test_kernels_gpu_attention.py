"""GPU (Pallas Triton) paged attention vs its plain-jnp reference, and its Triton lowering.

On CPU the kernel runs with ``interpret=True``; on a GPU compiled (``PALLAS_INTERPRET``
overrides). Cases mix prefill (with and without a cached prefix) and decode, GQA ratios 1..4
(3: a non-power-of-two row stack), page sizes 1, 3, 4, 16, head dims 8..32 (padded to >= 16).
Tolerances: fp32 1e-5 (online vs one-pass softmax, exact fp32 dots); bf16 2e-2 (bf16 output
ulp, probabilities rounded to bf16 before the PV dot).
"""

from __future__ import annotations

import functools
import inspect
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.aot.gpu import sm90_target
from pallas_kernels.gpu import paged_attention as attn
from pallas_kernels.reference import paged_attention as attn_ref
from pallas_kernels.testing import paged_attention_case
from pallas_kernels.tpu import paged_attention as tpu_attn

_ENV = os.environ.get("PALLAS_INTERPRET")
INTERPRET = _ENV == "1" if _ENV in ("0", "1") else jax.default_backend() != "gpu"
TOL = {"float32": 1e-5, "bfloat16": 2e-2}
I32 = jnp.int32
TRITON = "__gpu$xla.gpu.triton"


def _case(rng, ext, prefix, page_size, hq, hkv, d, dtype, pad_tokens=2):
    q, kp, vp, cu, seq_lens, table = paged_attention_case(rng, ext, prefix, page_size, hq, hkv,
                                                          d, pad_tokens)
    arr = lambda a: jnp.asarray(a, dtype)
    return arr(q), arr(kp), arr(vp), jnp.asarray(cu), jnp.asarray(seq_lens), jnp.asarray(table)


# ext (extend lengths), prefix (cached), page_size, hq, hkv, d, dtype, block_q, pages_per_block
CASES = [
    ([3, 1, 17, 1], [4, 7, 0, 20], 1, 2, 2, 8, "float32", 8, None),      # mixed, ps 1
    ([9, 2, 5], [0, 30, 3], 4, 4, 1, 16, "bfloat16", 8, None),           # GQA 4, ps 4
    ([1, 1, 1, 1, 1], [0, 5, 12, 33, 2], 16, 6, 2, 8, "float32", 8, None),  # decode, GQA 3
    ([20, 7], [37, 0], 3, 3, 1, 32, "float32", 16, 2),                   # ps 3, tiles span pages
    ([0, 12, 1], [5, 17, 70], 16, 4, 2, 16, "bfloat16", 8, 1),           # empty seq, ps 16
    ([33], [0], 1, 1, 1, 16, "float32", 8, 64),                          # long causal block
]


@pytest.mark.parametrize("ext,prefix,page_size,hq,hkv,d,dtype,block_q,ppb", CASES)
def test_gpu_paged_attention_matches_reference(ext, prefix, page_size, hq, hkv, d, dtype,
                                               block_q, ppb):
    rng = np.random.default_rng(page_size * 10 + hq)
    args = _case(rng, ext, prefix, page_size, hq, hkv, d, dtype)
    o_ref = attn_ref.paged_attention_reference(*args, scale=d ** -0.5)
    o = attn.paged_attention(*args, scale=d ** -0.5, block_q=block_q, pages_per_block=ppb,
                             interpret=INTERPRET)
    assert o.dtype == jnp.dtype(dtype) and o.shape == args[0].shape
    np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(o_ref, np.float32),
                               atol=TOL[dtype], rtol=TOL[dtype])
    assert not np.any(np.asarray(o, np.float32)[int(args[3][-1]):])


def test_gpu_paged_attention_ignores_positions_past_seq_len():
    """Garbage (even NaN) in page rows past a sequence's length must not reach its outputs."""
    rng = np.random.default_rng(3)
    q, kp, vp, cu, seq_lens, table = _case(rng, [2, 5], [3, 0], 4, 2, 1, 16, "float32")
    clean = (kp, vp)
    kp, vp = np.array(kp), np.array(vp)
    for b, n in enumerate(np.asarray(seq_lens)):
        for p in range(int(n), table.shape[1] * 4):
            kp[table[b, p // 4], p % 4] = np.nan
            vp[table[b, p // 4], p % 4] = np.nan
    o_ref = attn_ref.paged_attention_reference(q, *clean, cu, seq_lens, table, scale=0.25)
    args = (q, jnp.asarray(kp), jnp.asarray(vp), cu, seq_lens, table)
    o = attn.paged_attention(*args, scale=0.25, interpret=INTERPRET)
    assert np.all(np.isfinite(np.asarray(o)))
    np.testing.assert_allclose(np.asarray(o), np.asarray(o_ref), atol=1e-5, rtol=1e-5)


def test_gpu_paged_attention_same_signature_and_checks_as_tpu():
    assert (inspect.signature(attn.paged_attention)
            == inspect.signature(tpu_attn.paged_attention))
    rng = np.random.default_rng(0)
    args = _case(rng, [2, 3], [1, 0], 2, 2, 1, 8, "float32")
    with pytest.raises(ValueError, match="multiple of kv heads"):
        attn.paged_attention(args[0][:, :1], args[1][:, :, :1].repeat(2, 2),
                             args[2][:, :, :1].repeat(2, 2), *args[3:], scale=0.3)
    with pytest.raises(ValueError, match="block_q 12"):
        attn.paged_attention(*args, scale=0.3, block_q=12)
    with pytest.raises(ValueError, match="k_pages"):
        attn.paged_attention(*args[:2], args[2][..., :4], *args[3:], scale=0.3)


def _sd(shape, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype)


@pytest.mark.parametrize("dtype,page_size,hq,hkv,d", [
    (jnp.float32, 1, 8, 2, 128), (jnp.bfloat16, 16, 8, 2, 128), (jnp.bfloat16, 64, 16, 2, 256),
    (jnp.bfloat16, 3, 6, 2, 80)])
def test_gpu_paged_attention_lowers_for_triton(dtype, page_size, hq, hkv, d):
    t, b = 256, 4
    f = functools.partial(attn.paged_attention, scale=0.1, interpret=False)
    pages = _sd((65, page_size, hkv, d), dtype)
    with sm90_target():
        exported = jax.export.export(
            jax.jit(f), platforms=["cuda"],
            disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON)])(
            _sd((t, hq, d), dtype), pages, pages, _sd((b + 1,), I32), _sd((b,), I32),
            _sd((b, 16), I32))
    assert TRITON in exported.mlir_module()


# Decode layout (T <= B: one query per sequence, rows = heads, KV split over programs), and
# explicit tilings: heads split over programs, KV splits on prefill chunks, a padded head dim.
DECODE_CASES = [
    ([1, 1, 1, 1], [0, 5, 40, 200], 4, 4, 2, 16, "float32"),      # long + short, ps 4
    ([1, 0, 1, 1, 0], [9, 3, 300, 0, 7], 16, 8, 1, 24, "bfloat16"),  # empty seqs, D 24 -> 32
    ([1, 1], [300, 2], 1, 6, 2, 16, "float32"),                     # few long, GQA 3, ps 1
]


@pytest.mark.parametrize("ext,prefix,page_size,hq,hkv,d,dtype", DECODE_CASES)
def test_gpu_paged_attention_split_kv_decode(ext, prefix, page_size, hq, hkv, d, dtype):
    rng = np.random.default_rng(len(ext) * 7 + d)
    args = _case(rng, ext, prefix, page_size, hq, hkv, d, dtype,
                 pad_tokens=len(ext) - sum(ext) - 1 if 0 in ext else 0)
    num_tokens, num_seqs = args[0].shape[0], args[5].shape[0]
    assert num_tokens <= num_seqs
    tiles = attn.choose_tiles(args[0].dtype, hq // hkv, d, 8, page_size, None, True,
                              num_tokens * hkv, args[5].shape[1] * page_size)
    assert tiles.block_q == 1 and tiles.kv_splits > 1
    o_ref = attn_ref.paged_attention_reference(*args, scale=d ** -0.5)
    o = attn.paged_attention(*args, scale=d ** -0.5, interpret=INTERPRET)
    np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(o_ref, np.float32),
                               atol=TOL[dtype], rtol=TOL[dtype])
    assert not np.any(np.asarray(o, np.float32)[int(args[3][-1]):])


@pytest.mark.parametrize("tiles", [
    attn.Tiles(block_q=8, heads=2, rows=16, block_kv=16, head_splits=2),  # heads split in 2
    attn.Tiles(block_q=8, heads=4, rows=32, block_kv=16, kv_splits=3),    # split prefill KV
    attn.Tiles(block_q=1, heads=1, rows=16, block_kv=32, head_splits=4, kv_splits=2),
])
def test_gpu_paged_attention_explicit_tiles(tiles):
    rng = np.random.default_rng(11)
    args = _case(rng, [9, 1, 20], [0, 50, 13], 4, 4, 1, 24, "float32")
    o_ref = attn_ref.paged_attention_reference(*args, scale=0.2)
    o = attn.attention_with_tiles(*args, scale=0.2, tiles=tiles, interpret=INTERPRET)
    np.testing.assert_allclose(np.asarray(o), np.asarray(o_ref), atol=1e-5, rtol=1e-5)
    assert not np.any(np.asarray(o)[int(args[3][-1]):])
