"""The grouped MoE matmul: ``moe_align``'s layout, the GPU (Pallas Triton) and TPU (megablox)
kernels interpreted on CPU against the per-pair reference and the dense every-expert form, every
MoE family's feed-forward through the op against its dense reference, and the tensor-parallel
split (4 CPU devices in a subprocess).

Each family runs compiled on its own backend and interpreted elsewhere (``interpret_default``),
so on a GPU the Triton kernel is tested compiled. Tolerances: fp32 1e-5 of the output's scale
interpreted (exact fp32 products in every form; sums reordered), 1e-4 compiled (Triton's fp32
dots at ``HIGHEST`` are 3-pass tf32, as the other GPU kernels' tests note); bf16 2e-2 (x.dtype
roundings of the activation and the weighted pair at different points).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.config import ModelConfig
from models.families import get_family
from models.params import init_params
from models.presets import PRESETS
from pallas_kernels import ops
from pallas_kernels._common import interpret_default
from pallas_kernels.gpu import grouped_matmul as gpu_gmm
from pallas_kernels.moe_align import max_blocks, moe_align
from pallas_kernels.reference.grouped_matmul import activate, grouped_moe_reference
from pallas_kernels.tpu import grouped_matmul as tpu_gmm
from tests.multidevice import run_worker

INTERPRET = {f: interpret_default(f) for f in ("gpu", "tpu")}
KERNELS = {f: functools.partial(k.grouped_moe, interpret=INTERPRET[f])
           for f, k in (("gpu", gpu_gmm), ("tpu", tpu_gmm))}
F32_TOL = {f: 1e-5 if INTERPRET[f] else 1e-4 for f in INTERPRET}
_HI = jax.lax.Precision.HIGHEST


def dense(x, top_vals, top_idx, w_in, w_out, activation):
    """Every expert on every token, weight 0 outside the top-k ``[T, H]`` f32."""
    num_experts = w_in.shape[0]
    a = activate(jnp.einsum("th,ehn->ten", x, w_in, precision=_HI), activation)
    per_expert = jnp.einsum("tei,eih->teh", a, w_out, precision=_HI)
    w = jnp.einsum("tk,tke->te", top_vals, jax.nn.one_hot(top_idx, num_experts))
    return jnp.einsum("teh,te->th", per_expert.astype(jnp.float32), w.astype(jnp.float32),
                      precision=_HI)


def case(num_tokens, num_experts, top_k, hidden, inter, activation="swiglu", routing="random",
         dtype=jnp.float32, seed=0):
    """x, top_vals, top_idx, w_in, w_out. ``routing``: "random" (softmax top-k), "one" (every
    token on experts ``[3, 4, ..]``), "few" (only experts 0 and 1 of many)."""
    ks = jax.random.split(jax.random.key(seed), 4)
    n_in = 2 * inter if activation == "swiglu" else inter
    x = jax.random.normal(ks[0], (num_tokens, hidden))
    w_in = jax.random.normal(ks[1], (num_experts, hidden, n_in)) / np.sqrt(hidden)
    w_out = jax.random.normal(ks[2], (num_experts, inter, hidden)) / np.sqrt(inter)
    vals, idx = jax.lax.top_k(jax.nn.softmax(jax.random.normal(ks[3], (num_tokens, num_experts))),
                              top_k)
    if routing == "one":
        idx = jnp.broadcast_to(3 + jnp.arange(top_k, dtype=jnp.int32), idx.shape)
    elif routing == "few":
        idx = (idx % 2) if top_k == 1 else jnp.broadcast_to(jnp.arange(top_k), idx.shape)
    return (x.astype(dtype), vals.astype(dtype), idx.astype(jnp.int32), w_in.astype(dtype),
            w_out.astype(dtype))


def _err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


# ---- moe_align -------------------------------------------------------------------------------

@pytest.mark.parametrize("num_tokens,top_k,num_experts,block_m,offset",
                         [(13, 3, 8, 4, 0), (1, 2, 64, 16, 0), (40, 1, 4, 16, 0),
                          (9, 2, 4, 4, 2), (0, 2, 4, 4, 0)])
def test_align_layout(num_tokens, top_k, num_experts, block_m, offset):
    """Every local pair exactly once, in its expert's blocks, in pair order; each used block
    one expert; padding rows only at the end of an expert's run; unused blocks -1."""
    rng = np.random.default_rng(num_tokens)
    idx = np.array([rng.permutation(num_experts + offset)[:top_k] for _ in range(num_tokens)],
                   np.int32).reshape(num_tokens, top_k)
    block_expert, pair = (np.asarray(a) for a in
                          moe_align(jnp.asarray(idx), num_experts, block_m, offset))
    num_pairs = num_tokens * top_k
    assert block_expert.shape == (max_blocks(num_pairs, num_experts, block_m),)
    assert pair.shape == (block_expert.shape[0] * block_m,)
    local = idx.reshape(-1) - offset
    want = [p for e in range(num_experts) for p in np.flatnonzero(local == e)]
    rows = pair.reshape(-1, block_m)
    got = [p for r in rows for p in r if p < num_pairs]
    assert got == want
    for b, e in enumerate(block_expert):
        real = rows[b][rows[b] < num_pairs]
        if e < 0:
            assert real.size == 0
        else:
            assert real.size > 0 and np.all(local[real] == e)
            assert np.all(rows[b][: real.size] == real)   # padding after the pairs
    used = block_expert >= 0
    assert not np.any(used[np.argmin(used):]) or used.all()     # used blocks first


def test_align_bound_follows_pairs_not_experts():
    """Decode at Qwen3.5-35B-A3B routing: 64 tokens x top 8 over 256 experts in 16-row blocks
    needs at most 272 blocks; one token needs 8 (not 256 * 15 / 16 = 240)."""
    assert max_blocks(64 * 8, 256, 16) == 272
    assert max_blocks(8, 256, 16) == 8
    assert max_blocks(2048 * 8, 256, 64) == 508


# ---- kernels vs the reference and the dense form ---------------------------------------------

KERNEL_CASES = {  # (T, E, k, H, I, activation, routing)
    "ragged_swiglu": (13, 8, 3, 48, 24, "swiglu", "random"),
    "empty_experts": (3, 16, 2, 32, 16, "swiglu", "random"),
    "all_on_one": (21, 8, 1, 32, 16, "swiglu", "one"),
    "all_on_two_relu2": (19, 8, 2, 40, 24, "relu2", "one"),
    "few_of_many_relu2": (17, 32, 2, 32, 48, "relu2", "few"),
}


@pytest.mark.parametrize("family", ["gpu", "tpu"])
@pytest.mark.parametrize("name", list(KERNEL_CASES))
def test_kernel_matches_reference_and_dense_fp32(family, name):
    t, e, k, h, i, act, routing = KERNEL_CASES[name]
    args = case(t, e, k, h, i, act, routing, seed=len(name))
    got = KERNELS[family](*args, activation=act)
    ref = grouped_moe_reference(*args, activation=act)
    assert got.shape == (t, h) and got.dtype == jnp.float32
    tol = F32_TOL[family]
    assert _err(got, ref) <= tol and _err(got, dense(*args, act)) <= tol
    assert _err(ref, dense(*args, act)) <= 1e-5


@pytest.mark.parametrize("family", ["gpu", "tpu"])
def test_kernel_local_experts_only(family):
    """``expert_offset``: the experts ``[4, 8)`` of 8 are this device's; pairs on the others
    contribute 0, so two halves sum to the whole."""
    x, vals, idx, w_in, w_out = case(11, 8, 2, 32, 16, seed=3)
    fn = KERNELS[family]
    halves = [fn(x, vals, idx, w_in[o:o + 4], w_out[o:o + 4], o) for o in (0, 4)]
    tol = F32_TOL[family]
    assert _err(halves[1], grouped_moe_reference(x, vals, idx, w_in[4:], w_out[4:], 4)) <= tol
    assert _err(halves[0] + halves[1], dense(x, vals, idx, w_in, w_out, "swiglu")) <= tol


@pytest.mark.parametrize("family", ["gpu", "tpu"])
def test_kernel_bf16(family):
    args = case(24, 8, 2, 64, 32, dtype=jnp.bfloat16, seed=9)
    got = KERNELS[family](*args)
    assert _err(got, grouped_moe_reference(*args)) <= 2e-2


def test_gpu_blocks_sizes_the_grid():
    """The GPU kernels' grid is ``max_blocks(T k, E, BM)`` row blocks: with 4 tokens, top 2 over
    64 experts, 8 blocks of 16 rows (work ~ T k), not one per expert; other blocks (any power of
    two >= 16) give the same result."""
    args = case(4, 64, 2, 32, 16, seed=4)
    jaxpr = jax.make_jaxpr(lambda *a: gpu_gmm.grouped_moe(*a, interpret=True))(*args)
    assert str(jaxpr).count("GridMapping(grid=(8, 1)") == 2   # the up and the down kernel
    blocks = gpu_gmm.GmmBlocks(block_m=32, block_n=16, block_k=16)
    got = KERNELS["gpu"](*args, blocks=blocks)
    assert _err(got, grouped_moe_reference(*args)) <= F32_TOL["gpu"]


@pytest.mark.parametrize("name", ["DECODE", "PREFILL"])
def test_gpu_default_blocks_exact_tiles(name):
    """The bf16 defaults on dims their tiles divide (plain indices, no masks: the compiled
    path at real sizes), checked in fp32: 70 tokens x top 2 over 4 experts, H 128, I 128."""
    blocks = getattr(gpu_gmm, name)
    args = case(70, 4, 2, 128, 128, seed=6)
    got = KERNELS["gpu"](*args, blocks=blocks)
    assert _err(got, grouped_moe_reference(*args)) <= F32_TOL["gpu"]


def test_bad_shapes_name_them():
    x, vals, idx, w_in, w_out = case(4, 8, 2, 32, 16)
    with pytest.raises(ValueError, match=r"w_out \(8, 12, 32\) must be \[E, I, H\]"):
        gpu_gmm.grouped_moe(x, vals, idx, w_in, w_out[:, :12], interpret=True)
    with pytest.raises(ValueError, match=r"top_vals \(4, 1\) must match top_idx \(4, 2\)"):
        tpu_gmm.grouped_moe(x, vals[:, :1], idx, w_in, w_out, interpret=True)
    with pytest.raises(ValueError, match="activation must be one of"):
        grouped_moe_reference(x, vals, idx, w_in, w_out, activation="gelu")
    with pytest.raises(ValueError, match="block_m 8 must be a power of two >= 16"):
        gpu_gmm.grouped_moe(x, vals, idx, w_in, w_out, interpret=True,
                            blocks=gpu_gmm.GmmBlocks(block_m=8))


# ---- every MoE family through the op ---------------------------------------------------------

MOE_PRESETS = ["tiny_qwen3_next", "tiny_qwen3_5_moe", "tiny_kimi_linear", "tiny_nemotron_h",
               "tiny_granite_4_h"]


def _ffn(cfg: ModelConfig, name: str, impl: str, num_tokens: int = 21):
    params = init_params(cfg, seed=1)
    i = cfg.mlp_types.index("moe")
    x = jax.random.normal(jax.random.key(2), (num_tokens, cfg.hidden_size))
    return get_family(cfg.family).ffn(cfg, params["layers"][i], x, impl, None)


@pytest.mark.parametrize("family", ["gpu", "tpu"])
@pytest.mark.parametrize("preset", MOE_PRESETS)
def test_family_moe_through_kernel_matches_dense(preset, family, monkeypatch):
    """Each family's feed-forward with ``impl="pallas"`` (the grouped matmul interpreted) equals
    its dense every-expert form (``impl="reference"``): softmax, Kimi's grouped biased sigmoid,
    Nemotron's relu2 experts, Granite's shared SwiGLU; 21 tokens (not a block multiple)."""
    monkeypatch.setenv("PALLAS_FAMILY", family)
    cfg = PRESETS[preset]
    calls = []
    real = ops.grouped_moe
    monkeypatch.setattr(ops, "grouped_moe", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    got = _ffn(cfg, preset, "pallas")
    want = _ffn(cfg, preset, "reference")
    assert calls and calls[0]["impl"] == "pallas"
    assert calls[0]["activation"] == ("relu2" if cfg.family == "nemotron_h" else "swiglu")
    assert _err(got, want) <= F32_TOL[family]


# ---- tensor parallel -------------------------------------------------------------------------

_TP_WORKER = """
import json, os, jax, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from mambacache.parallel.mesh import make_mesh
from pallas_kernels import ops
from tests.test_kernels_grouped_matmul import F32_TOL, case, dense
assert len(jax.devices()) == 4, jax.devices()
mesh = make_mesh(4)
result = {}
for act in ("swiglu", "relu2"):
    x, vals, idx, w_in, w_out = case(10, 8, 2, 32, 16, act, seed=5)
    want = np.asarray(dense(x, vals, idx, w_in, w_out, act))
    ws = [jax.device_put(w, NamedSharding(mesh, P("tp"))) for w in (w_in, w_out)]
    for family in ("gpu", "tpu"):
        os.environ["PALLAS_FAMILY"] = family
        f = jax.jit(lambda *a: ops.grouped_moe(*a, activation=act, impl="pallas", mesh=mesh))
        hlo = f.lower(x, vals, idx, *ws).compile().as_text()
        got = np.asarray(f(x, vals, idx, *ws))
        result[act + "_" + family] = dict(
            err=float(np.max(np.abs(got - want)) / np.max(np.abs(want))), tol=F32_TOL[family],
            all_reduce=hlo.count("all-reduce("), all_gather=hlo.count("all-gather("))
# every MoE family's feed-forward on the mesh (GPU kernel interpreted) vs one device's dense form
from models.params import init_params
from models.presets import PRESETS
os.environ["PALLAS_FAMILY"] = "gpu"
for preset in ("tiny_qwen3_next_tp4", "tiny_kimi_linear", "tiny_nemotron_h", "tiny_granite_4_h"):
    cfg = PRESETS[preset]
    layer = init_params(cfg, seed=1)["layers"][cfg.mlp_types.index("moe")]
    x = jax.random.normal(jax.random.key(2), (13, cfg.hidden_size))
    ffn = cfg.model_family.ffn
    want = np.asarray(ffn(cfg, layer, x, "reference", None))
    got = np.asarray(jax.jit(lambda l, x: ffn(cfg, l, x, "pallas", mesh))(layer, x))
    result["ffn_" + preset] = dict(err=float(np.max(np.abs(got - want)) / np.max(np.abs(want))),
                                   tol=F32_TOL["gpu"], all_reduce=1, all_gather=0)
print(json.dumps(result))
"""


def test_tp_kernel_runs_on_local_experts():
    """TP 4 over 8 experts: each device its 2 experts' pairs, one all-reduce (the psum), no
    all-gather of the expert weights; equal to the dense form for both families. Each MoE
    family's feed-forward on the mesh equals its dense form on one device."""
    result = run_worker(_TP_WORKER)
    assert len(result) == 8
    for name, r in result.items():
        assert r["err"] <= r["tol"], (name, r)
        assert r["all_reduce"] == 1 and r["all_gather"] == 0, (name, r)
