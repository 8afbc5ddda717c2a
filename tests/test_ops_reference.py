"""The plain-jnp references of pallas_kernels against dead-simple numpy per-token loops."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import ops
from pallas_kernels.testing import gdr_inputs, ragged_case, slot_args


def _l2n(x):
    return x / np.sqrt(np.sum(x * x, -1, keepdims=True) + 1e-6)


def gdr_oracle(q, k, v, g, beta, pool, cu, read, write, snap_seq, snap_off, snap_slot):
    """Per-sequence, per-token loop in float64. Returns (o, pool)."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    pool = np.array(pool, np.float64)
    out_pool = pool.copy()
    o = np.zeros(v.shape)
    hv, dk = v.shape[1], q.shape[2]
    grp = hv // q.shape[1]
    states = {}
    for b in range(len(read)):
        s = pool[read[b]].copy()
        states[b, 0] = s.copy()
        for i, t in enumerate(range(cu[b], cu[b + 1])):
            for h in range(hv):
                qt = _l2n(q[t, h // grp]) * dk ** -0.5
                kt = _l2n(k[t, h // grp])
                decay = np.exp(g[t, h])  # one per head, or one per key channel (KDA)
                s[h] *= decay[:, None] if np.ndim(decay) else decay
                u = beta[t, h] * (v[t, h] - s[h].T @ kt)
                s[h] += np.outer(kt, u)
                o[t, h] = s[h].T @ qt
            states[b, i + 1] = s.copy()
    for b in range(len(read)):
        if write[b]:
            out_pool[write[b]] = states[b, cu[b + 1] - cu[b]]
    for b, off, slot in zip(snap_seq, snap_off, snap_slot, strict=True):
        if slot:
            out_pool[slot] = states[b, off]
    return o, out_pool


def conv_oracle(x, w, bias, pool, cu, read, write, snap_seq, snap_off, snap_slot):
    x = np.asarray(x, np.float64)
    kw = w.shape[0]
    out_pool = np.array(pool, np.float64)
    y = np.zeros(x.shape)
    seqs = {}
    for b in range(len(read)):
        full = np.concatenate([np.asarray(pool[read[b]], np.float64), x[cu[b]:cu[b + 1]]])
        seqs[b] = full
        for i in range(cu[b + 1] - cu[b]):
            acc = (bias if bias is not None else 0.0) + np.sum(w * full[i:i + kw], 0)
            y[cu[b] + i] = acc / (1 + np.exp(-acc))
    for b in range(len(read)):
        n = cu[b + 1] - cu[b]
        if write[b]:
            out_pool[write[b]] = seqs[b][n:n + kw - 1]
    for b, off, slot in zip(snap_seq, snap_off, snap_slot, strict=True):
        if slot:
            out_pool[slot] = seqs[b][off:off + kw - 1]
    return y, out_pool


def attn_oracle(q, kp, vp, cu, seq_lens, table, scale):
    ps, hkv = kp.shape[1], kp.shape[2]
    grp = q.shape[1] // hkv
    o = np.zeros(q.shape)
    for b in range(len(seq_lens)):
        n = cu[b + 1] - cu[b]
        for i in range(n):
            pos = seq_lens[b] - n + i
            ks = np.stack([kp[table[b, p // ps], p % ps] for p in range(pos + 1)])
            vs = np.stack([vp[table[b, p // ps], p % ps] for p in range(pos + 1)])
            for h in range(q.shape[1]):
                s = ks[:, h // grp] @ q[cu[b] + i, h] * scale
                w = np.exp(s - s.max())
                o[cu[b] + i, h] = (w / w.sum()) @ vs[:, h // grp]
    return o


_gdr_ref = jax.jit(lambda *a: ops.gated_delta_rule_extend(*a, impl="reference"))
_conv_ref = jax.jit(lambda *a: ops.causal_conv1d_extend(*a, impl="reference"))

GDR_CASES = [  # (lens, T, B, Hk, Hv, snapshots)
    ([5, 1, 9], 16, 4, 1, 2, [(0, 0), (0, 1), (2, 7), (2, 4), (2, 9), (1, 1)]),
    ([13], 16, 1, 2, 2, [(0, 3), (0, 12), (0, 13)]),
    ([3, 7, 2, 1], 16, 5, 1, 4, [(1, 0), (1, 5), (3, 1), (0, 2), (1, 5)]),
]


@pytest.mark.parametrize("zero_init", [False, True])
@pytest.mark.parametrize("lens,T,B,hk,hv,snaps", GDR_CASES)
def test_gdr_extend_reference(lens, T, B, hk, hv, snaps, zero_init):
    rng = np.random.default_rng(len(lens) + T)
    case = ragged_case(rng, lens, num_tokens=T, num_seqs=B, snapshots=snaps,
                       zero_init=zero_init)
    x = gdr_inputs(rng, case, hk, hv, 8, 4)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], x["ssm_pool"]) + slot_args(case)
    o, pool = _gdr_ref(*args)
    o_ref, pool_ref = gdr_oracle(*args)
    np.testing.assert_allclose(np.asarray(o), o_ref, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(pool), pool_ref, atol=1e-5, rtol=1e-5)
    assert np.all(np.asarray(pool)[0] == 0)


def test_gdr_decode_reference_matches_extend():
    rng = np.random.default_rng(3)
    case = ragged_case(rng, [1, 1, 1], num_tokens=4, num_seqs=4)
    x = gdr_inputs(rng, case, 1, 2, 8, 4)
    o, pool = ops.gated_delta_rule_decode(
        x["q"], x["k"], x["v"], x["g"], x["beta"], x["ssm_pool"], case.read_slot,
        case.write_slot, impl="reference")
    o_ref, pool_ref = gdr_oracle(x["q"], x["k"], x["v"], x["g"], x["beta"], x["ssm_pool"],
                                 np.arange(5).clip(0, 3), case.read_slot, case.write_slot,
                                 [], [], [])
    np.testing.assert_allclose(np.asarray(o)[:3], o_ref[:3], atol=1e-5)
    np.testing.assert_allclose(np.asarray(pool), pool_ref, atol=1e-5)


@pytest.mark.parametrize("kw", [2, 4])
@pytest.mark.parametrize("use_bias", [True, False])
def test_conv_extend_reference(kw, use_bias):
    rng = np.random.default_rng(kw)
    lens = [5, 1, 2, 9]
    snaps = [(0, 0), (0, 1), (0, kw - 2), (3, 3), (3, 9), (1, 1), (2, 2), (3, 0)]
    case = ragged_case(rng, lens, num_tokens=20, num_seqs=5, snapshots=snaps)
    c = 6
    x = rng.normal(size=(20, c)).astype(np.float32)
    w = rng.normal(size=(kw, c)).astype(np.float32)
    bias = rng.normal(size=(c,)).astype(np.float32) if use_bias else None
    pool = rng.normal(size=(case.num_slots, kw - 1, c)).astype(np.float32)
    pool[0] = 0
    y, new_pool = _conv_ref(x, w, bias, pool, *slot_args(case))
    y_ref, pool_ref = conv_oracle(x, w, bias, pool, *slot_args(case))
    np.testing.assert_allclose(np.asarray(y), y_ref, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(new_pool), pool_ref, atol=1e-6)
    y_dec, dec_pool = ops.causal_conv1d_decode(x[:4], w, bias, pool, case.read_slot[:4],
                                               case.write_slot[:4], impl="reference")
    one = np.arange(5).clip(0, 4)
    y_dref, dpool_ref = conv_oracle(x[:4], w, bias, pool, one, case.read_slot[:4],
                                    case.write_slot[:4], [], [], [])
    np.testing.assert_allclose(np.asarray(y_dec), y_dref, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(dec_pool), dpool_ref, atol=1e-6)


@pytest.mark.parametrize("page_size,hq,hkv", [(1, 2, 2), (4, 4, 1), (3, 6, 2)])
def test_paged_attention_reference(page_size, hq, hkv):
    rng = np.random.default_rng(page_size)
    d, num_pages = 8, 40
    ext, prefix = [3, 1, 6, 1], [4, 7, 0, 0]
    seq_lens = np.array(ext, np.int32) + np.array(prefix, np.int32)
    pages_per = -(-seq_lens.max() // page_size)
    perm = rng.permutation(np.arange(1, num_pages))
    table = perm[:4 * pages_per].reshape(4, pages_per).astype(np.int32)
    kp = rng.normal(size=(num_pages, page_size, hkv, d)).astype(np.float32)
    vp = rng.normal(size=(num_pages, page_size, hkv, d)).astype(np.float32)
    cu = np.concatenate([[0], np.cumsum(ext)]).astype(np.int32)
    T = int(cu[-1]) + 2
    q = rng.normal(size=(T, hq, d)).astype(np.float32)
    o = ops.paged_attention(q, kp, vp, cu, seq_lens, table, scale=d ** -0.5, impl="reference")
    o_ref = attn_oracle(q, kp, vp, cu, seq_lens, table, d ** -0.5)
    np.testing.assert_allclose(np.asarray(o), o_ref, atol=1e-5, rtol=1e-5)


def test_write_kv_and_resolve_impl():
    kp = jnp.zeros((3, 2, 1, 4))
    k = jnp.arange(12.0).reshape(3, 1, 4)
    kp2, vp2 = ops.write_kv(kp, kp, k, -k, jnp.array([5, 2, 0]))
    np.testing.assert_array_equal(np.asarray(kp2[2, 1]), np.asarray(k[0]))
    np.testing.assert_array_equal(np.asarray(vp2[1, 0]), -np.asarray(k[1]))
    assert ops.resolve_impl("auto") in ops.IMPLS
    assert ops.resolve_impl("reference") == "reference"
    with pytest.raises(ValueError, match="kernels"):
        ops.resolve_impl("fast")
