"""GPU (Pallas Triton) Mamba2 SSD prefill: interpreted against the reference on CPU
(``PALLAS_INTERPRET=0`` compiles it, on a GPU), snapshots at every offset of every request, and
lowered for CUDA (Pallas -> Triton IR) with ``jax.export`` from this CPU machine.

Tolerances (``|err| <= atol + rtol |ref|``): f32 inputs 2e-5 interpreted (exact fp32 dots,
reordered sums); compiled, the products are 3-pass tf32 (about fp32: 1e-4). bf16 inputs feed
the tensor cores as they are: outputs are bf16 (one ulp is 2^-8 relative) and take the chunk
start state and the decay-weighted scores rounded to bf16 (as mamba_ssm), so 2e-2; states are
f32 and the f32 operands of their products are split into two bf16 terms (~2^-16 relative),
so 1e-4 (measured 6.5e-6).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels._common import interpret_default
from pallas_kernels.aot.gpu import sm90_target
from pallas_kernels.gpu import ssd as gssd
from pallas_kernels.reference.ssd import ssd_extend_reference
from pallas_kernels.testing import ragged_case, slot_args

INTERPRET = interpret_default("gpu")
Y_TOL = {"float32": 2e-5 if INTERPRET else 1e-4, "bfloat16": 2e-2}
STATE_TOL = {"float32": 2e-5 if INTERPRET else 1e-4, "bfloat16": 1e-4}
NAMES = ("x", "dt", "a", "b", "c", "d", "ssm_pool")

# (lens, T, B, H, G, N, P, chunk; None: the wrapper's default). Every case snapshots every
# offset of every request.
CASES = {
    "ragged16": ((37, 0, 21, 5), 72, 5, 4, 2, 16, 8, 16),
    "long64": ((70, 9), 88, 2, 2, 1, 16, 16, 64),
    "odd_dims32": ((33, 1), 40, 3, 3, 3, 24, 40, 32),
    "default_chunk": ((140, 3), 150, 2, 2, 1, 16, 16, None),  # bf16 128, f32 64
}


def _build(rng, lens, t, b, h, g, n, p, snaps):
    case = ragged_case(rng, lens, num_tokens=t, num_seqs=b, snapshots=snaps)
    # kernels read a sequence's initial state at its first chunk: no read slot may be written
    written = set(case.write_slot.tolist()) | set(case.snap_slot.tolist()) | {0}
    free = np.array([s for s in range(case.num_slots) if s not in written])
    read = np.where(np.arange(b) < len(lens), rng.choice(free, b), 0).astype(np.int32)
    case = dataclasses.replace(case, read_slot=read)
    pool = rng.normal(0, 0.5, (case.num_slots, h, n, p)).astype(np.float32)
    pool[0] = 0.0
    x = dict(x=rng.normal(0, 1, (t, h, p)), dt=rng.uniform(0.01, 0.6, (t, h)),
             a=-rng.uniform(0.5, 4.0, h), b=rng.normal(0, 1, (t, g, n)),
             c=rng.normal(0, 1, (t, g, n)), d=rng.normal(1, 0.5, h), ssm_pool=pool)
    return case, {k: v.astype(np.float32) for k, v in x.items()}


def _case(name: str):
    lens, t, b, h, g, n, p, chunk = CASES[name]
    snaps = [(i, off) for i, k in enumerate(lens) for off in range(k + 1)]
    return *_build(np.random.default_rng(len(name)), lens, t, b, h, g, n, p, snaps), chunk


def _args(x: dict, case, dtype: str) -> list:
    """Fresh device arrays (the pool is donated); x, B, C in ``dtype``."""
    arrs = [jnp.asarray(x[k], dtype if k in "xbc" else None) for k in NAMES]
    return arrs + [jnp.asarray(s) for s in slot_args(case)]


@functools.cache
def _reference(name: str, dtype: str):
    case, x, _ = _case(name)
    y, pool = jax.jit(ssd_extend_reference)(*_args(x, case, dtype))
    return np.asarray(y, np.float32), np.asarray(pool)


@pytest.mark.parametrize("name,dtype", [(n, d) for n in CASES for d in ("float32", "bfloat16")
                                        if (n, d) != ("default_chunk", "float32")])  # = long64
def test_gpu_ssd_extend_matches_reference_every_offset(name, dtype):
    case, x, chunk = _case(name)
    y, pool = gssd.ssd_extend(*_args(x, case, dtype), chunk_size=chunk, interpret=INTERPRET)
    y_ref, pool_ref = _reference(name, dtype)
    assert y.dtype == jnp.dtype(dtype) and y.shape == y_ref.shape
    tol = Y_TOL[dtype]
    np.testing.assert_allclose(np.asarray(y, np.float32), y_ref, atol=tol, rtol=tol)
    np.testing.assert_allclose(np.asarray(pool), pool_ref, atol=STATE_TOL[dtype],
                               rtol=STATE_TOL[dtype])
    assert not np.any(np.asarray(pool)[0])
    assert not np.any(np.asarray(y, np.float32)[sum(case.lens):])  # padding tokens


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(6))
def test_gpu_ssd_extend_random_layouts(seed):
    """Random lengths (empty included), padding, snapshots anywhere, chunk 16 or 32, random
    heads per group and odd N / P; bf16 for odd seeds."""
    rng = np.random.default_rng(200 + seed)
    b = int(rng.integers(1, 6))
    lens = [int(k) for k in rng.integers(0, 45, size=b)]
    t = max(sum(lens) + int(rng.integers(0, 9)), 1)
    snaps = [(int(i), int(rng.integers(0, lens[i] + 1)))
             for i in rng.integers(0, b, size=int(rng.integers(1, 9)))]
    g = int(rng.integers(1, 3))
    h, n, p = g * int(rng.integers(1, 3)), int(rng.choice([16, 24])), int(rng.choice([8, 40]))
    case, x = _build(rng, lens, t, b + 1, h, g, n, p, snaps)
    dtype = "bfloat16" if seed % 2 else "float32"
    y_ref, pool_ref = jax.jit(ssd_extend_reference)(*_args(x, case, dtype))
    y, pool = gssd.ssd_extend(*_args(x, case, dtype), chunk_size=int(rng.choice([16, 32])),
                              interpret=INTERPRET)
    tol = Y_TOL[dtype]
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(y_ref, np.float32),
                               atol=tol, rtol=tol)
    np.testing.assert_allclose(np.asarray(pool), np.asarray(pool_ref), atol=STATE_TOL[dtype],
                               rtol=STATE_TOL[dtype])


def test_gpu_ssd_extend_rejects_bad_chunk():
    case, x, _ = _case("ragged16")
    with pytest.raises(ValueError, match="power of two >= 16"):
        gssd.ssd_extend(*_args(x, case, "float32"), chunk_size=24, interpret=True)


TRITON = "__gpu$xla.gpu.triton"


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("h,g,n,p,chunk", [(8, 2, 128, 64, 64), (3, 1, 24, 40, 16)])
def test_gpu_ssd_extend_lowers_for_cuda(dtype, h, g, n, p, chunk):
    """Pallas -> Triton IR for CUDA; the state pass aliases the pool (its operand 9) to its
    output 1 and, for f32 inputs, the chunk states (operand 8) to output 0 (narrow inputs
    write the start states to a new input-dtype array); the target kernel updates the pool
    (its operand 9) in place."""
    t, b, s, slots = 200, 3, 5, 7
    sd, i32 = jax.ShapeDtypeStruct, jnp.int32
    args = (sd((t, h, p), dtype), sd((t, h), jnp.float32), sd((h,), jnp.float32),
            sd((t, g, n), dtype), sd((t, g, n), dtype), sd((h,), jnp.float32),
            sd((slots, h, n, p), jnp.float32), sd((b + 1,), i32), sd((b,), i32), sd((b,), i32),
            sd((s,), i32), sd((s,), i32), sd((s,), i32))
    f = functools.partial(gssd.ssd_extend, chunk_size=chunk, interpret=False)
    with sm90_target():
        exported = jax.export.export(
            jax.jit(f), platforms=["cuda"],
            disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON)])(*args)
    module = exported.mlir_module()
    assert module.count(TRITON) >= 5
    assert "output_tuple_indices = [1], operand_index = 9," in module
    assert ("output_tuple_indices = [0], operand_index = 8," in module) == (dtype == jnp.float32)
    assert "output_tuple_indices = [], operand_index = 9," in module
