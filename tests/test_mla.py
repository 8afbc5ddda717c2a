"""MLA over the paged latent cache (``ops.write_latent``, ``ops.mla_attention``): the
weight-absorbed form equals attention with per-head K and V expanded from the latent (the form
transformers runs), and the Pallas paged attention kernels (TPU and GPU families, interpreted)
equal the reference at latent-row shapes (one KV head, rows of R + dr)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import ops
from pallas_kernels.testing import paged_attention_case

HQ, R, DN, DR, DV = 4, 24, 16, 8, 12


def case(seed: int = 0):
    rng = np.random.default_rng(seed)
    # sequences extend 5 / 1 / 9 tokens after 3 / 11 / 0 cached ones, pages of 4
    q, pages, _, cu, seq_lens, table = paged_attention_case(rng, [5, 1, 9], [3, 11, 0], 4, HQ,
                                                            1, R + DR)
    k_up = rng.normal(size=(HQ, R, DN)) / R ** 0.5
    v_up = rng.normal(size=(HQ, R, DV)) / R ** 0.5
    q_nope = rng.normal(size=(q.shape[0], HQ, DN))
    f32 = lambda a: jnp.asarray(a, jnp.float32)
    return f32(q[..., R:]), f32(q_nope), f32(pages), f32(k_up), f32(v_up), cu, seq_lens, table


def expanded_attention(q_rope, q_nope, pages, k_up, v_up, cu, seq_lens, table, scale):
    """Per head: K = [W_uk c | k_r], V = W_uv c over the sequence's positions (numpy)."""
    pages, out = np.asarray(pages, np.float64), np.zeros((q_rope.shape[0], HQ, DV))
    for b in range(len(seq_lens)):
        rows = pages[table[b]].reshape(-1, R + DR)[:seq_lens[b]]           # [L, R + dr]
        c, k_r = rows[:, :R], rows[:, R:]
        k = np.concatenate([np.einsum("lr,hrn->hln", c, k_up),
                            np.broadcast_to(k_r, (HQ,) + k_r.shape)], -1)  # [H, L, dn + dr]
        v = np.einsum("lr,hrv->hlv", c, v_up)
        n = cu[b + 1] - cu[b]
        for i in range(n):
            t, pos = cu[b] + i, seq_lens[b] - n + i
            qh = np.concatenate([q_nope[t], q_rope[t]], -1)                # [H, dn + dr]
            s = np.einsum("hd,hld->hl", qh, k[:, :pos + 1]) * scale
            p = np.exp(s - s.max(-1, keepdims=True))
            out[t] = np.einsum("hl,hlv->hv", p / p.sum(-1, keepdims=True), v[:, :pos + 1])
    return out


@pytest.mark.parametrize("impl,family", [("reference", None), ("pallas", "tpu"),
                                         ("pallas", "gpu")])
def test_absorbed_equals_expanded(impl, family, monkeypatch):
    if family:
        monkeypatch.setenv("PALLAS_FAMILY", family)
    q_rope, q_nope, pages, k_up, v_up, cu, seq_lens, table = case()
    scale = (DN + DR) ** -0.5
    q_abs = jnp.concatenate([jnp.einsum("thn,hrn->thr", q_nope, k_up), q_rope], -1)
    o_lat = ops.mla_attention(q_abs, pages, cu, seq_lens, table, kv_lora_rank=R, scale=scale,
                              impl=impl)
    got = np.asarray(jnp.einsum("thr,hrv->thv", o_lat, v_up))
    want = expanded_attention(*(np.asarray(a) for a in (q_rope, q_nope, pages, k_up, v_up)),
                              cu, seq_lens, table, scale)
    n = int(cu[-1])
    np.testing.assert_allclose(got[:n], want[:n], atol=1e-5, rtol=1e-5)
    assert not np.any(got[n:])  # padding tokens give 0


def test_write_latent_rows():
    pages = jnp.zeros((5, 4, 1, R + DR))
    rows = jax.random.normal(jax.random.key(0), (3, R + DR))
    loc = jnp.asarray([4 * 2 + 1, 4 * 3 + 0, 4 * 2 + 3])
    out = np.asarray(ops.write_latent(pages, rows, loc))
    np.testing.assert_array_equal(out[2, 1, 0], rows[0])
    np.testing.assert_array_equal(out[3, 0, 0], rows[1])
    np.testing.assert_array_equal(out[2, 3, 0], rows[2])
    assert np.count_nonzero(np.abs(out).sum(-1)) == 3
