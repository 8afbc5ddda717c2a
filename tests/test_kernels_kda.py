"""KDA (per-channel decay delta rule): the chunked form and the Pallas kernels (TPU and GPU
families, interpreted on CPU) against the token-scan reference, with finals and snapshots at any
offset of ragged sequences; decode; strong decays that overflow a naive factorisation.

Interpreted unless on the family's own backend (``PALLAS_INTERPRET``; scripts/gpu_check.sh runs the
GPU ones compiled). Tolerances: fp32 outputs and states 1e-4 (chunked sums reorder fp32; measured
~1e-6); bf16 inputs give bf16 outputs at 2e-2 (a bf16 ulp is 2^-8 relative), fp32 states at 1e-4.
The GPU prefill with its tensor-core (tf32) roundings emulated: fp32 outputs and states 1e-5.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import kda_chunk, ops
from pallas_kernels._common import interpret_default
from pallas_kernels.reference import kda as kda_ref
from pallas_kernels.testing import gdr_inputs, ragged_case, slot_args
from pallas_kernels.tpu import kda as tpu_kda

_exact_dot = kda_chunk.dot


def _interpret(family: str) -> bool:
    """A family compiles only on its own backend: under ``PALLAS_INTERPRET=0`` on an H200 the
    TPU family's Mosaic kernels failed inside Pallas's GPU lowering (``assert rule is not
    None``), so the other family stays interpreted; on its own ``interpret_default`` decides."""
    return jax.default_backend() != family or interpret_default(family)
_HI = (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST)

# (lens, T, B, H, Dk, Dv, chunk, snapshots); chunk 16 puts boundaries at 16, 32, ...
CASES = [
    ([5, 1, 37, 16], 64, 5, 2, 16, 8, 16,
     [(0, 0), (0, 1), (2, 16), (2, 17), (2, 32), (2, 36), (2, 37), (3, 16), (1, 1), (2, 0)]),
    ([0, 41, 0], 48, 4, 1, 8, 16, 32, [(1, 16), (1, 31), (1, 40), (0, 0)]),
]
TOL = {"float32": 1e-4, "bfloat16": 2e-2}


def kda_inputs(case_idx: int, dtype: str, decay_scale: float = 1.0):
    lens, t, b, h, dk, dv, chunk, snaps = CASES[case_idx]
    rng = np.random.default_rng(case_idx)
    case = ragged_case(rng, lens, num_tokens=t, num_seqs=b, snapshots=snaps)
    x = gdr_inputs(rng, case, h, h, dk, dv)
    x["g"] = (np.log(rng.uniform(0.3, 1.0, size=(t, h, dk))) * decay_scale).astype(np.float32)
    for name in ("q", "k", "v"):
        x[name] = np.asarray(jnp.asarray(x[name], dtype))
    return case, x, chunk


def args(case, x):  # fresh arrays: the pool is donated
    return [jnp.asarray(x[n]) for n in ("q", "k", "v", "g", "beta", "ssm_pool")] + [
        jnp.asarray(a) for a in slot_args(case)]


def assert_close(got, want, tol):
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               atol=tol, rtol=tol)


@pytest.mark.parametrize("case_idx", [0, 1])
def test_reference_equals_float64_loop(case_idx):
    """The token scan against a float64 per-token numpy loop (``gdr_oracle``, per-channel
    decay) at every final and snapshot target, including offsets 0 and the full length."""
    from tests.test_ops_reference import gdr_oracle
    case, x, _ = kda_inputs(case_idx, "float32")
    o, pool = kda_ref.kda_extend_reference(*args(case, x))
    o_ref, pool_ref = gdr_oracle(*(np.asarray(a) for a in args(case, x)))
    n = int(case.cu_seqlens[-1])
    assert_close(np.asarray(o)[:n], o_ref[:n], 1e-5)
    assert_close(pool, pool_ref, 1e-5)


def test_chunk_form_equals_token_scan():
    """One sequence, strong decays (log-decay down to -48 a token, -1000s in a chunk)."""
    case, x, _ = kda_inputs(1, "float32", decay_scale=40.0)
    start, n = int(case.cu_seqlens[1]), case.lens[1]
    sl = slice(start, start + n)
    init = x["ssm_pool"][case.read_slot[1]]
    o, final, _ = kda_ref.kda_chunk_reference(*(jnp.asarray(x[k][sl]) for k in
                                                ("q", "k", "v", "g", "beta")),
                                              jnp.asarray(init), chunk_size=16)
    assert np.isfinite(np.asarray(o)).all()
    o_ref, pool = kda_ref.kda_extend_reference(*args(case, x))
    assert_close(o, np.asarray(o_ref)[sl], 1e-4)
    assert_close(final, np.asarray(pool)[case.write_slot[1]], 1e-4)


@pytest.mark.parametrize("family", ["tpu", "gpu"])
@pytest.mark.parametrize("case_idx,dtype,decay", [(0, "float32", 1.0), (1, "bfloat16", 1.0),
                                                  (1, "float32", 40.0)])  # ~20 s each on CPU
def test_extend_kernel_equals_reference(family, case_idx, dtype, decay):
    case, x, chunk = kda_inputs(case_idx, dtype, decay)
    o_ref, pool_ref = kda_ref.kda_extend_reference(*args(case, x))
    fn = tpu_kda.kda_extend if family == "tpu" else _gpu().kda_extend
    o, pool = fn(*args(case, x), chunk_size=chunk, interpret=_interpret(family))
    assert np.isfinite(np.asarray(o, np.float32)).all()
    assert_close(o, o_ref, TOL[dtype])
    assert_close(pool, pool_ref, 1e-4)  # every target (finals, snapshots) and untouched slots


@pytest.mark.parametrize("family", ["tpu", "gpu"])
def test_decode_kernel_equals_reference(family):
    rng = np.random.default_rng(7)
    b, h, dk, dv, n = 3, 2, 16, 8, 6
    q, k = (jnp.asarray(rng.normal(size=(b, h, dk)), jnp.float32) for _ in range(2))
    v = jnp.asarray(rng.normal(size=(b, h, dv)), jnp.float32)
    g = jnp.asarray(np.log(rng.uniform(0.3, 1.0, size=(b, h, dk))), jnp.float32)
    beta = jnp.asarray(rng.uniform(0.1, 0.9, size=(b, h)), jnp.float32)
    pool = rng.normal(size=(n, h, dk, dv)).astype(np.float32)
    pool[0] = 0
    read, write = jnp.asarray([2, 0, 1], jnp.int32), jnp.asarray([3, 4, 0], jnp.int32)
    o_ref, p_ref = kda_ref.kda_decode_reference(q, k, v, g, beta, jnp.asarray(pool), read, write)
    fn = tpu_kda.kda_decode if family == "tpu" else _gpu_decode()
    o, p = fn(q, k, v, g, beta, jnp.asarray(pool), read, write,
              interpret=_interpret(family))
    assert_close(o, o_ref, 1e-5)
    assert_close(p, p_ref, 1e-5)


def test_ops_dispatch_and_shape_errors():
    case, x, _ = kda_inputs(0, "float32")
    o_ref, _ = ops.kda_extend(*args(case, x), impl="reference")
    o, _ = ops.kda_extend(*args(case, x), impl="pallas")
    assert_close(o, o_ref, 1e-4)
    bad = args(case, x)
    bad[3] = bad[3][..., 0]  # a per-head decay is the gated delta rule, not KDA
    with pytest.raises(ValueError, match="g"):
        ops.kda_extend(*bad, impl="reference")


def _tf32(x):
    """Round f32 to tf32 (10 mantissa bits, to nearest): a tensor-core operand."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    bits = (bits + jnp.uint32(0x1000)) & jnp.uint32(0xFFFFE000)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _tf32_dot(passes: int):
    """``gpu/kda._dot`` with tensor-core roundings: 1-pass tf32 for ``TF32_DOT`` (None), and the
    ``F32_DOT`` products (exact fp32 when interpreted) as ``passes`` tf32 passes (3: hi/lo)."""
    def dot(a, b, precision=None, *, trans_a=False, trans_b=False):
        ah, bh = _tf32(a), _tf32(b)
        terms = [(ah, bh)]
        if precision is not None and passes == 3:
            terms += [(ah, _tf32(b - bh)), (_tf32(a - ah), bh)]
        return sum(_exact_dot(x, y, trans_a=trans_a, trans_b=trans_b, precision=_HI)
                   for x, y in terms)
    return dot


def _gram_dot(passes: int):
    """``kda_chunk.dot`` likewise: None (1-pass tf32) rounded, HIGHEST exact."""
    def dot(a, b, *, trans_a=False, trans_b=False, precision=None):
        if precision is None:
            return _tf32_dot(passes)(a, b, None, trans_a=trans_a, trans_b=trans_b)
        return _exact_dot(a, b, trans_a=trans_a, trans_b=trans_b, precision=precision)
    return dot


@pytest.mark.parametrize("passes", [3, 1])
def test_gpu_extend_with_tf32_roundings_emulated(passes, monkeypatch):
    """The GPU prefill (interpreted) with its tensor-core roundings emulated: 3-pass W, U and
    state products keep fp32 outputs and the states within 1e-5 (measured 3e-7); the control, 1
    pass, misses the 1e-4 state tolerance (measured 4.8e-4). A and the inverse stay exact, as
    on the GPU (IEEE fp32); M's 3-pass products (``kda_chunk.dot`` at HIGHEST) too."""
    gk = _gpu()
    monkeypatch.setattr(gk, "_dot", _tf32_dot(passes))
    monkeypatch.setattr(kda_chunk, "dot", _gram_dot(passes))
    case, x, chunk = kda_inputs(0, "float32")
    o_ref, pool_ref = kda_ref.kda_extend_reference(*args(case, x))
    gk.kda_extend.clear_cache()  # trace with the emulated products, and drop that trace after
    try:
        o, pool = gk.kda_extend(*args(case, x), chunk_size=chunk, interpret=True)
    finally:
        gk.kda_extend.clear_cache()
    err = float(np.abs(np.asarray(pool) - np.asarray(pool_ref)).max())
    if passes == 3:
        assert_close(o, o_ref, 1e-5)
        assert err < 1e-5
    else:
        assert err > 1e-4


def _gpu():
    from pallas_kernels.gpu import kda
    return kda


def _gpu_decode():
    from pallas_kernels.gpu.kda_decode import kda_decode
    return kda_decode
