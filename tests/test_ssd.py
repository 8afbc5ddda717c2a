"""Mamba2 SSD ops: the plain-jnp references against an independent numpy loop (per request,
per head, token by token), snapshots at every offset, decode == one-token extend.

Kernel families (interpreted on CPU) are checked against the references in the same cases.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from pallas_kernels import ops
from pallas_kernels.gpu import ssd as gpu_ssd
from pallas_kernels.reference import ssd as ref
from pallas_kernels.testing import ragged_case
from pallas_kernels.tpu import ssd as tpu_ssd

H, P, G, N = 4, 8, 2, 16


def ssd_inputs(rng: np.random.Generator, num_tokens: int, num_slots: int, dtype=np.float32):
    """Random x, dt (> 0), A (< 0), B, C, D and an ssm pool (slot 0 zero)."""
    pool = rng.normal(0, 0.5, (num_slots, H, N, P)).astype(np.float32)
    pool[0] = 0.0
    return dict(
        x=rng.normal(0, 1, (num_tokens, H, P)).astype(dtype),
        dt=rng.uniform(0.01, 0.6, (num_tokens, H)).astype(np.float32),
        a=-rng.uniform(0.5, 4.0, H).astype(np.float32),
        b=rng.normal(0, 1, (num_tokens, G, N)).astype(dtype),
        c=rng.normal(0, 1, (num_tokens, G, N)).astype(dtype),
        d=rng.normal(1, 0.5, H).astype(np.float32),
        ssm_pool=pool,
    )


def numpy_scan(inp, h0, start, stop):
    """States after each token ``[stop - start + 1, H, N, P]`` (row 0 = h0) and y, float64."""
    h, states, ys = h0.astype(np.float64), [h0.astype(np.float64)], []
    for t in range(start, stop):
        for head in range(H):
            grp = head // (H // G)
            dt = float(inp["dt"][t, head])
            x, b = inp["x"][t, head].astype(np.float64), inp["b"][t, grp].astype(np.float64)
            h[head] = np.exp(dt * inp["a"][head]) * h[head] + dt * np.outer(b, x)
        c = inp["c"][t].astype(np.float64)[np.arange(H) // (H // G)]
        ys.append(np.einsum("hnp,hn->hp", h, c) + inp["d"][:, None] * inp["x"][t])
        states.append(h.copy())
    return np.stack(states), np.asarray(ys).reshape(-1, H, P)


CASES = {
    "ragged": ((5, 0, 11, 1), 24, 5),
    "one_long": ((23,), 24, 2),
}


@functools.cache
def extend_fn(impl: str):
    return jax.jit(functools.partial(ops.ssd_extend, impl=impl))


@pytest.mark.parametrize("name", sorted(CASES))
def test_extend_reference_matches_numpy_with_every_offset(name):
    lens, num_tokens, num_seqs = CASES[name]
    rng = np.random.default_rng(0)
    snaps = [(i, off) for i, n in enumerate(lens) for off in range(n + 1)]
    case = ragged_case(rng, lens, num_tokens=num_tokens, num_seqs=num_seqs, snapshots=snaps)
    inp = ssd_inputs(rng, num_tokens, case.num_slots)
    y, pool = extend_fn("reference")(
        **inp, cu_seqlens=case.cu_seqlens, read_slot=case.read_slot,
        write_slot=case.write_slot, snap_seq=case.snap_seq, snap_offset=case.snap_offset,
        snap_slot=case.snap_slot)
    y, pool = np.asarray(y), np.asarray(pool)
    for i, n in enumerate(lens):
        s = case.cu_seqlens[i]
        states, ys = numpy_scan(inp, inp["ssm_pool"][case.read_slot[i]], s, s + n)
        np.testing.assert_allclose(y[s:s + n], ys, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(pool[case.write_slot[i]], states[-1], rtol=1e-5, atol=1e-5)
        for j in np.flatnonzero(case.snap_seq[:len(snaps)] == i):
            np.testing.assert_allclose(pool[case.snap_slot[j]], states[case.snap_offset[j]],
                                       rtol=1e-5, atol=1e-5)
    assert np.all(y[sum(lens):] == 0)  # padding rows
    assert np.all(pool[0] == 0)        # slot 0 never written


def test_decode_equals_one_token_extend():
    rng = np.random.default_rng(1)
    case = ragged_case(rng, (1, 1, 1), num_tokens=3, num_seqs=3)
    inp = ssd_inputs(rng, 3, case.num_slots)
    y1, pool1 = ops.ssd_decode(**inp, read_slot=case.read_slot, write_slot=case.write_slot,
                               impl="reference")
    y2, pool2 = extend_fn("reference")(
        **inp, cu_seqlens=case.cu_seqlens, read_slot=case.read_slot,
        write_slot=case.write_slot, snap_seq=case.snap_seq, snap_offset=case.snap_offset,
        snap_slot=case.snap_slot)
    np.testing.assert_allclose(np.asarray(y1), np.asarray(y2), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(pool1), np.asarray(pool2), rtol=1e-6, atol=1e-6)


def test_shape_errors_name_the_shapes():
    rng = np.random.default_rng(2)
    inp = ssd_inputs(rng, 4, 3)
    inp["dt"] = inp["dt"][:, :3]
    with pytest.raises(ValueError, match=r"dt shape \(4, 3\) must be \(4, 4\)"):
        ref.check_ssd(**inp)
    inp = ssd_inputs(rng, 4, 3)
    inp["b"] = inp["b"][:, :, :5]
    with pytest.raises(ValueError, match="C shape"):
        ref.check_ssd(**inp)


FAMILIES = {"tpu": tpu_ssd, "gpu": gpu_ssd}


@pytest.mark.parametrize("family", ["tpu", "gpu"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_kernel_extend_equals_reference_snapshot_at_every_offset(family, name):
    """Interpreted kernel == reference: outputs, finals and a snapshot at every offset of every
    request (chunks of 8 / 16: offsets inside chunks, on boundaries, 0 and the full length)."""
    mod = FAMILIES[family]
    lens, num_tokens, num_seqs = CASES[name]
    rng = np.random.default_rng(4)
    snaps = [(i, off) for i, n in enumerate(lens) for off in range(n + 1)]
    case = ragged_case(rng, lens, num_tokens=num_tokens, num_seqs=num_seqs, snapshots=snaps)
    inp = ssd_inputs(rng, num_tokens, case.num_slots)
    idx = dict(cu_seqlens=case.cu_seqlens, read_slot=case.read_slot, write_slot=case.write_slot,
               snap_seq=case.snap_seq, snap_offset=case.snap_offset, snap_slot=case.snap_slot)
    y_ref, pool_ref = extend_fn("reference")(**inp, **idx)
    chunk = 8 if family == "tpu" else 16  # Triton tiles: powers of two >= 16
    y, pool = mod.ssd_extend(**inp, **idx, chunk_size=chunk, interpret=True)
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(pool), np.asarray(pool_ref), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("family", ["tpu", "gpu"])
def test_kernel_decode_equals_reference(family):
    mod = FAMILIES[family]
    rng = np.random.default_rng(5)
    case = ragged_case(rng, (1, 1, 1), num_tokens=4, num_seqs=4)  # one padding row (slot 0)
    inp = ssd_inputs(rng, 4, case.num_slots)
    y_ref, pool_ref = ops.ssd_decode(**inp, read_slot=case.read_slot,
                                     write_slot=case.write_slot, impl="reference")
    extra = {"head_block": 2} if family == "tpu" else {}  # two head blocks per sequence
    y, pool = mod.ssd_decode(**inp, read_slot=case.read_slot, write_slot=case.write_slot,
                             interpret=True, **extra)
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(pool), np.asarray(pool_ref), rtol=1e-5, atol=1e-5)
