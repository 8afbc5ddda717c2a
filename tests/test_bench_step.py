"""The step benchmark (``mambacache.bench.step``): its byte / FLOP model by hand on a tiny MoE
preset, and the CLI end to end on CPU (no roofline there: the device is not in the table)."""

from __future__ import annotations

import json
import math

import jax
import pytest

from mambacache.bench import step, step_cost
from models.params import init_params, param_shapes
from models.presets import PRESETS

CFG = PRESETS["tiny_qwen3_5_moe"]


def _sizes():
    """(all parameter elements, expert elements, embedding elements) of the tiny preset."""
    leaves = list(step_cost.param_leaves(CFG))
    total = sum(math.prod(s) for _, s in leaves)
    experts = sum(math.prod(s) for n, s in leaves if step_cost._is_expert(n, s, CFG))
    embed = sum(math.prod(s) for n, s in leaves if n[-1] == "embed")
    return total, experts, embed


def test_touched_experts():
    assert step_cost.touched_experts(1, 256, 8) == pytest.approx(8)
    assert step_cost.touched_experts(10_000, 256, 8) == pytest.approx(256)
    # 64 decode rows of Qwen3.5-35B-A3B touch about 222 of 256 experts
    assert step_cost.touched_experts(64, 256, 8) == pytest.approx(222.44, abs=0.01)


def test_weight_bytes_count_only_touched_experts():
    """One token reads the dense weights whole, its own k of E experts and one embedding row;
    its FLOPs are 2 x the active matrix parameters (the LM head at its one logit row)."""
    total, experts, embed = _sizes()
    e, k, h = CFG.num_experts, CFG.num_experts_per_tok, CFG.hidden_size
    cost = step_cost.weights_cost(CFG, 1, 1, 4)
    assert cost.weight_bytes == pytest.approx(4 * (total - embed - experts * (1 - k / e) + h))
    vectors = sum(math.prod(s) for n, s in step_cost.param_leaves(CFG) if len(s) < 2)
    assert cost.flops == pytest.approx(2 * (total - embed - vectors - experts * (1 - k / e)))
    many = step_cost.weights_cost(CFG, 100_000, 1, 2)
    assert many.weight_bytes == pytest.approx(2 * (total - embed + 100_000 * h), rel=1e-9)


def test_decode_kv_and_state_bytes():
    """Rows x (context + 1) keys read / written per attention layer, each state read and
    written once per linear layer."""
    rows, ctx = 3, 10
    cost = step_cost.decode_cost(CFG, rows, ctx, 4)
    row = math.prod(CFG.kv_row_shape) * 2 * 4
    assert cost.kv_bytes == pytest.approx(CFG.num_full_layers * rows * (ctx + 2) * row)
    ssm = (CFG.linear_num_value_heads * CFG.linear_key_head_dim * CFG.linear_value_head_dim * 4
           + (CFG.linear_conv_kernel_dim - 1) * CFG.linear_conv_dim * 4)
    assert cost.state_bytes == pytest.approx(CFG.num_linear_layers * 2 * rows * ssm)


def test_random_params_have_the_model_shapes():
    params = step.random_params(CFG, jax.numpy.bfloat16)
    want = init_params(CFG)
    assert all(a.dtype == jax.numpy.bfloat16 for a in jax.tree.leaves(params))
    assert jax.tree.map(lambda a: a.shape, params) == jax.tree.map(lambda a: a.shape, want)
    assert param_shapes(CFG)["embed"] == params["embed"].shape


def test_cli_on_cpu(tmp_path):
    out = tmp_path / "r.json"
    result = step.main(["--preset", "tiny_qwen3_5_moe", "--rows", "3", "--context", "20",
                        "--prefill", "2x9", "--kernels", "reference", "--dtype", "float32",
                        "--iters", "1", "--page-size", "8", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert set(result["steps"]) == {"decode/reference", "prefill/reference"}
    assert set(result["moe"]) == {f"{t}/{f}" for t in (3, 18) for f in step.MOE_FORMS}
    for entry in list(result["steps"].values()) + list(result["moe"].values()):
        assert entry["ms"] > 0 and entry["bytes"] > 0 and entry["flops"] > 0
        assert entry["floor_ms"] is None and entry["roofline_fraction"] is None   # CPU
    assert result["steps"]["prefill/reference"]["flops"] > result["steps"][
        "decode/reference"]["flops"]


def test_bad_prefill_is_named(capsys):
    with pytest.raises(SystemExit):
        step.parse_args(["--preset", "tiny_qwen3_5_moe", "--prefill", "4by512"])
    assert "--prefill must be NxL (e.g. 4x512), got '4by512'" in capsys.readouterr().err


def test_moe_layer_flops_are_the_active_ones():
    """The MoE alone: ``2 T (k / E experts + router + shared)`` FLOPs whatever T (all experts
    touched or not); bytes count only the touched experts."""
    shapes = param_shapes(CFG)["layers"][0]["moe"]
    e, k = CFG.num_experts, CFG.num_experts_per_tok
    experts = math.prod(shapes["gate_up"]) + math.prod(shapes["down"])
    rest = sum(math.prod(s) for n, s in shapes.items() if n not in ("gate_up", "down"))
    for tokens in (1, 1000):
        cost = step_cost.moe_layer_cost(CFG, shapes, tokens, 2)
        assert cost.flops == pytest.approx(2 * tokens * (experts * k / e + rest))
        touched = step_cost.touched_experts(tokens, e, k)
        want = 2 * (experts * touched / e + rest + 2 * tokens * CFG.hidden_size)
        assert cost.weight_bytes == pytest.approx(want)


def test_weights_that_do_not_fit_are_named():
    class Device:
        def memory_stats(self):
            return {"bytes_limit": 1000}

    with pytest.raises(ValueError, match=r"the weights \(0\.0 GB\) exceed 90% of the device's "
                                         r"0\.0 GB"):
        step.check_fits(CFG, 2, Device())
    step.check_fits(CFG, 2, jax.devices()[0])   # CPU: no limit reported, or plenty
