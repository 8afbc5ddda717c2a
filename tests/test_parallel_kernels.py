"""Pallas kernels under tensor parallelism: each kernel op runs in ``shard_map`` over ``"tp"``.

Through the Engine (cache on, a shared prefix so snapshots and hits happen), TP 2 and 4 with
``model.kernels="pallas"`` (interpreted on CPU) give the greedy tokens of one device with the
references, logprobs within 1e-4; and the compiled sharded step never materialises a whole pool
on a device (no full-size pool shape anywhere in the partitioned HLO).

One subprocess per kernel family with 4 forced host devices (XLA_FLAGS must be set before jax
initialises); ``PALLAS_FAMILY`` is read at trace time, so each family gets its own process.
"""

from __future__ import annotations

import pytest

from tests.multidevice import finish_worker, start_worker

# ~170 s of compiles on 2 cores: tensor parallel itself is covered in CI by tests/test_parallel.py
pytestmark = pytest.mark.slow

_WORKER = """
import json, re, sys
import jax, numpy as np
import mambacache as mc
from mambacache.engine.engine import Engine
from models.params import init_params
from models.presets import get_preset

assert len(jax.devices()) == 4, jax.devices()
tps = [int(t) for t in sys.argv[1].split(",")]
hlo_tps = [int(t) for t in sys.argv[2].split(",")]
model_cfg = get_preset("tiny_qwen3_next_tp4")
params = init_params(model_cfg, seed=3)
base = {"cache.num_kv_tokens": 256, "cache.num_mamba_slots": 16, "cache.page_size": 4,
        "scheduler.max_running_requests": 4, "scheduler.chunked_prefill_size": 32}
rng = np.random.default_rng(0)
system = rng.integers(0, 512, 24).tolist()
prompts = [system + rng.integers(0, 512, n).tolist() for n in (5, 30)]
sp = mc.SamplingParams(max_new_tokens=4)
HLO_DTYPE = {"float32": "f32", "bfloat16": "bf16"}


def abstract(x):
    # uncommitted arrays (the batch) follow the committed ones, as in the real call
    sh = x.sharding if isinstance(x, jax.Array) and x.committed else None
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sh)


def recording(runner):
    # keep the abstract arguments of each program's first call (pools are donated)
    seen, fns = {}, dict(runner._fns)

    def wrap(d):
        def call(*args):
            seen.setdefault(d, jax.tree.map(abstract, args))
            return fns[d](*args)
        return call

    runner._fns = {d: wrap(d) for d in fns}
    return seen, fns


def inspect_programs(seen, fns, pools):
    # per program: full-size pool shapes in the partitioned HLO, and shard_map regions lowered
    full = {HLO_DTYPE[x.dtype.name] + "[" + ",".join(map(str, x.shape)) + "]"
            for x in jax.tree.leaves(pools)}
    found, regions = {}, {}
    for d, args in seen.items():
        lowered = fns[d].lower(*args)
        regions[str(d)] = lowered.as_text().count("sdy.manual_computation")
        text = lowered.compile().as_text()
        found[str(d)] = sorted(s for s in full if s in text)
    return found, regions


def conv_bias_on_mesh():
    # the model's conv has no bias: check the op's bias path (split on its channel axis) here,
    # on a TP-2 mesh against the same op on one device
    from mambacache.parallel.mesh import make_mesh
    from pallas_kernels import ops
    r = np.random.default_rng(1)
    x, w = r.standard_normal((12, 16), np.float32), r.standard_normal((4, 16), np.float32)
    bias, pool = r.standard_normal(16, np.float32), r.standard_normal((5, 3, 16), np.float32)
    i32 = lambda *v: np.asarray(v, np.int32)
    ext = (x, w, bias, pool, i32(0, 5, 12), i32(1, 0), i32(2, 3), i32(1), i32(3), i32(4))
    dec = (x[:2], w, bias, pool, i32(1, 0), i32(2, 3))
    err = 0.0
    for op, args in ((ops.causal_conv1d_extend, ext), (ops.causal_conv1d_decode, dec)):
        want = op(*args, impl="pallas")
        got = op(*args, impl="pallas", mesh=make_mesh(2))
        err = max([err] + [float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                           for a, b in zip(want, got, strict=True)])
    return err


result = {"conv_bias_err": conv_bias_on_mesh()}
for tp in tps:
    kernels = "reference" if tp == 1 else "pallas"
    cfg = mc.EngineConfig().replace(**{**base, "parallel.tensor_parallel": tp,
                                       "model.kernels": kernels})
    engine = Engine(cfg, model=(model_cfg, params))
    seen, fns = recording(engine.runner)
    outs = engine.generate(prompts, sp) + engine.generate(prompts[:1], sp)
    engine.check_integrity()
    pools = engine.runner.pools
    shards = [s.data.shape for s in pools.ssm[0].addressable_shards]
    result[tp] = dict(tokens=[o.output_token_ids for o in outs],
                      logprobs=[o.output_logprobs for o in outs],
                      cached=[o.cached_tokens for o in outs], ssm_shards=[list(s) for s in shards],
                      programs=sorted(str(d) for d in seen))
    if tp in hlo_tps:
        found, regions = inspect_programs(seen, fns, pools)
        result[tp].update(full_pool_shapes=found, shard_map_regions=regions)
# one shard_map region per kernel op, plus one per MoE layer (routed experts, models/moe.py)
result["kernel_ops_per_step"] = sum(2 if kind == "linear_attention" else 1
                                    for kind in model_cfg.layer_types) + sum(
    t == "moe" for t in model_cfg.mlp_types)
print(json.dumps(result))
"""

# family -> (TP degrees run through the engine, TP degrees whose compiled step is inspected);
# TP 1 is the references on one device, the baseline of every family
_RUNS = {"tpu": ("1,2,4", "2"), "gpu": ("2", "2")}
_CASES = [("tpu", "2"), ("tpu", "4"), ("gpu", "2")]


@pytest.fixture(scope="module")
def runs() -> dict:
    """Both families' workers, started together (each is mostly single-threaded compiles)."""
    # interpreted (PALLAS_INTERPRET unset): CPU is neither family's backend
    procs = {family: start_worker(_WORKER, tps, hlo_tps, env={"PALLAS_FAMILY": family},
                                  unset=("PALLAS_INTERPRET",))
             for family, (tps, hlo_tps) in _RUNS.items()}
    return {family: finish_worker(proc, family) for family, proc in procs.items()}


@pytest.mark.parametrize(("family", "tp"), _CASES)
def test_pallas_tensor_parallel_matches_one_device_reference(runs, family, tp):
    ref, got = runs["tpu"]["1"], runs[family][tp]
    assert ref["cached"][-1] > 0  # the repeated prompt hits a snapshot
    assert got["programs"] == ["False", "True"], got["programs"]  # extend and decode ran
    assert got["tokens"] == ref["tokens"]
    assert got["cached"] == ref["cached"]
    for a, b in zip(ref["logprobs"], got["logprobs"], strict=True):
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) <= 1e-4
    # value heads split over the mesh: 8 / tp per device
    assert [s[1] for s in got["ssm_shards"]] == [8 // int(tp)] * int(tp)


@pytest.mark.parametrize("family", sorted(_RUNS))
def test_conv_bias_split_on_mesh(runs, family):
    assert runs[family]["conv_bias_err"] <= 1e-6


@pytest.mark.parametrize("family", sorted(_RUNS))
def test_compiled_step_never_holds_a_whole_pool(runs, family):
    """Every kernel op of the step is a shard_map region, and no full-size pool shape appears in
    the partitioned program (GSPMD gathers the pools around an opaque kernel: the tpu family's
    interpreted extend did so before the kernels ran in shard_map)."""
    run = runs[family]
    for tp in _RUNS[family][1].split(","):
        regions, found = run[tp]["shard_map_regions"], run[tp]["full_pool_shapes"]
        per_step = run["kernel_ops_per_step"]
        assert regions == {"False": per_step, "True": per_step}, (tp, regions)
        assert found == {"False": [], "True": []}, (tp, found)
