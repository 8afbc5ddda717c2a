"""Causal conv1d Pallas kernels (ragged prefill with window snapshots, decode) vs references.

Tolerances: fp32 1e-5 (same products, different summation order); bf16 outputs 2e-2 (one bf16
ulp); windows are copies of the inputs, so they must match exactly.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import ops
from pallas_kernels._common import interpret_default
from pallas_kernels.reference import causal_conv1d as conv_ref
from pallas_kernels.testing import ragged_case, slot_args
from pallas_kernels.tpu import causal_conv1d as conv

INTERPRET = interpret_default()
TOL = {"float32": 1e-5, "bfloat16": 2e-2}


def _inputs(rng, case, kw, channels, dtype, use_bias):
    x = rng.normal(size=(case.num_tokens, channels))
    w = rng.normal(size=(kw, channels))
    bias = rng.normal(size=(channels,)) if use_bias else None
    pool = rng.normal(size=(case.num_slots, kw - 1, channels))
    pool[0] = 0
    cast = lambda a: None if a is None else jnp.asarray(a, dtype)
    return cast(x), cast(w), cast(bias), pool


@pytest.mark.parametrize("kw,channels,dtype,use_bias,lens", [
    (4, 8, "float32", True, [5, 1, 19, 8]),
    (2, 128, "bfloat16", False, [3, 7, 2, 1, 9, 4, 6, 11]),
    (3, 16, "float32", False, [0, 17]),
    (4, 384, "bfloat16", True, [13, 0, 22, 3]),   # 384-channel blocks (several vregs wide)
    (5, 16, "float32", True, [1, 1, 2, 30, 1, 0]),  # several sequence starts in one block
])
def test_conv_extend_kernel_matches_reference(kw, channels, dtype, use_bias, lens):
    rng = np.random.default_rng(kw)
    b = len(lens) + 1
    snaps = [(i, o) for i, n in enumerate(lens) for o in sorted({0, 1, kw - 2, 8, n}) if o <= n]
    case = ragged_case(rng, lens, num_tokens=sum(lens) + 3, num_seqs=b, snapshots=snaps)
    x, w, bias, pool = _inputs(rng, case, kw, channels, dtype, use_bias)
    slots = [jnp.asarray(a) for a in slot_args(case)]
    y_ref, pool_ref = conv_ref.causal_conv1d_extend_reference(x, w, bias, jnp.asarray(pool, dtype),
                                                         *slots)
    y, new_pool = conv.causal_conv1d_extend(x, w, bias, jnp.asarray(pool, dtype), *slots,
                                            chunk_size=8, interpret=INTERPRET)
    assert y.dtype == jnp.dtype(dtype)
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(y_ref, np.float32),
                               atol=TOL[dtype], rtol=TOL[dtype])
    np.testing.assert_array_equal(np.asarray(new_pool, np.float32),
                                  np.asarray(pool_ref, np.float32))


def test_ragged_case_reads_no_slot_another_sequence_writes():
    """The kernels' contract (the engine's guarantee): a sequence reads its own write slot or a
    slot no sequence of the call writes. Cases that broke it made JAX >= 0.11's interpreter
    (aliased pools updated in place, as on hardware) disagree with the references."""
    rng = np.random.default_rng(0)
    kinds = set()
    for _ in range(200):
        num_seqs = int(rng.integers(1, 9))
        lens = [int(n) for n in rng.integers(0, 20, size=num_seqs)]
        snaps = [(int(b), int(rng.integers(0, lens[b] + 1)))
                 for b in rng.integers(0, num_seqs, size=int(rng.integers(0, 6)))]
        case = ragged_case(rng, lens, num_tokens=sum(lens) + 2, num_seqs=num_seqs + 1,
                           snapshots=snaps)
        written = set(case.write_slot[:num_seqs]) | set(case.snap_slot[:len(snaps)])
        for b in range(num_seqs):
            read = int(case.read_slot[b])
            own = read == case.write_slot[b]
            assert read > 0 and (own or read not in written), (lens, snaps, b, read)
            kinds.add(own)
    assert kinds == {True, False}  # both an own slot and a cached snapshot get read


@pytest.mark.parametrize("kw,dtype", [(4, "float32"), (2, "bfloat16")])
def test_conv_decode_kernel_matches_reference(kw, dtype):
    rng = np.random.default_rng(10 + kw)
    case = ragged_case(rng, [1, 1, 1], num_tokens=4, num_seqs=4)
    x, w, bias, pool = _inputs(rng, case, kw, 16, dtype, True)
    args = (x, w, bias)
    slots = (jnp.asarray(case.read_slot), jnp.asarray(case.write_slot))
    y_ref, pool_ref = conv_ref.causal_conv1d_decode_reference(*args, jnp.asarray(pool, dtype),
                                                          *slots)
    y, new_pool = conv.causal_conv1d_decode(*args, jnp.asarray(pool, dtype), *slots,
                                            interpret=INTERPRET)
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(y_ref, np.float32),
                               atol=TOL[dtype], rtol=TOL[dtype])
    np.testing.assert_array_equal(np.asarray(new_pool, np.float32),
                                  np.asarray(pool_ref, np.float32))


def test_conv_ops_pallas_matches_reference_and_checks_dtype():
    rng = np.random.default_rng(1)
    case = ragged_case(rng, [6, 10], num_tokens=16, num_seqs=2, snapshots=[(1, 4)])
    x, w, bias, pool = _inputs(rng, case, 4, 8, "float32", True)
    y_p, pool_p = ops.causal_conv1d_extend(x, w, bias, pool, *slot_args(case), impl="pallas")
    y_r, pool_r = ops.causal_conv1d_extend(x, w, bias, pool, *slot_args(case),
                                           impl="reference")
    np.testing.assert_allclose(np.asarray(y_p), np.asarray(y_r), atol=1e-5)
    np.testing.assert_array_equal(np.asarray(pool_p), np.asarray(pool_r))
    with pytest.raises(ValueError, match="conv_pool dtype"):
        conv.causal_conv1d_decode(x[:2], w, bias, jnp.asarray(pool, jnp.bfloat16),
                                  jnp.asarray(case.read_slot), jnp.asarray(case.write_slot))


@pytest.mark.parametrize("dtype,chunk,pad", [("float32", 8, 0), ("bfloat16", 16, 5)])
def test_conv_extend_writes_its_own_read_slot(dtype, chunk, pad):
    """Initial windows are read in place from the pool: a sequence whose write slot is its read
    slot still gets every window from its old initial window, snapshots at offsets < K-1
    included; sequences start anywhere in a row block (and straddle blocks)."""
    rng = np.random.default_rng(5)
    lens = [2, 19, 0, 1, 7]
    snaps = [(0, 1), (1, 0), (1, 2), (1, 17), (2, 0), (3, 0), (4, 1), (4, 6)]
    case = ragged_case(rng, lens, num_tokens=sum(lens) + pad, num_seqs=6, snapshots=snaps)
    case = dataclasses.replace(case, read_slot=case.write_slot.copy())   # fresh, distinct
    x, w, bias, pool = _inputs(rng, case, 4, 128, dtype, True)
    slots = [jnp.asarray(a) for a in slot_args(case)]
    y_ref, pool_ref = conv_ref.causal_conv1d_extend_reference(x, w, bias,
                                                              jnp.asarray(pool, dtype), *slots)
    y, new_pool = conv.causal_conv1d_extend(x, w, bias, jnp.asarray(pool, dtype), *slots,
                                            chunk_size=chunk, interpret=INTERPRET)
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(y_ref, np.float32),
                               atol=TOL[dtype], rtol=TOL[dtype])
    assert not np.any(np.asarray(y, np.float32)[sum(lens):])
    np.testing.assert_array_equal(np.asarray(new_pool, np.float32),
                                  np.asarray(pool_ref, np.float32))
