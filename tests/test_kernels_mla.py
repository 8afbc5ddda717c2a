"""GPU (Pallas Triton) MLA over the paged latent cache vs its plain-jnp reference.

On CPU the kernel runs with ``interpret=True``; on a GPU compiled (``PALLAS_INTERPRET``
overrides). Cases: prefill chunks with and without a cached prefix, an empty sequence, decode;
page sizes 1 and 4; NaN in every page row past a sequence's length; latent rows that are powers
of two (R 32, dr 16: the unmasked paths, split into several score dots and value blocks) and
that are not (R 24, dr 8: masked columns); head counts that the head block does and does not
divide; key splits (flash-decoding) merged, empty ones included. Tolerances: fp32 1e-5 (online
vs one-pass softmax, exact fp32 dots); bf16 2e-2 (bf16 output ulp, probabilities rounded to
bf16 before the value dot).
"""

from __future__ import annotations

import inspect
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import ops
from pallas_kernels.aot.gpu import sm90_target
from pallas_kernels.gpu import mla_attention as mla
from pallas_kernels.reference.mla_attention import mla_attention_reference
from pallas_kernels.testing import paged_attention_case

_ENV = os.environ.get("PALLAS_INTERPRET")
INTERPRET = _ENV == "1" if _ENV in ("0", "1") else jax.default_backend() != "gpu"
TOL = {"float32": 1e-5, "bfloat16": 2e-2}
TRITON = "__gpu$xla.gpu.triton"
PREFILL = ([5, 0, 20], [3, 6, 0])     # extend lengths, cached prefix lengths (20: 2 key tiles)
DECODE = ([1, 1, 1, 1], [0, 4, 11, 2])
SPLIT = mla.MlaBlocks(block_h=2, block_q=8, block_v=16, block_d=16, block_kv=16, kv_splits=2)


def _case(ext, prefix, page_size, hq, rank, rope, dtype, seed=0):
    """Inputs, and the pages with NaN in every row past its sequence's length (the kernel gets
    these: no masked row may reach an output; the reference gets the clean pages)."""
    rng = np.random.default_rng(seed)
    q, pages, _, cu, seq_lens, table = paged_attention_case(rng, ext, prefix, page_size, hq, 1,
                                                            rank + rope)
    dirty = pages.copy()
    for b, n in enumerate(seq_lens):
        for p in range(int(n), table.shape[1] * page_size):
            dirty[table[b, p // page_size], p % page_size] = np.nan
    arr = lambda a: jnp.asarray(a, dtype)  # noqa: E731
    return (arr(q), arr(pages), jnp.asarray(cu), jnp.asarray(seq_lens), jnp.asarray(table),
            arr(dirty))


# phase {prefill, decode} x page size {1, 4} x dtype {fp32, bf16}, each pair of factors once:
# (ext, prefix), page_size, hq, rank, rope, dtype, blocks (None: the wrapper's default)
CASES = [
    (PREFILL, 4, 4, 24, 8, "float32", None),       # 2 head blocks, masked columns
    (PREFILL, 1, 5, 32, 16, "bfloat16", SPLIT),    # head tail, 2 value blocks, 2 splits
    (DECODE, 1, 6, 32, 16, "float32", mla.MlaBlocks(block_h=4, block_kv=16, kv_splits=3)),
    (DECODE, 4, 4, 24, 8, "bfloat16", None),       # default: 16 key splits, most of them empty
]


@pytest.mark.parametrize("lens,page_size,hq,rank,rope,dtype,blocks", CASES)
def test_gpu_mla_attention_matches_reference(lens, page_size, hq, rank, rope, dtype, blocks):
    *args, dirty = _case(*lens, page_size, hq, rank, rope, dtype)
    scale = (rank + rope) ** -0.5
    o_ref = mla_attention_reference(*args, kv_lora_rank=rank, scale=scale)
    o = mla.mla_attention(args[0], dirty, *args[2:], kv_lora_rank=rank, scale=scale,
                          blocks=blocks, interpret=INTERPRET)
    assert o.dtype == jnp.dtype(dtype) and o.shape == args[0].shape[:2] + (rank,)
    np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(o_ref, np.float32),
                               atol=TOL[dtype], rtol=TOL[dtype])
    assert not np.any(np.asarray(o, np.float32)[int(args[2][-1]):])  # padding tokens


def test_gpu_mla_attention_checks_shapes_and_matches_the_op_signature():
    q, pages, cu, seq_lens, table, _ = _case(*DECODE, 1, 4, 24, 8, "float32")
    with pytest.raises(ValueError, match="latent_pages"):
        mla.mla_attention(q, pages[..., :16], cu, seq_lens, table, kv_lora_rank=24, scale=0.2)
    with pytest.raises(ValueError, match="kv_lora_rank 32"):
        mla.mla_attention(q, pages, cu, seq_lens, table, kv_lora_rank=32, scale=0.2)
    with pytest.raises(ValueError, match="block_kv 24"):
        mla.mla_attention(q, pages, cu, seq_lens, table, kv_lora_rank=24, scale=0.2,
                          blocks=mla.MlaBlocks(block_kv=24))
    params = inspect.signature(mla.mla_attention).parameters
    assert list(params)[:5] == list(inspect.signature(ops.mla_attention).parameters)[:5]
    assert {"kv_lora_rank", "scale", "interpret"} <= set(params)
    assert mla.default_blocks(64, 4, 32, jnp.float32) == mla.BLOCKS["prefill", "f32"]
    decode = mla.default_blocks(64, 64, 32, jnp.bfloat16)  # 64 x 2 head blocks: one wave
    assert decode == mla.BLOCKS["decode", "bf16"] and decode.kv_splits == 1
    assert mla.default_blocks(4, 4, 32, jnp.bfloat16).kv_splits == 132 // 8


def test_gpu_mla_attention_lowers_for_triton_at_kimi_linear_sizes():
    """32 heads over rows of 512 + 64 (bf16 prefill blocks: 2 value blocks) lower to Triton."""
    sd = jax.ShapeDtypeStruct
    t, b, pages_per_seq, width = 256, 4, 16, 512 + 64
    f = jax.jit(lambda *a: mla.mla_attention(*a, kv_lora_rank=512, scale=0.07, interpret=False))
    with sm90_target():
        exported = jax.export.export(
            f, platforms=["cuda"],
            disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON)])(
            sd((t, 32, width), jnp.bfloat16), sd((65, 16, 1, width), jnp.bfloat16),
            sd((b + 1,), jnp.int32), sd((b,), jnp.int32), sd((b, pages_per_seq), jnp.int32))
    assert TRITON in exported.mlir_module()
