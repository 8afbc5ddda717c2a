"""``models.forward`` on the embedded tiny preset: presets/config, batching, snapshots, decode,
and the Pallas kernels against the references."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mambacache.engine.runners.pools import PoolState
from mambacache.engine.step.batch import SeqSpec, build_forward_batch
from models import PRESETS, ModelConfig, forward, get_preset, init_params, param_shapes
from pallas_kernels import ops

PAGE_SIZE = 4
T_BUCKET, B_BUCKET = 32, 3
CFG = PRESETS["tiny_qwen3_next"]


def step(kernels: str, decode: bool):
    return _step(kernels, decode, ops.kernel_family())  # PALLAS_FAMILY is read when tracing


@functools.cache
def _step(kernels: str, decode: bool, family: str):
    return jax.jit(functools.partial(forward, cfg=CFG, kernels=kernels, decode=decode),
                   donate_argnums=(1,))


@functools.cache
def params():
    return init_params(CFG, seed=1)


def pools():
    return PoolState.create(CFG, num_pages=64, page_size=PAGE_SIZE, num_slots=6)


def run(pool, seqs, *, kernels="reference", decode=False):
    t = B_BUCKET if decode else T_BUCKET
    batch = build_forward_batch(seqs, PAGE_SIZE, num_tokens=t, num_seqs=B_BUCKET,
                                num_pages_per_seq=8, num_snapshots=2, num_logits=T_BUCKET)
    pool, logits = step(kernels, decode)(params(), pool, batch)
    n = sum(len(s.tokens) if s.logits == "all" else int(s.logits == "last") for s in seqs)
    return pool, np.asarray(logits)[:n]


def tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(1, CFG.vocab_size, n).tolist()


def test_presets_are_consistent():
    qwen = {"tiny_qwen3_next", "tiny_qwen3_5", "tiny_qwen3_5_moe", "tiny_qwen3_next_tp4"}
    assert qwen | {"tiny_nemotron_h", "tiny_granite_4_h"} <= set(PRESETS)
    for name, cfg in PRESETS.items():
        assert get_preset(name) is cfg
        if name in qwen:  # the 3:1 pattern, GQA, partial RoPE
            assert cfg.num_hidden_layers >= 4
            assert cfg.num_linear_layers == 3 * cfg.num_full_layers
            assert cfg.num_attention_heads > cfg.num_key_value_heads
            assert 0 < cfg.rotary_dim < cfg.head_dim
        assert cfg.linear_conv_dim == (2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim
                                       + cfg.linear_num_value_heads * cfg.linear_value_head_dim)
        p = init_params(cfg, seed=0)
        got = [tuple(x.shape) for x in jax.tree_util.tree_leaves(p)]
        want = jax.tree_util.tree_leaves(param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple)
                                         and all(isinstance(d, int) for d in x))
        assert got == want
    assert "moe" in PRESETS["tiny_qwen3_next"].mlp_types
    with pytest.raises(ValueError, match="unknown model preset"):
        get_preset("nope")


def test_init_is_seeded_and_randomises_norms():
    a, b, c = init_params(CFG, 3), init_params(CFG, 3), init_params(CFG, 4)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)
    assert not np.array_equal(a["embed"], c["embed"])
    layer = a["layers"][0]
    assert np.std(np.asarray(layer["input_norm"])) > 0.01  # not the identity init
    assert np.std(np.asarray(layer["gdn"]["norm"])) > 0.01
    assert np.std(np.asarray(layer["gdn"]["dt_bias"])) > 0.01
    assert init_params(CFG, 0, jnp.bfloat16)["embed"].dtype == jnp.bfloat16


@pytest.mark.parametrize("change, match", [
    (dict(num_key_value_heads=3), "multiple of num_key_value_heads"),
    (dict(linear_num_key_heads=3), "multiple of linear_num_key_heads"),
    (dict(partial_rotary_factor=0.1), "rotary dim"),
    (dict(layer_types=("linear_attention", "mamba", "linear_attention", "full_attention")),
     "layer_types"),
    (dict(mlp_types=("moe",) * 3), "mlp_types"),
    (dict(num_experts_per_tok=9), "num_experts_per_tok"),
    (dict(family="llama"), "family"),
    (dict(vocab_size=0), "vocab_size"),
])
def test_config_validation(change, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(CFG, **change)


def test_forward_rejects_bad_arguments():
    batch = build_forward_batch([SeqSpec(tokens=[1, 2], prefix_len=0, page_ids=[1],
                                         read_slot=0, write_slot=1)], PAGE_SIZE)
    with pytest.raises(ValueError, match="kernels"):
        forward(params(), pools(), batch, cfg=CFG, kernels="cuda")
    with pytest.raises(ValueError, match="one token per sequence"):
        forward(params(), pools(), batch, cfg=CFG, decode=True)


def test_sequence_logits_do_not_depend_on_batch_neighbours():
    a, b = tokens(0, 11), tokens(1, 7)
    _, alone = run(pools(), [SeqSpec(a, 0, [5, 9, 2], 0, 1, logits="all")])
    _, packed = run(pools(), [SeqSpec(b, 0, [1, 3], 0, 2, logits="all"),
                              SeqSpec(a, 0, [5, 9, 2], 0, 1, logits="all")])
    assert np.isfinite(alone).all() and np.abs(alone).max() > 0.1
    np.testing.assert_allclose(packed[len(b):], alone, atol=1e-5, rtol=0)


def test_snapshot_then_resume_equals_one_piece():
    """A snapshot at offset 6 (into slot 4), resumed by another sequence, gives the same logits."""
    p = tokens(2, 13)
    pool, full = run(pools(), [SeqSpec(p, 0, [3, 7, 8, 11], 0, 1, snapshots=[(6, 4), (13, 5)],
                                       logits="all")])
    pool, resumed = run(pool, [SeqSpec(p[6:], 6, [3, 7, 8, 11], 4, 2, logits="all")])
    np.testing.assert_allclose(resumed, full[6:], atol=1e-5, rtol=0)
    # the snapshot at offset 13 equals the final state written to the write slot
    for conv, ssm in zip(pool.conv, pool.ssm, strict=True):
        np.testing.assert_array_equal(conv[5], conv[1])
        np.testing.assert_array_equal(ssm[5], ssm[1])
        assert not np.any(ssm[0]) and not np.any(conv[0])  # slot 0 stays zero


def test_decode_equals_one_token_extend():
    p, q = tokens(3, 9), tokens(4, 5)
    pages = ([1, 2, 3], [4, 5])
    prefill = [SeqSpec(p, 0, pages[0], 0, 1), SeqSpec(q, 0, pages[1], 0, 2)]
    nxt = [SeqSpec([7], 9, pages[0], 1, 1), SeqSpec([8], 5, pages[1], 2, 2)]
    pool, _ = run(pools(), prefill)
    _, by_extend = run(pool, nxt)
    pool, _ = run(pools(), prefill)
    _, by_decode = run(pool, nxt, decode=True)
    np.testing.assert_allclose(by_decode, by_extend, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", [pytest.param("tpu", marks=pytest.mark.slow), "gpu"])
def test_pallas_kernels_match_reference(family, monkeypatch):
    """kernels="pallas" (interpret mode on CPU) equals "reference" on prefill and decode, with
    the Mosaic (tpu) and the Triton (gpu) kernel families."""
    monkeypatch.setenv("PALLAS_FAMILY", family)
    p, q = tokens(5, 10), tokens(6, 4)
    prefill = [SeqSpec(p, 0, [1, 2, 3], 0, 1, snapshots=[(4, 3)], logits="all"),
               SeqSpec(q, 0, [4, 5], 0, 2, logits="all")]
    nxt = [SeqSpec([7], 10, [1, 2, 3], 1, 1), SeqSpec([8], 4, [4, 5], 2, 2)]
    out = {}
    for kernels in ("reference", "pallas"):
        pool, pre = run(pools(), prefill, kernels=kernels)
        pool, dec = run(pool, nxt, kernels=kernels, decode=True)
        out[kernels] = (pre, dec, pool)
    ref, pal = out["reference"], out["pallas"]
    np.testing.assert_allclose(pal[0], ref[0], atol=1e-4, rtol=0)
    np.testing.assert_allclose(pal[1], ref[1], atol=1e-4, rtol=0)
    for a, b in zip(jax.tree_util.tree_leaves(pal[2]), jax.tree_util.tree_leaves(ref[2]),
                    strict=True):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=0)


def test_model_config_is_hashable_for_jit_static_use():
    assert hash(CFG) == hash(dataclasses.replace(CFG))
    assert ModelConfig(**{f.name: getattr(CFG, f.name) for f in dataclasses.fields(CFG)}) == CFG
