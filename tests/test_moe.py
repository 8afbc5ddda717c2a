"""Grouped (token-sorted, ragged_dot) MoE vs the dense reference; its cost scales with k, not E;
under tensor parallel the routed part runs per device on local experts (4 CPU devices, in a
subprocess since XLA_FLAGS must be set before jax initialises)."""

from __future__ import annotations

import re
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.moe import moe_dense_reference, moe_grouped, route, router_weights
from tests.multidevice import run_worker


def make_moe(num_tokens: int, num_experts: int, hidden: int, inter: int, dtype=jnp.float32,
             seed: int = 0) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Random x ``[T, H]`` and MoE params in the layout of ``models.params``."""
    ks = jax.random.split(jax.random.key(seed), 7)
    shapes = {"router": (hidden, num_experts), "gate_up": (num_experts, hidden, 2 * inter),
              "down": (num_experts, inter, hidden), "shared_gate_up": (hidden, 2 * inter),
              "shared_down": (inter, hidden), "shared_gate": (hidden, 1)}
    p = {name: (jax.random.normal(k, s) / np.sqrt(s[-2])).astype(dtype)
         for k, (name, s) in zip(ks, shapes.items(), strict=False)}
    x = jax.random.normal(ks[6], (num_tokens, hidden)).astype(dtype)
    return x, p


# the ragged_dot form; the grouped matmul kernel's form: tests/test_kernels_grouped_matmul.py
_grouped = jax.jit(partial(moe_grouped, impl="ragged_dot"), static_argnums=(2, 3))
_dense = jax.jit(moe_dense_reference, static_argnums=(2, 3))


@pytest.mark.parametrize("num_tokens", [1, 7, 32])
@pytest.mark.parametrize("num_experts,top_k", [(4, 1), (8, 2), (16, 5)])
@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_grouped_matches_dense_fp32(num_tokens, num_experts, top_k, norm_topk_prob):
    x, p = make_moe(num_tokens, num_experts, 32, 16, seed=num_tokens * 31 + num_experts)
    got = np.asarray(_grouped(x, p, top_k, norm_topk_prob))
    want = np.asarray(_dense(x, p, top_k, norm_topk_prob))
    assert got.dtype == want.dtype == np.float32
    scale = np.max(np.abs(want))
    assert np.max(np.abs(got - want)) <= 1e-5 * scale, np.max(np.abs(got - want)) / scale


def test_grouped_matches_dense_bf16():
    x, p = make_moe(33, 8, 64, 32, dtype=jnp.bfloat16, seed=5)
    got = _grouped(x, p, 2, True)
    want = _dense(x, p, 2, True)
    assert got.dtype == want.dtype == jnp.bfloat16
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    # a few bf16 roundings (2^-8 relative each) at different points of the two sums
    assert np.max(np.abs(got - want)) <= 2e-2 * np.max(np.abs(want))


def test_routing_ties_resolved_like_dense():
    """A zero router makes every probability equal: both forms pick top_k's lowest ids."""
    x, p = make_moe(5, 8, 32, 16, seed=1)
    p = {**p, "router": jnp.zeros_like(p["router"])}
    vals, idx = route(x, p["router"], 3, False)
    assert np.array_equal(np.asarray(idx), np.tile([0, 1, 2], (5, 1)))
    np.testing.assert_allclose(np.asarray(vals), 1 / 8)
    assert np.all(np.asarray(router_weights(x, p["router"], 3, False))[:, 3:] == 0)
    np.testing.assert_allclose(np.asarray(_grouped(x, p, 3, False)),
                               np.asarray(_dense(x, p, 3, False)), rtol=1e-5, atol=1e-6)


def test_bad_top_k_names_value_and_limit():
    x, p = make_moe(2, 4, 16, 8)
    with pytest.raises(ValueError, match=r"top_k=5 must be in \[1, num_experts=4\]"):
        moe_grouped(x, p, 5, True)


def _largest_tensor(fn, num_experts: int, top_k: int, num_tokens: int = 256) -> tuple[int, str]:
    """(elements of the largest f32 tensor, StableHLO) of ``fn`` lowered for TPU.

    Lowered, not compiled: on CPU JAX expands ``ragged_dot`` to a masked dense matmul over every
    group (``_ragged_dot_general_impl``), so CPU cost numbers say nothing about GPU / TPU, where
    it stays one ``chlo.ragged_dot``.
    """
    x, p = make_moe(num_tokens, num_experts, 32, 16)
    if fn is moe_grouped:  # the ragged_dot form (the kernel's own test: test_kernels_grouped_*)
        fn = partial(fn, impl="ragged_dot")
    f = jax.jit(partial(fn, top_k=top_k, norm_topk_prob=True))
    text = f.trace(x, p).lower(lowering_platforms=("tpu",)).as_text()
    sizes = [int(np.prod([int(d) for d in s.split("x")]))
             for s in re.findall(r"tensor<([0-9x]+)xf32>", text)]
    return max(sizes), text


@pytest.mark.parametrize("num_experts", [16, 64])
def test_grouped_work_scales_with_k_not_experts(num_experts):
    """T=256, H=32, I=16, k=2: the grouped form's largest tensor is its weights or ``[T*k, H]``
    (never ``[T, E, ...]``); the dense form's is ``[T, E, 2I]``, which fails the same bound."""
    top_k, num_tokens, hidden, inter = 2, 256, 32, 16
    bound = max(num_experts * hidden * 2 * inter, num_tokens * top_k * 2 * hidden)
    size, text = _largest_tensor(moe_grouped, num_experts, top_k, num_tokens)
    assert text.count("\"chlo.ragged_dot\"(") == 2  # gate_up and down: one grouped matmul each
    assert size <= bound, (size, bound)
    dense_size, dense_text = _largest_tensor(moe_dense_reference, num_experts, top_k, num_tokens)
    assert "ragged_dot" not in dense_text
    assert dense_size >= num_tokens * num_experts * 2 * inter > bound


_TP_WORKER = """
import json, jax, jax.numpy as jnp, numpy as np
from functools import partial
from jax.sharding import NamedSharding, PartitionSpec as P
from mambacache.parallel.mesh import make_mesh
from tests.test_moe import make_moe
from models.moe import moe_dense_reference, moe_grouped
assert len(jax.devices()) == 4, jax.devices()
x, p = make_moe(24, 8, 64, 32, seed=2)
mesh = make_mesh(4)
ps = {n: jax.device_put(v, NamedSharding(mesh, P("tp") if n in ("gate_up", "down") else P()))
      for n, v in p.items()}
want = np.asarray(moe_dense_reference(x, p, 2, True))
result = {}
for name, m in (("shard_map", mesh), ("gspmd", None)):
    f = jax.jit(partial(moe_grouped, top_k=2, norm_topk_prob=True, mesh=m, impl="ragged_dot"))
    hlo = f.lower(x, ps).compile().as_text()
    err = float(np.max(np.abs(np.asarray(f(x, ps)) - want)) / np.max(np.abs(want)))
    result[name] = dict(err=err, all_gather=hlo.count("all-gather("),
                        all_reduce=hlo.count("all-reduce("),
                        whole=[s for s in ("f32[8,64,64]", "f32[8,32,64]") if s in hlo])
print(json.dumps(result))
"""


@pytest.fixture(scope="module")
def tp_run():
    return run_worker(_TP_WORKER)


def test_tp_grouped_runs_on_local_experts(tp_run):
    """TP 4, 8 experts: shard_map form == dense; per device only its 2 experts' weights; the one
    collective is the psum of the routed output. Left to GSPMD, the same grouped code gathers
    routing data across devices (all-gathers): the collective counts tell the two apart."""
    sm, gspmd = tp_run["shard_map"], tp_run["gspmd"]
    assert sm["err"] <= 1e-5 and gspmd["err"] <= 1e-5
    assert sm["whole"] == [] and sm["all_gather"] == 0 and sm["all_reduce"] == 1, sm
    assert gspmd["all_gather"] > 0, gspmd
