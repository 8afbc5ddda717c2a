"""The precision rule (``models/precision.py``): float32 weights compute every matmul at
HIGHEST precision, the Pallas kernels' own products included, so "fp32" is fp32 on a GPU (no
TF32) as on CPU; bf16 keeps the backend's default. Checked on the traced programs themselves:
every ``dot_general`` over float32 operands, inside kernels, scans and sub-jits too."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.extend import core as jex_core

from mambacache.engine.runners.pools import PoolState
from mambacache.engine.step.batch import SeqSpec, build_forward_batch
from models import PRESETS, forward, init_params
from models.precision import exact_matmuls

PAGE_SIZE = 4


def sub_jaxprs(value):
    """The jaxprs held in one equation parameter (a jaxpr, a closed jaxpr, or a sequence)."""
    if isinstance(value, jex_core.ClosedJaxpr):
        yield value.jaxpr
    elif isinstance(value, jex_core.Jaxpr):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from sub_jaxprs(v)


def dots(jaxpr):
    """Every ``dot_general`` equation of ``jaxpr`` and of the jaxprs nested in it."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            yield eqn
        for value in eqn.params.values():
            for sub in sub_jaxprs(value):
                yield from dots(sub)


def precision_of(eqn) -> tuple:
    p = eqn.params["precision"]
    return (None, None) if p is None else tuple(p) if isinstance(p, tuple) else (p, p)


def f32_operands(eqn) -> bool:
    return all(v.aval.dtype == jnp.float32 for v in eqn.invars)


def forward_jaxpr(preset: str, dtype, kernels: str):
    cfg = PRESETS[preset]
    params = jax.tree.map(lambda a: a.astype(dtype) if a.dtype == jnp.float32 else a,
                          init_params(cfg, seed=1))
    pools = PoolState.create(cfg, num_pages=16, page_size=PAGE_SIZE, num_slots=4, dtype=dtype)
    seqs = [SeqSpec([5, 6, 7, 8, 9], 0, [1, 2], 0, 1, snapshots=[(4, 2)], logits="all")]
    batch = build_forward_batch(seqs, PAGE_SIZE, num_tokens=8, num_seqs=2,
                                num_pages_per_seq=4, num_snapshots=1, num_logits=8)
    fn = functools.partial(forward, cfg=cfg, kernels=kernels, decode=False)
    return jax.make_jaxpr(fn)(params, pools, batch).jaxpr


HIGHEST = (lax.Precision.HIGHEST, lax.Precision.HIGHEST)


@pytest.mark.parametrize("preset", ["tiny_qwen3_next", "tiny_qwen3_5_moe", "tiny_nemotron_h",
                                    "tiny_kimi_linear"])
@pytest.mark.parametrize("kernels", ["reference", "pallas"])
def test_float32_model_runs_every_fp32_matmul_at_highest(preset, kernels, monkeypatch):
    monkeypatch.setenv("PALLAS_FAMILY", "gpu")  # the Triton kernels: where TF32 would bite
    found = [e for e in dots(forward_jaxpr(preset, jnp.float32, kernels)) if f32_operands(e)]
    assert found, "no float32 matmul traced"
    loose = [precision_of(e) for e in found if precision_of(e) != HIGHEST]
    assert not loose, f"{len(loose)} of {len(found)} fp32 matmuls below HIGHEST: {loose[:4]}"


def test_bf16_model_keeps_the_backend_default():
    found = [e for e in dots(forward_jaxpr("tiny_qwen3_next", jnp.bfloat16, "reference"))
             if not f32_operands(e)]
    assert found and all(precision_of(e) != HIGHEST for e in found)


def test_exact_matmuls_only_for_float32():
    a = jnp.ones((2, 2), jnp.float32)
    for dtype, want in ((jnp.float32, HIGHEST), (jnp.bfloat16, (None, None))):
        with exact_matmuls(dtype):
            eqn = next(dots(jax.make_jaxpr(jnp.matmul)(a, a).jaxpr))
        assert precision_of(eqn) == want
