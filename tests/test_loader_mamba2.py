"""Loading Nemotron-H / Granite 4.0-H checkpoints and configs: names, layouts, sharded bf16
files, fused vs per-expert tensors, the released config spellings, and a ``ValueError`` naming
every config field we do not implement."""

from __future__ import annotations

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.flax import save_file as save_jax
from test_loader import FIXTURES, assert_same_params, copy_with, read_all

from models import ModelConfig, load_checkpoint
from models.families.mamba2_common import mamba_conv_channel_order


def hf_config(name: str) -> dict:
    return json.loads((FIXTURES / name / "config.json").read_text())


def test_nemotron_layout_and_conv_order():
    cfg, params = load_checkpoint(FIXTURES / "nemotron_h", jnp.float32)
    tensors = read_all(FIXTURES / "nemotron_h")
    # conv channels group-major: group j = x_j (r*P) | B_j (N) | C_j (N); HF's are x | B | C
    order = mamba_conv_channel_order(cfg)
    hp, gn = 8 * 4, 2 * 8
    assert list(order[:16]) == list(range(16)) and list(order[16:24]) == list(range(hp, hp + 8))
    assert list(order[24:32]) == list(range(hp + gn, hp + gn + 8))
    w = tensors["backbone.layers.0.mixer.conv1d.weight"][:, 0, :].T
    np.testing.assert_array_equal(np.asarray(params["layers"][0]["mamba"]["conv_w"]), w[:, order])
    assert set(params["layers"][1]) == {"input_norm", "moe"}  # one sublayer per block
    assert set(params["layers"][3]) == {"input_norm", "mlp"}


def test_sharded_bf16_nemotron_equals_single_cast(tmp_path):
    tensors = read_all(FIXTURES / "nemotron_h")
    out = tmp_path / "sharded"
    out.mkdir()
    shutil.copy(FIXTURES / "nemotron_h" / "config.json", out / "config.json")
    keys = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": keys[::2],
              "model-00002-of-00002.safetensors": keys[1::2]}
    for fname, ks in shards.items():
        save_jax({k: jnp.asarray(tensors[k], jnp.bfloat16) for k in ks}, str(out / fname))
    weight_map = {k: f for f, ks in shards.items() for k in ks}
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert_same_params(load_checkpoint(out, jnp.float32)[1],
                       load_checkpoint(FIXTURES / "nemotron_h", jnp.bfloat16)[1])


def test_fused_names_equal_released_names(tmp_path):
    """transformers 5 in-memory names (model., fused experts, router.weight) == released ones."""
    tensors = read_all(FIXTURES / "nemotron_h")
    fused = {k.replace("backbone.", "model."): v for k, v in tensors.items()
             if ".experts." not in k}
    for layer in (1, 5):
        pre = f"backbone.layers.{layer}.mixer.experts."
        for part in ("up_proj", "down_proj"):
            fused[f"model.layers.{layer}.mixer.experts.{part}"] = np.stack(
                [tensors[f"{pre}{e}.{part}.weight"] for e in range(4)])
    a = load_checkpoint(copy_with(tmp_path, "nemotron_h", fused))[1]
    assert_same_params(a, load_checkpoint(FIXTURES / "nemotron_h")[1])
    tensors = read_all(FIXTURES / "granitemoehybrid")
    renamed = {}
    moe = "block_sparse_moe."
    for k, v in tensors.items():
        k = (k.replace(moe + "input_linear.weight", moe + "experts.gate_up_proj")
             .replace(moe + "output_linear.weight", moe + "experts.down_proj")
             .replace("router.layer.weight", "router.weight"))
        renamed[k] = v
    b = load_checkpoint(copy_with(tmp_path, "granitemoehybrid", renamed))[1]
    assert_same_params(b, load_checkpoint(FIXTURES / "granitemoehybrid")[1])


def test_hybrid_override_pattern_and_legacy_names():
    hf = hf_config("nemotron_h")
    del hf["layers_block_type"]
    hf["hybrid_override_pattern"] = "ME*-ME"
    cfg = ModelConfig.from_hf_config(hf)
    assert cfg.layer_types == ModelConfig.from_hf_config(hf_config("nemotron_h")).layer_types
    assert cfg.time_step_limit == (0.02, float("inf"))  # transformers: (time_step_min, inf)
    hf["hybrid_override_pattern"] = "M?*"
    with pytest.raises(ValueError, match=r"unknown symbols \['\?'\]"):
        ModelConfig.from_hf_config(hf)
    older = {k: v for k, v in hf_config("nemotron_h").items() if k != "head_dim"}
    assert ModelConfig.from_hf_config({**older, "attention_head_dim": 16}).head_dim == 16
    granite = hf_config("granitemoehybrid")
    granite["layer_types"] = ["mamba", "mamba", "attention", "mamba"]  # released spelling
    assert ModelConfig.from_hf_config(granite).num_linear_layers == 3


@pytest.mark.parametrize("name, field, value", [
    ("nemotron_h", "use_bias", True), ("nemotron_h", "mlp_hidden_act", "gelu"),
    ("nemotron_h", "moe_latent_size", 16), ("nemotron_h", "use_conv_bias", False),
    ("nemotron_h", "sliding_window", 128), ("granitemoehybrid", "mamba_proj_bias", True),
    ("granitemoehybrid", "hidden_act", "gelu"), ("granitemoehybrid", "attention_bias", True),
])
def test_unsupported_fields_are_named(name, field, value):
    hf = {**hf_config(name), field: value}
    with pytest.raises(ValueError, match=f"unsupported config values .*'{field}'"):
        ModelConfig.from_hf_config(hf)


def test_inconsistent_sizes_are_value_errors():
    hf = {**hf_config("granitemoehybrid"), "mamba_d_head": 5}
    with pytest.raises(ValueError, match=r"mamba_d_head \(5\) \* mamba_n_heads \(8\) must equal"):
        ModelConfig.from_hf_config(hf)
    hf = {**hf_config("nemotron_h"), "n_groups": 3}
    with pytest.raises(ValueError, match=r"Mamba2 heads \(8\) must be a multiple of n_groups \(3"):
        ModelConfig.from_hf_config(hf)


@pytest.mark.parametrize("name", ["nemotron_h", "granitemoehybrid"])
def test_hf_to_orbax_round_trip(tmp_path, name):
    from mambacache.parallel.checkpoint import convert_hf_to_orbax, restore_params

    cfg = convert_hf_to_orbax(FIXTURES / name, tmp_path / "orbax")
    cfg2, params = restore_params(tmp_path / "orbax")
    ref_cfg, ref = load_checkpoint(FIXTURES / name)
    assert cfg == cfg2 == ref_cfg  # time_step_limit's inf and the multipliers survive
    assert_same_params(params, ref)
