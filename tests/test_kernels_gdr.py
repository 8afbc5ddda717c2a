"""Gated delta rule Pallas kernels (chunked ragged prefill, decode) against their references.

Interpreted on CPU (``PALLAS_INTERPRET=0`` compiles them, e.g. on a TPU). Tolerances: fp32
outputs and states 1e-4 (the chunked form reorders fp32 sums; measured ~1e-7 at these sizes);
bf16 inputs give bf16 outputs compared at 2e-2 (one bf16 ulp is 2^-8 relative), states (fp32
from the same bf16 inputs) at 1e-4.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import ops
from pallas_kernels._common import interpret_default
from pallas_kernels.reference import gated_delta_rule as gdr_ref
from pallas_kernels.testing import gdr_inputs, ragged_case, slot_args
from pallas_kernels.tpu import gated_delta_rule as gdr
from pallas_kernels.tpu.gated_delta_rule_decode import gated_delta_rule_decode

INTERPRET = interpret_default()
TOL = {"float32": (1e-4, 1e-4), "bfloat16": (2e-2, 2e-2)}

# (lens, T, B, Hk, Hv, Dk, Dv, chunk, snapshots); chunk 8 puts boundaries at 8, 16, ...
CASES = [
    ([5, 1, 19, 8], 40, 5, 1, 2, 16, 8, 8,
     [(0, 0), (0, 1), (2, 8), (2, 9), (2, 16), (2, 18), (2, 19), (3, 8), (1, 1), (2, 0)]),
    ([13], 16, 1, 2, 2, 32, 32, 8, [(0, 7), (0, 12), (0, 13)]),
    ([3, 7, 2, 1, 9, 4, 6, 11], 48, 8, 1, 4, 16, 16, 16,
     [(1, 0), (1, 5), (4, 9), (7, 10), (7, 1), (0, 3), (4, 1)]),
    ([0, 21, 0], 24, 4, 2, 4, 8, 16, 8, [(1, 16), (1, 20), (1, 21), (0, 0)]),
]


def _run(case_idx: int, dtype: str, zero_init: bool, **kwargs):
    lens, t, b, hk, hv, dk, dv, chunk, snaps = CASES[case_idx]
    rng = np.random.default_rng(case_idx)
    case = ragged_case(rng, lens, num_tokens=t, num_seqs=b, snapshots=snaps,
                       zero_init=zero_init)
    x = gdr_inputs(rng, case, hk, hv, dk, dv)
    for name in ("q", "k", "v"):
        x[name] = jnp.asarray(x[name], dtype)

    def args():  # fresh arrays: the pool is donated
        return [jnp.asarray(x[n]) for n in ("q", "k", "v", "g", "beta", "ssm_pool")] + [
            jnp.asarray(a) for a in slot_args(case)]

    o_ref, pool_ref = gdr_ref.gated_delta_rule_extend_reference(*args())
    o, pool = gdr.gated_delta_rule_extend(*args(), chunk_size=chunk, interpret=INTERPRET,
                                          **kwargs)
    return o, pool, o_ref, pool_ref


SLOW = pytest.mark.slow


@pytest.mark.parametrize("case_idx,dtype,zero_init", [
    (0, "float32", False), (2, "bfloat16", False), (3, "float32", True),
    pytest.param(1, "float32", True, marks=SLOW), pytest.param(0, "bfloat16", True, marks=SLOW),
    pytest.param(2, "float32", False, marks=SLOW), pytest.param(3, "bfloat16", False, marks=SLOW),
])
def test_gdr_extend_kernel_matches_reference(case_idx, dtype, zero_init):
    o, pool, o_ref, pool_ref = _run(case_idx, dtype, zero_init)
    atol, rtol = TOL[dtype]
    assert o.dtype == jnp.dtype(dtype)
    np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(o_ref, np.float32),
                               atol=atol, rtol=rtol)
    np.testing.assert_allclose(np.asarray(pool), np.asarray(pool_ref), atol=1e-4, rtol=1e-4)
    assert not np.any(np.asarray(pool)[0])


def test_gdr_extend_two_chunks_per_step_carries_state_across_steps():
    """Case 0 at two chunks per grid step: the 19-token sequence's three chunks of 8 span two
    steps (its state crosses the step boundary in scratch), sequences start mid-step, and its
    snapshots fall in both steps."""
    o, pool, o_ref, pool_ref = _run(0, "float32", False, chunks_per_step=2)
    np.testing.assert_allclose(np.asarray(o), np.asarray(o_ref), atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(pool), np.asarray(pool_ref), atol=1e-4, rtol=1e-4)


def test_gdr_extend_rejects_odd_chunks_per_step():
    with pytest.raises(ValueError, match="chunks_per_step 3"):
        _run(1, "float32", True, chunks_per_step=3)


@pytest.mark.parametrize("decay", [0.01, 0.0])
def test_gdr_extend_correlated_keys_chunk64(decay):
    """Nearly parallel keys and slow decay: L has entries near 1, where a doubling inverse over
    the whole chunk cancels catastrophically (errors ~1e3 measured); chunk 64 exercises every
    level of the blocked inverse, snapshots inside and at chunk boundaries."""
    rng = np.random.default_rng(3)
    case = ragged_case(rng, [70, 33], num_tokens=112, num_seqs=3,
                       snapshots=[(0, 1), (0, 62), (0, 64), (1, 17)])
    x = gdr_inputs(rng, case, 2, 2, 16, 16)
    x["k"] = (x["k"][:1] + 0.05 * x["k"]).astype(np.float32)
    x["g"] = (x["g"] * decay).astype(np.float32)

    def args():
        return [jnp.asarray(x[n]) for n in ("q", "k", "v", "g", "beta", "ssm_pool")] + [
            jnp.asarray(a) for a in slot_args(case)]

    o_ref, pool_ref = gdr_ref.gated_delta_rule_extend_reference(*args())
    o, pool = gdr.gated_delta_rule_extend(*args(), chunk_size=64, interpret=INTERPRET)
    np.testing.assert_allclose(np.asarray(o), np.asarray(o_ref), atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(pool), np.asarray(pool_ref), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("hk,hv,dk,dv,dtype", [(1, 2, 16, 8, "float32"),
                                                (2, 4, 32, 16, "bfloat16")])
def test_gdr_decode_kernel_matches_reference(hk, hv, dk, dv, dtype):
    rng = np.random.default_rng(hv)
    case = ragged_case(rng, [1, 1, 1], num_tokens=4, num_seqs=4)
    x = gdr_inputs(rng, case, hk, hv, dk, dv)

    def args():
        arrs = [jnp.asarray(x[n], dtype if n in "qkv" else None)
                for n in ("q", "k", "v", "g", "beta", "ssm_pool")]
        return arrs + [jnp.asarray(case.read_slot), jnp.asarray(case.write_slot)]

    o_ref, pool_ref = gdr_ref.gated_delta_rule_decode_reference(*args())
    o, pool = gated_delta_rule_decode(*args(), interpret=INTERPRET)
    atol, rtol = TOL[dtype]
    np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(o_ref, np.float32),
                               atol=atol, rtol=rtol)
    np.testing.assert_allclose(np.asarray(pool), np.asarray(pool_ref), atol=1e-5, rtol=1e-5)


def test_gdr_ops_pallas_matches_reference():
    rng = np.random.default_rng(7)
    case = ragged_case(rng, [6, 10], num_tokens=16, num_seqs=2, snapshots=[(1, 4)])
    x = gdr_inputs(rng, case, 1, 2, 8, 8)
    args = [x[n] for n in ("q", "k", "v", "g", "beta", "ssm_pool")] + list(slot_args(case))
    o_p, pool_p = ops.gated_delta_rule_extend(*args, impl="pallas")
    o_r, pool_r = ops.gated_delta_rule_extend(*args, impl="reference")
    np.testing.assert_allclose(np.asarray(o_p), np.asarray(o_r), atol=1e-4)
    np.testing.assert_allclose(np.asarray(pool_p), np.asarray(pool_r), atol=1e-4)


def test_gdr_extend_rejects_bad_shapes():
    rng = np.random.default_rng(0)
    case = ragged_case(rng, [4], num_tokens=8, num_seqs=1)
    x = gdr_inputs(rng, case, 2, 3, 8, 8)  # 3 value heads over 2 key heads
    args = [jnp.asarray(x[n]) for n in ("q", "k", "v", "g", "beta", "ssm_pool")]
    with pytest.raises(ValueError, match="heads a multiple of 2"):
        gdr.gated_delta_rule_extend(*args, *map(jnp.asarray, slot_args(case)), interpret=True)
