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
    used = (p["num_mamba_slots"] * p["state_slot_bytes"]
            + p["num_kv_tokens"] // 4 * p["kv_page_bytes"])
    assert p["cache_budget_bytes"] - p["kv_page_bytes"] < used <= p["cache_budget_bytes"]
    assert "num_kv_tokens" in capsys.readouterr().out


def test_plan_exits_1_when_the_budget_holds_too_few_slots(tmp_path, capsys):
    rc, p = _run(tmp_path, "h200:1", "--set", "cache.memory_fraction=0.0000001")
    assert rc == 1 and not p["fits"]
    assert "fewer than max_running_requests + 1 = 17" in p["reason"]
    assert "NO:" in capsys.readouterr().out


def test_plan_exits_1_with_the_numbers_when_weights_exceed_hbm(tmp_path, capsys):
    # the tiny model widened to ~0.19 TB of fp32 weights: more than one H200 holds
    rc, p = _run(tmp_path, "h200:1", "--set", "model.preset=tiny_qwen3_next",
                 "--set", "cache.page_size=16")
    assert rc == 0
    big = sizing.cache_budget_bytes(141 * 10**9, 190 * 10**9, 0, 0.9)
    assert big == -49 * 10**9  # negative: by how much, never clamped
    from mambacache.parallel import plan as plan_mod

    reason = plan_mod.verdict(dict(p, weight_bytes=190 * 10**9, step_bytes=10**9))[1]
    assert "exceed the 141.00 GB of HBM by 50.00 GB" in reason


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
    from mambacache.engine.pools import PoolState

    cfg = get_preset("tiny_qwen3_next")
    mesh = make_mesh(1)
    slot, page = sizing.unit_bytes(cfg, mesh, 4, jnp.float32)
    a = PoolState.create(cfg, 3, 4, 5).nbytes()
    b = PoolState.create(cfg, 5, 4, 8).nbytes()
    assert b["mamba"] - a["mamba"] == 3 * slot and b["full"] - a["full"] == 2 * page


def test_pool_sizes_split_the_budget():
    slots, tokens = sizing.pool_sizes_from_budget(10_000, 100, 64, page_size=4)
    assert slots == 30 and tokens == (10_000 - 3_000) // 64 * 4
    assert sizing.pool_sizes_from_budget(-5, 100, 64, page_size=4) == (0, 0)
    assert sizing.pool_sizes_from_budget(1000, 0, 64, page_size=4) == (0, 1000 // 64 * 4)


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
