"""``python -m mambacache.plan`` and the sizing it shares with the engine (``parallel/sizing.py``).

CI: the tiny preset on ``h200:1`` (arithmetic, no compile): the JSON fields and their arithmetic,
the exit-1 paths (a budget that holds too few slots; weights over the HBM), unit sizes against
real pools. Behind ``-m aot`` (libtpu; minutes): the tiny step compiled on ``v6e:2x2``, and the
real-size rows of ``docs/parallel.md``::

    pytest -q -p no:cacheprovider -m aot tests/test_plan.py
"""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import pytest

from mambacache.config import EngineConfig
from mambacache.parallel import sizing
from mambacache.parallel.mesh import make_mesh, replicate_kv_heads
from mambacache.parallel.plan import main
from mambacache.parallel.topology import parse_topology
from models.presets import get_preset

FIELDS = ("fits", "hbm_bytes", "weight_bytes", "temp_bytes", "num_mamba_slots", "num_kv_tokens")


def _run(tmp_path, *args: str) -> tuple[int, dict]:
    out = tmp_path / "plan.json"
    rc = main(["--topology", *args, "--out", str(out)])
    return rc, json.loads(out.read_text()) if out.exists() else {}


def test_plan_json_fields_and_budget_arithmetic(tmp_path, capsys):
    rc, p = _run(tmp_path, "h200:1", "--set", "cache.page_size=4")
    assert rc == 0 and p["fits"], p
    assert all(k in p for k in FIELDS)
    params = sizing.abstract_params(get_preset("tiny_qwen3_next"), jnp.float32)
    assert p["weight_bytes"] == sum(math.prod(x.shape) * 4 for x in jax.tree.leaves(params))
    left = p["hbm_bytes"] - p["weight_bytes"] - p["step_bytes"]
    assert p["cache_budget_bytes"] == int(left * 0.9)
    # as the engine sizes device pools (engine.pools.size_pools, physical): the reserved page 0
    # and slot 0 off the budget, then device_state_share of the rest to state slots
    from mambacache.cache.budget import device_state_share

    slot, page = p["state_slot_bytes"], p["kv_page_bytes"]
    usable = p["cache_budget_bytes"] - page - slot
    share = device_state_share(slot, page, 4)
    assert p["num_mamba_slots"] == int(usable * share) // slot
    assert p["num_kv_tokens"] == (usable - p["num_mamba_slots"] * slot) // page * 4
    assert "num_kv_tokens" in capsys.readouterr().out


def test_plan_exits_1_when_the_budget_cannot_hold_the_running_requests(tmp_path, capsys):
    rc, p = _run(tmp_path, "h200:1", "--set", "cache.memory_fraction=0.0000001")
    assert rc == 1 and not p["fits"]
    assert "it needs max_running_requests = 16 slots and one context of 4096" in p["reason"]
    assert "NO:" in capsys.readouterr().out


def test_plan_exits_1_with_the_numbers_when_weights_exceed_hbm(tmp_path, capsys):
    # Qwen3-Next-80B-A3B in bf16 (159.3 GB of weights) on one H200: no compile needed to say no
    rc, p = _run(tmp_path, "h200:1", "--set", "model.preset=qwen3_next_80b_a3b",
                 "--set", "model.dtype=bfloat16", "--context-len", "4096")
    assert rc == 1 and not p["fits"] and p["temp_source"] == "estimate (not compiled)"
    from models.sizes import model_sizes

    sizes = model_sizes(get_preset("qwen3_next_80b_a3b"), jnp.bfloat16)
    assert p["weight_bytes"] == sizes.weight_bytes > 159e9
    short = p["weight_bytes"] + p["step_bytes"] - 141 * 10**9
    assert f"exceed the 141.00 GB of HBM by {short / 1e9:.2f} GB" in p["reason"]
    assert p["cache_budget_bytes"] == -short  # negative: by how much, never clamped


def test_bad_topologies_and_tp_are_errors_naming_the_value(tmp_path, capsys):
    with pytest.raises(ValueError, match="'v9z:2x2'"):
        parse_topology("v9z:2x2")
    with pytest.raises(ValueError, match="'2x'"):
        parse_topology("v6e:2x")
    assert parse_topology("v5p:2x2x1").num_devices == 4
    assert parse_topology("h200:8").num_devices == 8 and not parse_topology("h200:8").compiled
    rc, _ = _run(tmp_path, "h200:2", "--set", "parallel.tensor_parallel=4")
    assert rc == 1 and "exceeds the 2 available" in capsys.readouterr().out


def test_kv_heads_repeat_when_tp_exceeds_them():
    cfg = get_preset("tiny_qwen3_next_tp4")  # 8 query heads, 4 KV heads
    assert replicate_kv_heads(cfg, 8).num_key_value_heads == 8
    assert replicate_kv_heads(cfg, 4) is cfg and replicate_kv_heads(cfg, 2) is cfg
    assert replicate_kv_heads(get_preset("tiny_kimi_linear"), 8).num_key_value_heads == 4


def test_unit_bytes_match_real_pools():
    from mambacache.engine.runners.pools import PoolState

    cfg = get_preset("tiny_qwen3_next")
    mesh = make_mesh(1)
    slot, page = sizing.unit_bytes(cfg, mesh, 4, jnp.float32)
    a = PoolState.create(cfg, 3, 4, 5).nbytes()
    b = PoolState.create(cfg, 5, 4, 8).nbytes()
    assert b["mamba"] - a["mamba"] == 3 * slot and b["full"] - a["full"] == 2 * page


def test_largest_step_shapes_follow_the_runner_buckets():
    cfg = EngineConfig.load(None, {"scheduler.max_running_requests": 12,
                                   "scheduler.chunked_prefill_size": 100, "cache.page_size": 8})
    shapes = sizing.largest_step_shapes(cfg, get_preset("tiny_qwen3_next"))
    pre, dec = shapes["prefill"], shapes["decode"]
    assert (pre.num_tokens, pre.num_seqs, pre.num_pages_per_seq) == (128, 16, 512)  # 4096 / 8
    assert (dec.num_tokens, dec.num_seqs, dec.decode) == (16, 16, True)


@pytest.mark.aot
def test_tiny_step_compiles_on_a_tpu_topology(tmp_path):
    rc, p = _run(tmp_path, "v6e:2x2", "--set", "cache.page_size=16",
                 "--set", "scheduler.max_running_requests=4", "--context-len", "1024")
    assert rc == 0 and p["compiled"] and p["temp_source"] == "compiler"
    assert set(p["programs"]) == {"prefill", "decode"}
    assert p["programs"]["prefill"]["temp_bytes"] > 0 and p["roofline"]["decode"]["seconds"] > 0


@pytest.mark.aot
def test_step_temporaries_grow_far_less_than_the_pools(monkeypatch):
    """The plan compiles with small pools and adds the pools' bytes by arithmetic; the donated
    pools alias their outputs, so a larger pool adds at most a little to the temporaries (tiny
    decode on v6e, measured: 4,574,432 -> 5,597,376 bytes for 64 -> 1024 pages and 5 -> 80
    slots), well inside the budget's 1 - memory_fraction headroom."""
    import dataclasses

    import numpy as np
    from jax.sharding import Mesh

    from mambacache.parallel.mesh import pool_shardings
    from mambacache.parallel.topology import compile_devices

    monkeypatch.setenv("PALLAS_FAMILY", "tpu")
    monkeypatch.setenv("PALLAS_INTERPRET", "0")
    cfg = EngineConfig.load(None, {"scheduler.max_running_requests": 4, "cache.page_size": 16})
    model_cfg = dataclasses.replace(get_preset("tiny_qwen3_next"), max_position_embeddings=1024)
    mesh = Mesh(np.asarray(compile_devices("v6e:2x2")[:1]), ("tp",))
    params = sizing.abstract_params(model_cfg, jnp.bfloat16)
    shape = sizing.largest_step_shapes(cfg, model_cfg)["decode"]
    temps, pool_bytes = [], []
    for pages, slots in ((64, 5), (1024, 80)):
        pools = sizing.abstract_pools(model_cfg, pages, 16, slots, jnp.bfloat16)
        pool_bytes.append(sizing.laid_out_bytes(pools, pool_shardings(pools, mesh)))
        temps.append(sizing.compile_step(model_cfg, shape, params=params, pools=pools,
                                         page_size=16, kernels="pallas", mesh=mesh).temp_bytes)
    assert temps[1] - temps[0] < 0.1 * (pool_bytes[1] - pool_bytes[0]), (temps, pool_bytes)


def test_device_report_folds_fractions_of_roofline(tmp_path):
    import subprocess
    import sys

    kernels = dict(device="NVIDIA H200", roofline=[4.8e12, {"bfloat16": 989e12, "float32": None}],
                   rows=[dict(op="gdr_extend", impl="pallas-gpu", compute_dtype="bfloat16",
                              ms=1.0, bytes_per_s=2.4e12, flops_per_s=98.9e12),
                         dict(op="gdr_extend", impl="reference", compute_dtype="float32",
                              ms=3.0, bytes_per_s=1.2e12, flops_per_s=1e12)])
    (tmp_path / "kernels.json").write_text(json.dumps(kernels))
    (tmp_path / "steps.txt").write_text(
        "plan 0 12\nbench_cache_on_off 124 90\nstep_bench missing 0\n")
    (tmp_path / "agreement_bf16.json").write_text(json.dumps({"greedy": {"requests": 3}}))
    proc = subprocess.run([sys.executable, "scripts/device_report.py", str(tmp_path), "gpu"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    rep = json.loads((tmp_path / "device_check.json").read_text())
    pallas, ref = rep["kernels"]
    assert pallas["hbm_fraction"] == pytest.approx(0.5)
    assert pallas["flops_fraction"] == pytest.approx(0.1)
    assert ref["flops_fraction"] is None and ref["hbm_fraction"] == pytest.approx(0.25)
    assert rep["plan"] == "missing" and rep["backend"] == "gpu"
    assert rep["steps"]["bench_cache_on_off"] == {"status": 124, "seconds": 90}
    assert rep["steps"]["step_bench"]["status"] == "missing"
    assert rep["agreement_bf16"] == {"greedy": {"requests": 3}} and rep["step"] == "missing"


def test_local_sizing_needs_a_device_that_reports_memory():
    from mambacache.parallel.topology import local_topology

    if jax.default_backend() != "cpu":
        pytest.fail("this test expects the CPU backend of the test suite")
    with pytest.raises(ValueError, match="cache.memory_bytes"):
        local_topology()


# The rows of docs/parallel.md: bf16, page size 16; (preset, topology, TP, context). Each compiles
# the real step of a 27-98 layer model: many minutes on a loaded 2-core box.
REAL_ROWS = [("qwen3_next_80b_a3b", "v6e:2x4", 8, None),
             ("kimi_linear_48b_a3b", "v6e:2x2", 4, 32768),
             ("nemotron_h_47b", "v6e:2x4", 8, 32768)]


@pytest.mark.aot
@pytest.mark.parametrize("preset,topology,tp,context", REAL_ROWS)
def test_real_size_step_compiles_and_fits(tmp_path, preset, topology, tp, context):
    args = [topology, "--set", f"model.preset={preset}", "--set", "model.dtype=bfloat16",
            "--set", f"parallel.tensor_parallel={tp}", "--set", "cache.page_size=16"]
    rc, p = _run(tmp_path, *args, *(["--context-len", str(context)] if context else []))
    assert rc == 0 and p["fits"] and p["compiled"], p.get("reason")
    assert p["num_mamba_slots"] >= 16 and p["num_kv_tokens"] >= 16384
    assert p["weight_bytes"] + p["step_bytes"] < p["hbm_bytes"]


@pytest.mark.aot
def test_80b_bf16_on_v5e_2x4_is_an_error_with_the_numbers(tmp_path):
    rc, p = _run(tmp_path, "v5e:2x4", "--set", "model.preset=qwen3_next_80b_a3b",
                 "--set", "model.dtype=bfloat16", "--set", "parallel.tensor_parallel=8")
    assert rc == 1 and not p["fits"]
    assert "exceed the 16.91 GB of HBM by" in p["reason"]


@pytest.mark.slow
def test_device_cache_budget_is_the_plans_arithmetic_on_local_devices(monkeypatch):
    """The engine's entry (``sizing.device_cache_budget``) on this CPU with a stated HBM: the
    step compiled with the references, the budget (hbm - weights - step) x memory_fraction."""
    import dataclasses

    from mambacache.parallel import topology
    from models.params import init_params

    cfg = EngineConfig.load(None, {"scheduler.max_running_requests": 4,
                                   "scheduler.chunked_prefill_size": 32,
                                   "cache.memory_fraction": 0.5, "model.kernels": "reference"})
    model_cfg = dataclasses.replace(get_preset("tiny_qwen3_next"), max_position_embeddings=256)
    chip = topology.Chip("cpu", 10**9, 0.0, 0.0, 0.0, "local")
    monkeypatch.setattr(topology, "local_topology", lambda: topology.Topology("local", chip, 1))
    params = init_params(model_cfg, 0, jnp.float32)
    budget = sizing.device_cache_budget(cfg, model_cfg, params, make_mesh(1))
    weights = sum(x.nbytes for x in jax.tree.leaves(params))
    step = 10**9 - weights - 2 * budget
    assert 0 < step < 50 * 10**6, step  # the compiled step's temporaries + code, a few MB
