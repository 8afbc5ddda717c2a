"""GPU (Pallas Triton) gated delta rule kernels: interpreted against the references on CPU
(``PALLAS_INTERPRET=0`` compiles them, on a GPU), and lowered for CUDA (Pallas -> Triton IR)
with ``jax.export`` from this CPU machine.

Tolerances as ``tests/test_kernels_gdr.py``: fp32 outputs and states 1e-4 (the chunked form
reorders fp32 sums); bf16 inputs give bf16 outputs compared at 2e-2 (one bf16 ulp is 2^-8
relative), states (fp32 from the same bf16 inputs) at 1e-4.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels._common import interpret_default
from pallas_kernels.aot.gpu import sm90_target
from pallas_kernels.gpu import gated_delta_rule as ggdr
from pallas_kernels.gpu.gated_delta_rule_decode import gated_delta_rule_decode
from pallas_kernels.reference import gated_delta_rule as gdr_ref
from pallas_kernels.testing import gdr_inputs, ragged_case, slot_args

INTERPRET = interpret_default("gpu")
TOL = {"float32": (1e-4, 1e-4), "bfloat16": (2e-2, 2e-2)}
# fp32 inputs: the prefill's products are exact fp32 interpreted and 3-pass tf32 compiled
# (``ggdr.F32_DOT``, about fp32), its reference's at HIGHEST: fp32 held to 1e-4 on both.
STATE_TOL = 1e-4
NAMES = ("q", "k", "v", "g", "beta", "ssm_pool")

# (lens, T, B, Hk, Hv, Dk, Dv, chunk, snapshots (seq, offset)). Offsets cover 0, 1, chunk-2,
# chunk boundaries and one past, the last token; chunk 32/64 exercise the blocked inverse.
CASES = {
    "mixed": ([5, 1, 19, 8], 40, 5, 1, 2, 16, 8, 16,
              [(0, 0), (0, 1), (2, 14), (2, 15), (2, 16), (2, 17), (2, 19), (3, 8), (1, 1),
               (2, 0)]),
    "eight_seqs": ([3, 7, 2, 1, 9, 4, 6, 11], 48, 8, 1, 4, 16, 16, 16,
                   [(1, 0), (1, 5), (4, 9), (7, 10), (7, 1), (0, 3), (4, 1)]),
    "odd_dims": ([0, 37, 0], 40, 4, 2, 4, 24, 40, 16,
                 [(1, 14), (1, 16), (1, 32), (1, 37), (0, 0), (1, 1)]),
    "blocked_inverse": ([70, 33], 112, 3, 2, 2, 16, 16, 64,
                        [(0, 1), (0, 62), (0, 64), (0, 65), (1, 33), (1, 17), (0, 70)]),
    "chunk32": ([45], 48, 1, 1, 1, 32, 32, 32, [(0, 30), (0, 32), (0, 44)]),
}


def _args(x: dict, case, dtype: str) -> list:
    """Fresh device arrays (the pool is donated), q, k, v in ``dtype``."""
    arrs = [jnp.asarray(x[n], dtype if n in ("q", "k", "v") else None) for n in NAMES]
    return arrs + [jnp.asarray(a) for a in slot_args(case)]


def _extend_case(name: str, dtype: str, zero_init: bool, correlated: bool = False):
    lens, t, b, hk, hv, dk, dv, chunk, snaps = CASES[name]
    rng = np.random.default_rng(len(name))
    case = ragged_case(rng, lens, num_tokens=t, num_seqs=b, snapshots=snaps,
                       zero_init=zero_init)
    x = gdr_inputs(rng, case, hk, hv, dk, dv)
    if correlated:  # nearly parallel keys and slow decay: L has entries near 1
        x["k"] = (x["k"][:1] + 0.05 * x["k"]).astype(np.float32)
        x["g"] = (x["g"] * 0.01).astype(np.float32)
    o_ref, pool_ref = gdr_ref.gated_delta_rule_extend_reference(*_args(x, case, dtype))
    o, pool = ggdr.gated_delta_rule_extend(*_args(x, case, dtype), chunk_size=chunk,
                                           interpret=INTERPRET)
    return o, pool, o_ref, pool_ref


def _assert_close(o, pool, o_ref, pool_ref, dtype):
    atol, rtol = TOL[dtype]
    assert o.dtype == jnp.dtype(dtype) and o.shape == o_ref.shape
    np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(o_ref, np.float32),
                               atol=atol, rtol=rtol)
    np.testing.assert_allclose(np.asarray(pool), np.asarray(pool_ref), atol=STATE_TOL,
                               rtol=STATE_TOL)
    assert not np.any(np.asarray(pool)[0])


# fp32 mixed / odd_dims take ~40 s each interpreted on 2 cores: slow (bf16 keeps them in CI)
@pytest.mark.parametrize("name,dtype,zero_init", [
    pytest.param(n, d, z, marks=[pytest.mark.slow] if d == "float32" and n in ("mixed", "odd_dims")
                 else [])
    for d, z in [("float32", False), ("bfloat16", True)] for n in CASES])
def test_gpu_gdr_extend_matches_reference(name, dtype, zero_init):
    _assert_close(*_extend_case(name, dtype, zero_init), dtype)


@pytest.mark.parametrize("name", ["blocked_inverse", "odd_dims"])
def test_gpu_gdr_extend_correlated_keys(name):
    _assert_close(*_extend_case(name, "float32", False, correlated=True), "float32")


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("dtype,zero_init", [("float32", True), ("bfloat16", False)])
def test_gpu_gdr_extend_matches_reference_more(name, dtype, zero_init):
    _assert_close(*_extend_case(name, dtype, zero_init), dtype)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(6))
def test_gpu_gdr_extend_random_layouts(seed):
    """Random lengths (empty included), snapshots anywhere, chunk 16 or 32, random heads."""
    rng = np.random.default_rng(100 + seed)
    num_seqs = int(rng.integers(1, 7))
    lens = [int(n) for n in rng.integers(0, 40, size=num_seqs)]
    t = sum(lens) + int(rng.integers(0, 9))
    snaps = [(int(b), int(rng.integers(0, lens[b] + 1)))
             for b in rng.integers(0, num_seqs, size=int(rng.integers(1, 9)))]
    case = ragged_case(rng, lens, num_tokens=max(t, 1), num_seqs=num_seqs + 1,
                       snapshots=snaps, zero_init=bool(seed % 2))
    hk, group = int(rng.integers(1, 3)), int(rng.integers(1, 3))
    x = gdr_inputs(rng, case, hk, hk * group, int(rng.choice([16, 24])),
                   int(rng.choice([8, 16, 48])))
    o_ref, pool_ref = gdr_ref.gated_delta_rule_extend_reference(*_args(x, case, "float32"))
    o, pool = ggdr.gated_delta_rule_extend(*_args(x, case, "float32"),
                                           chunk_size=int(rng.choice([16, 32])),
                                           interpret=INTERPRET)
    _assert_close(o, pool, o_ref, pool_ref, "float32")


@pytest.mark.parametrize("hk,hv,dk,dv,dtype", [(1, 2, 16, 8, "float32"),
                                                (2, 4, 32, 80, "bfloat16"),
                                                (1, 3, 24, 16, "float32")])
def test_gpu_gdr_decode_matches_reference(hk, hv, dk, dv, dtype):
    rng = np.random.default_rng(hv + dk)
    case = ragged_case(rng, [1, 1, 1], num_tokens=4, num_seqs=4)  # seq 3 writes slot 0
    x = gdr_inputs(rng, case, hk, hv, dk, dv)

    def args():
        return _args(x, case, dtype)[:6] + [jnp.asarray(case.read_slot),
                                            jnp.asarray(case.write_slot)]

    o_ref, pool_ref = gdr_ref.gated_delta_rule_decode_reference(*args())
    o, pool = gated_delta_rule_decode(*args(), interpret=INTERPRET)
    atol, rtol = TOL[dtype]
    assert o.dtype == jnp.dtype(dtype)
    np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(o_ref, np.float32),
                               atol=atol, rtol=rtol)
    np.testing.assert_allclose(np.asarray(pool), np.asarray(pool_ref), atol=1e-5, rtol=1e-5)
    assert not np.any(np.asarray(pool)[0])


def test_gpu_gdr_extend_rejects_bad_shapes():
    rng = np.random.default_rng(0)
    case = ragged_case(rng, [4], num_tokens=8, num_seqs=1)
    x = gdr_inputs(rng, case, 2, 3, 8, 8)  # 3 value heads over 2 key heads
    with pytest.raises(ValueError, match="heads a multiple of 2"):
        ggdr.gated_delta_rule_extend(*_args(x, case, "float32"), interpret=True)
    x = gdr_inputs(rng, case, 1, 2, 8, 8)
    with pytest.raises(ValueError, match="power of two >= 16"):
        ggdr.gated_delta_rule_extend(*_args(x, case, "float32"), chunk_size=24, interpret=True)
    with pytest.raises(ValueError, match="must be \\[N, 2, 8, 8\\]"):
        gated_delta_rule_decode(*_args(x, case, "float32")[:5], jnp.zeros((3, 2, 8, 4)),
                                jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.int32),
                                interpret=True)


# Lowering for CUDA: runs the Pallas -> Triton lowering (pow2 tiles, dot sizes, dtypes).
T, B, S, N = 200, 3, 5, 7  # not powers of two: whole refs need not be
I32 = jnp.int32
TRITON = "__gpu$xla.gpu.triton"


def _sd(shape, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype)


def _export_cuda(fn, pool_operand: int, *args, pool_output: int = 1):
    """Lower for CUDA; a Triton call must alias its pool operand to output ``pool_output``."""
    with sm90_target():
        exported = jax.export.export(
            jax.jit(fn), platforms=["cuda"],
            disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON)])(*args)
    module = exported.mlir_module()
    assert TRITON in module
    assert (f"output_tuple_indices = [{pool_output}], operand_index = {pool_operand},"
            in module)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("hk,hv,dk,dv,chunk", [(2, 4, 128, 128, 64), (1, 2, 24, 40, 16)])
def test_gpu_gdr_extend_lowers_for_cuda(dtype, hk, hv, dk, dv, chunk):
    slots = (_sd((B + 1,), I32), _sd((B,), I32), _sd((B,), I32), _sd((S,), I32),
             _sd((S,), I32), _sd((S,), I32))
    f = functools.partial(ggdr.gated_delta_rule_extend, chunk_size=chunk, interpret=False)
    # the state kernel (of three launches) takes the pool as operand 10, returns it as output 2
    _export_cuda(f, 10, _sd((T, hk, dk), dtype), _sd((T, hk, dk), dtype), _sd((T, hv, dv), dtype),
                 _sd((T, hv)), _sd((T, hv)), _sd((N, hv, dk, dv)), *slots, pool_output=2)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("hk,hv,dk,dv", [(2, 4, 128, 128), (1, 3, 24, 40)])
def test_gpu_gdr_decode_lowers_for_cuda(dtype, hk, hv, dk, dv):
    f = functools.partial(gated_delta_rule_decode, interpret=False)
    _export_cuda(f, 7, _sd((B, hk, dk), dtype), _sd((B, hk, dk), dtype), _sd((B, hv, dv), dtype),
                 _sd((B, hv)), _sd((B, hv)), _sd((N, hv, dk, dv)), _sd((B,), I32),
                 _sd((B,), I32))
