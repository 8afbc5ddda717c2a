"""Tensor parallel on a CPU mesh: TP 2 and 4 give the greedy tokens of one device (logprobs within
1e-4); Orbax params restore straight onto the mesh without a whole copy on one device.

The default run checks TP 2 against one device; TP 4 (the sweep) runs with `-m slow`.

XLA_FLAGS must be set before jax initialises, so the mesh checks run in a subprocess (4 host
devices); validation runs in process.
"""

from __future__ import annotations

import pytest

from mambacache.parallel.mesh import param_spec, validate_tensor_parallel
from models.presets import get_preset
from tests.multidevice import (
    TP_WORKLOAD,
    assert_matches_one_device,
    finish_worker,
    run_worker,
    start_worker,
)

_WORKER = """
import json, re, sys, tempfile
import jax, numpy as np
import mambacache as mc
from mambacache.parallel.checkpoint import restore_params, save_params
from mambacache.engine.engine import Engine
from mambacache.parallel.mesh import make_mesh, per_device_bytes
from models.params import init_params
from models.presets import get_preset

""" + TP_WORKLOAD + """
model_cfg = get_preset("tiny_qwen3_next_tp4")
params = init_params(model_cfg, seed=3)
result = {}
hlo = {}


def record_hlo(fn, tp):
    def wrapped(*args):  # the compiled extend step's HLO, once per TP degree
        hlo.setdefault(tp, fn.lower(*args).compile().as_text())
        return fn(*args)
    return wrapped


def collectives(text):
    # region/kind -> count of the collectives in compiled HLO text; the region comes from the
    # instruction's stack frame chain: mixer (gated_delta_net / full_attention), mlp, sample
    def section(name):
        m = re.search("\\n%s\\n(.*?)\\n\\n" % name, text, re.S)
        return m.group(1).splitlines() if m else []
    funcs = {l.split()[0]: l.split(None, 1)[1].strip('\"') for l in section("FunctionNames")}
    locs = {l.split()[0]: funcs[re.search(r"function_name_id=(\\d+)", l)[1]]
            for l in section("FileLocations")}
    frames = {}  # id -> (function, parent id); the text prints parent ids one higher
    for l in section("StackFrames"):
        m = re.match(r"(\\d+) \\{file_location_id=(\\d+) parent_frame_id=(\\d+)", l)
        frames[int(m[1])] = (locs[m[2]], int(m[3]) - 1)
    counts = {}
    for m in re.finditer(r"[^%\\w.-](all-reduce|all-gather|all-to-all|collective-permute|"
                         r"reduce-scatter)(?:-start)?\\((.*)", text):
        f, fns = re.search(r"stack_frame_id=(\\d+)", m[2]), set()
        f = int(f[1]) if f else None
        for _ in range(500):  # walk to the root frame
            if f not in frames:
                break
            fns.add(frames[f][0])
            f = frames[f][1]
        where = ("mixer" if fns & {"gated_delta_net", "full_attention"} else
                 "mlp" if "_mlp" in fns else "sample" if "sample" in fns else "other")
        counts[where + "/" + m[1]] = counts.get(where + "/" + m[1], 0) + 1
    return counts


for tp in [int(a) for a in sys.argv[1:]]:
    cfg = mc.EngineConfig().replace(**{**base, "parallel.tensor_parallel": tp})
    engine = Engine(cfg, model=(model_cfg, params))
    engine.runner._fns[False] = record_hlo(engine.runner._fns[False], tp)
    outs = engine.generate(prompts, sp) + engine.generate(prompts[:1], sp)
    shard = engine.runner.pools.ssm[0].addressable_shards[0].data.shape
    result[tp] = dict(tokens=[o.output_token_ids for o in outs],
                      logprobs=[o.output_logprobs for o in outs],
                      cached=[o.cached_tokens for o in outs], ssm_shard=list(shard),
                      whole_experts=[t for t in ("f32[8,64,64]", "f32[8,32,64]") if t in hlo[tp]],
                      collectives=collectives(hlo[tp]))
    engine.check_integrity()
with tempfile.TemporaryDirectory() as d:
    save_params(d, model_cfg, params)
    _, restored = restore_params(d, make_mesh(4))
full = sum(x.nbytes for x in jax.tree.leaves(params))
result["full_bytes"] = full
result["per_device_bytes"] = per_device_bytes(restored)
result["same"] = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in
                     zip(jax.tree.leaves(params), jax.tree.leaves(restored)))
print(json.dumps(result))
"""


@pytest.fixture(scope="module")
def mesh_run():
    return run_worker(_WORKER, "1", "2")


@pytest.fixture(scope="module")
def mesh_run_tp4():
    return run_worker(_WORKER, "1", "4")


def _runs(request, tp: str) -> dict:
    return request.getfixturevalue("mesh_run_tp4" if tp == "4" else "mesh_run")


TPS = ["2", pytest.param("4", marks=pytest.mark.slow)]


@pytest.mark.parametrize("tp", TPS)
def test_tensor_parallel_matches_one_device(request, tp):
    mesh_run = _runs(request, tp)
    ref, got = mesh_run["1"], mesh_run[tp]
    assert_matches_one_device(ref, got)
    assert got["ssm_shard"][1] == 8 // int(tp)  # value heads split over the mesh
    # no device holds a whole expert tensor (gate_up [E=8, H=64, 2I=64], down [8, 32, 64]); the
    # one-device step does, which shows the HLO shapes are the ones searched for
    assert got["whole_experts"] == [] and len(ref["whole_experts"]) == 2


def test_orbax_restore_onto_mesh_is_sharded(mesh_run):
    full, per_dev = mesh_run["full_bytes"], mesh_run["per_device_bytes"]
    assert mesh_run["same"]
    assert len(per_dev) == 4
    # every device holds well under the whole model (replicated norms/router are small)
    assert max(per_dev.values()) < 0.4 * full, (per_dev, full)


def test_validation_names_value_and_limit():
    cfg = get_preset("tiny_qwen3_next")  # num_key_value_heads = 2
    validate_tensor_parallel(cfg, 2, num_devices=4)
    with pytest.raises(ValueError, match=r"tensor_parallel=4 must divide .*num_key_value_heads"):
        validate_tensor_parallel(cfg, 4, num_devices=4)
    with pytest.raises(ValueError, match="exceeds the 1 available"):
        validate_tensor_parallel(cfg, 2, num_devices=1)
    with pytest.raises(ValueError, match="positive int"):
        validate_tensor_parallel(cfg, 0, num_devices=1)


def test_param_specs():
    assert tuple(param_spec(("layers", "0", "gdn", "out_proj"), (64, 64), 2)) == ("tp", None)
    moe = param_spec(("layers", "0", "moe", "gate_up"), (8, 64, 64), 2)
    assert tuple(moe) == ("tp", None, None)
    assert tuple(param_spec(("layers", "0", "mlp", "gate_up"), (64, 256), 2)) == (None, "tp")
    assert tuple(param_spec(("final_norm",), (64,), 2)) == ()
    assert tuple(param_spec(("layers", "0", "gdn", "A_log"), (3,), 2)) == ()  # not divisible


@pytest.mark.parametrize("tp", TPS)
def test_mixers_need_no_reshard(request, tp):
    """Group-major ``in_proj`` / ``conv_w`` / ``qkv_proj`` (``models/params.py``): a contiguous
    column split hands each device whole key / KV head groups, so the compiled extend step's
    mixers hold only their row-parallel all-reduce (one per layer: out_proj / o_proj). With the
    part-major layout (q | k | v | z | b | a) GSPMD put 24 collective-permutes into the TP-2
    mixers; the sampler's gathers over the vocab split are outside the layers."""
    mesh_run = _runs(request, tp)
    counts = mesh_run[tp]["collectives"]
    print(f"TP {tp} extend step collectives (region/kind: count): {counts}")
    mixer = {k: v for k, v in counts.items() if k.startswith("mixer/")}
    assert mixer == {"mixer/all-reduce": 4}, counts  # 4 layers; proves the regions resolve too
    layers = [k for k in counts if k.split("/")[0] in ("mixer", "mlp")]
    assert not [k for k in layers if k.split("/")[1] in ("all-gather", "all-to-all")], counts
    # pair-interleaved dense gate_up / shared_gate_up: the MLPs need only their all-reduce too
    # (with gate | up, TP 2 had 8 collective-permutes here)
    assert {k for k in counts if k.startswith("mlp/")} <= {"mlp/all-reduce"}, counts
    assert mesh_run["1"]["collectives"] == {}, mesh_run["1"]["collectives"]


def test_worker_past_its_timeout_is_killed():
    """A mesh worker that hangs fails its test and is not left running behind it."""
    proc = start_worker("import time; time.sleep(60)")
    with pytest.raises(AssertionError, match="still running after 1 s, killed"):
        finish_worker(proc, "sleeper", timeout=1)
    assert proc.poll() is not None
