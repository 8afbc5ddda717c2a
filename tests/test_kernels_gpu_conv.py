"""GPU (Pallas Triton) causal conv1d kernels vs the plain-jnp references, and their lowering.

On CPU the kernels run with ``interpret=True``; on a GPU they run compiled (``PALLAS_INTERPRET``
overrides). The lowering tests export for ``cuda`` from any machine, which runs the Pallas ->
Triton IR lowering (power-of-two block shapes, gather/scatter indexing, dtypes).
Tolerances: fp32 1e-5 (same products, other summation order); bf16 outputs 2e-2 (one bf16 ulp
plus rounding); windows are copies of the inputs, so they must match exactly.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.aot.gpu import sm90_target
from pallas_kernels.gpu import causal_conv1d as conv
from pallas_kernels.reference import causal_conv1d as conv_ref
from pallas_kernels.testing import ragged_case, slot_args
from pallas_kernels.tpu import causal_conv1d as tpu_conv

_ENV = os.environ.get("PALLAS_INTERPRET")
INTERPRET = _ENV == "1" if _ENV in ("0", "1") else jax.default_backend() != "gpu"
TOL = {"float32": 1e-5, "bfloat16": 2e-2}
I32 = jnp.int32
TRITON = "__gpu$xla.gpu.triton"


def _inputs(rng, case, kw, channels, dtype, use_bias):
    cast = lambda a: None if a is None else jnp.asarray(a, dtype)
    x = cast(rng.normal(size=(case.num_tokens, channels)))
    w = cast(rng.normal(size=(kw, channels)))
    bias = cast(rng.normal(size=(channels,))) if use_bias else None
    pool = rng.normal(size=(case.num_slots, kw - 1, channels))
    pool[0] = 0
    return x, w, bias, pool


def _assert_close(got, want, dtype):
    assert got.dtype == jnp.dtype(dtype)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               atol=TOL[dtype], rtol=TOL[dtype])


# kw, channels (48: 16-channel tiles), dtype, bias, lens, chunk_size, zero initial windows
EXTEND_CASES = [
    (4, 8, "float32", True, [5, 1, 19, 8], 8, False),
    (2, 128, "bfloat16", False, [3, 7, 2, 1, 9, 4, 6, 11], 8, False),
    (3, 16, "float32", False, [0, 17], 8, True),
    (4, 48, "bfloat16", True, [16, 2, 9], 8, False),
    (4, 256, "float32", True, [33, 1, 7], 16, False),
    (3, 32, "float32", True, [1, 25], 24, False),        # chunk_size 24: 32-row tiles
    (5, 8, "bfloat16", True, [2, 13, 0, 6], 8, True),
]


@pytest.mark.parametrize("kw,channels,dtype,use_bias,lens,chunk,zero_init", EXTEND_CASES)
def test_gpu_conv_extend_matches_reference(kw, channels, dtype, use_bias, lens, chunk,
                                           zero_init):
    rng = np.random.default_rng(kw * 100 + channels)
    offsets = {0, 1, kw - 2, chunk - 1, chunk, chunk + 1}
    snaps = [(i, o) for i, n in enumerate(lens) for o in sorted(offsets | {n - 1, n})
             if 0 <= o <= n]
    case = ragged_case(rng, lens, num_tokens=sum(lens) + 3, num_seqs=len(lens) + 1,
                       snapshots=snaps, zero_init=zero_init)
    x, w, bias, pool = _inputs(rng, case, kw, channels, dtype, use_bias)
    slots = [jnp.asarray(a) for a in slot_args(case)]
    y_ref, pool_ref = conv_ref.causal_conv1d_extend_reference(
        x, w, bias, jnp.asarray(pool, dtype), *slots)
    y, new_pool = conv.causal_conv1d_extend(x, w, bias, jnp.asarray(pool, dtype), *slots,
                                            chunk_size=chunk, interpret=INTERPRET)
    _assert_close(y, y_ref, dtype)
    assert not np.any(np.asarray(y, np.float32)[sum(lens):])
    np.testing.assert_array_equal(np.asarray(new_pool, np.float32),
                                  np.asarray(pool_ref, np.float32))


def test_gpu_conv_extend_drops_slot0_and_keeps_other_slots():
    rng = np.random.default_rng(7)
    case = ragged_case(rng, [6, 11], num_tokens=20, num_seqs=2, snapshots=[(0, 3), (1, 9)])
    case = dataclasses.replace(case, snap_slot=np.array([0, case.snap_slot[1]], np.int32))
    x, w, bias, pool = _inputs(rng, case, 4, 16, "float32", True)
    pool = pool.astype(np.float32)
    _, new_pool = conv.causal_conv1d_extend(x, w, bias, jnp.asarray(pool),
                                            *[jnp.asarray(a) for a in slot_args(case)],
                                            chunk_size=8, interpret=INTERPRET)
    new_pool = np.asarray(new_pool)
    assert not np.any(new_pool[0])
    written = set(case.write_slot.tolist()) | {int(case.snap_slot[1])}
    untouched = [s for s in range(1, case.num_slots) if s not in written]
    np.testing.assert_array_equal(new_pool[untouched], pool[untouched])
    # the window after token 9 of sequence 1 is its inputs 6..8 (packed rows 12..14)
    np.testing.assert_array_equal(new_pool[case.snap_slot[1]], np.asarray(x)[6 + 6:6 + 9])


@pytest.mark.parametrize("kw,channels,dtype,use_bias", [
    (4, 16, "float32", True), (2, 128, "bfloat16", False), (4, 48, "bfloat16", True)])
def test_gpu_conv_decode_matches_reference(kw, channels, dtype, use_bias):
    rng = np.random.default_rng(10 + kw)
    case = ragged_case(rng, [1, 1, 1], num_tokens=4, num_seqs=4)
    x, w, bias, pool = _inputs(rng, case, kw, channels, dtype, use_bias)
    slots = (jnp.asarray(case.read_slot), jnp.asarray(case.write_slot))
    y_ref, pool_ref = conv_ref.causal_conv1d_decode_reference(x, w, bias,
                                                              jnp.asarray(pool, dtype), *slots)
    y, new_pool = conv.causal_conv1d_decode(x, w, bias, jnp.asarray(pool, dtype), *slots,
                                            interpret=INTERPRET)
    _assert_close(y, y_ref, dtype)
    np.testing.assert_array_equal(np.asarray(new_pool, np.float32),
                                  np.asarray(pool_ref, np.float32))


def test_gpu_conv_same_signatures_and_checks_as_tpu():
    for name in ("causal_conv1d_extend", "causal_conv1d_decode"):
        assert (inspect.signature(getattr(conv, name))
                == inspect.signature(getattr(tpu_conv, name)))
    rng = np.random.default_rng(1)
    case = ragged_case(rng, [6, 10], num_tokens=16, num_seqs=2)
    x, w, bias, pool = _inputs(rng, case, 4, 8, "float32", True)
    slots = [jnp.asarray(a) for a in slot_args(case)]
    with pytest.raises(ValueError, match="conv_pool dtype"):
        conv.causal_conv1d_decode(x[:2], w, bias, jnp.asarray(pool, jnp.bfloat16), *slots[1:3])
    with pytest.raises(ValueError, match="weight shape"):
        conv.causal_conv1d_extend(x, w[:, :4], bias, jnp.asarray(pool), *slots)
    with pytest.raises(ValueError, match="chunk_size 12"):
        conv.causal_conv1d_extend(x, w, bias, jnp.asarray(pool), *slots, chunk_size=12)
    wide = jnp.zeros((10, 8), jnp.float32)   # K - 1 = 9 > chunk_size 8
    with pytest.raises(ValueError, match="must be <= chunk_size 8"):
        conv.causal_conv1d_extend(x, wide, bias, jnp.zeros((pool.shape[0], 9, 8)), *slots,
                                  chunk_size=8)


def _sd(shape, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype)


def _export_cuda(fn, *args):
    with sm90_target():
        exported = jax.export.export(
            jax.jit(fn), platforms=["cuda"],
            disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON)])(*args)
    assert TRITON in exported.mlir_module()


@pytest.mark.parametrize("dtype,channels", [(jnp.float32, 256), (jnp.bfloat16, 8192),
                                            (jnp.bfloat16, 96)])
def test_gpu_conv_kernels_lower_for_triton(dtype, channels):
    t, b, s, n, kw = 256, 4, 4, 9, 4
    slots = (_sd((b + 1,), I32), _sd((b,), I32), _sd((b,), I32), _sd((s,), I32),
             _sd((s,), I32), _sd((s,), I32))
    f = functools.partial(conv.causal_conv1d_extend, chunk_size=64, interpret=False)
    _export_cuda(f, _sd((t, channels), dtype), _sd((kw, channels), dtype),
                 _sd((channels,), dtype), _sd((n, kw - 1, channels), dtype), *slots)
    f = functools.partial(conv.causal_conv1d_decode, interpret=False)
    _export_cuda(f, _sd((b, channels), dtype), _sd((kw, channels), dtype), None,
                 _sd((n, kw - 1, channels), dtype), _sd((b,), I32), _sd((b,), I32))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_conv_writes_its_own_read_slot(dtype):
    """The kernels read initial windows in place from the pool: a sequence whose write slot is
    its read slot (the usual case) still gets every window from the old initial window,
    including snapshots at offsets < K - 1 written after its final window, and an empty
    sequence's copies."""
    rng = np.random.default_rng(5)
    lens = [2, 19, 0, 1]
    snaps = [(0, 1), (1, 0), (1, 2), (1, 17), (2, 0), (3, 0)]
    case = ragged_case(rng, lens, num_tokens=24, num_seqs=4, snapshots=snaps)
    case = dataclasses.replace(case, read_slot=case.write_slot.copy())   # fresh, distinct
    x, w, bias, pool = _inputs(rng, case, 4, 32, dtype, True)
    slots = [jnp.asarray(a) for a in slot_args(case)]
    y_ref, pool_ref = conv_ref.causal_conv1d_extend_reference(
        x, w, bias, jnp.asarray(pool, dtype), *slots)
    y, new_pool = conv.causal_conv1d_extend(x, w, bias, jnp.asarray(pool, dtype), *slots,
                                            chunk_size=8, interpret=INTERPRET)
    _assert_close(y, y_ref, dtype)
    np.testing.assert_array_equal(np.asarray(new_pool, np.float32),
                                  np.asarray(pool_ref, np.float32))
    same = (jnp.asarray(case.write_slot), jnp.asarray(case.write_slot))
    y_ref, pool_ref = conv_ref.causal_conv1d_decode_reference(
        x[:4], w, bias, jnp.asarray(pool, dtype), *same)
    y, new_pool = conv.causal_conv1d_decode(x[:4], w, bias, jnp.asarray(pool, dtype), *same,
                                            interpret=INTERPRET)
    _assert_close(y, y_ref, dtype)
    np.testing.assert_array_equal(np.asarray(new_pool, np.float32),
                                  np.asarray(pool_ref, np.float32))
