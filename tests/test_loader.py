"""``models.load_checkpoint`` and ``ModelConfig.from_hf_config`` on the committed tiny fixtures."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.flax import save_file as save_jax
from safetensors.numpy import save_file

from models import ModelConfig, load_checkpoint, param_shapes

FIXTURES = Path(__file__).parent / "fixtures"


def read_all(path: Path) -> dict[str, np.ndarray]:
    with safe_open(str(path / "model.safetensors"), framework="numpy") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def copy_with(tmp_path: Path, name: str, tensors: dict[str, np.ndarray]) -> Path:
    out = tmp_path / name
    out.mkdir()
    shutil.copy(FIXTURES / name / "config.json", out / "config.json")
    save_file(tensors, str(out / "model.safetensors"))
    return out


def assert_same_params(a, b) -> None:
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5", "qwen3_5_moe"])
def test_fixture_loads_with_expected_layout(name):
    cfg, params = load_checkpoint(FIXTURES / name, jnp.float32)
    assert cfg.family == name
    assert cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert (cfg.num_linear_layers, cfg.num_full_layers) == (3, 1)
    want = {"qwen3_next": ("moe", "moe", "dense", "moe"), "qwen3_5": ("dense",) * 4,
            "qwen3_5_moe": ("moe",) * 4}[name]
    assert cfg.mlp_types == want
    shapes = jax.tree_util.tree_leaves(param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple)
                                       and all(isinstance(d, int) for d in x))
    assert [tuple(p.shape) for p in jax.tree_util.tree_leaves(params)] == shapes
    assert all(p.dtype == jnp.float32 for p in jax.tree_util.tree_leaves(params))


def test_qwen3_next_in_proj_and_conv_are_grouped_per_key_head():
    cfg, params = load_checkpoint(FIXTURES / "qwen3_next", jnp.float32)
    raw = read_all(FIXTURES / "qwen3_next")
    qkvz = raw["model.layers.0.linear_attn.in_proj_qkvz.weight"]
    conv = raw["model.layers.0.linear_attn.conv1d.weight"][:, 0, :]  # HF channels q | k | v
    dk, dv, r, kd = cfg.linear_key_head_dim, cfg.linear_value_head_dim, 2, cfg.linear_key_dim
    group = 2 * dk + 2 * r * dv  # HF qkvz rows per key head
    col = group + 2 * r  # in_proj columns per key head: q k v z b a
    cw = 2 * dk + r * dv  # conv channels per key head: q k v
    gdn = params["layers"][0]["gdn"]
    in_proj, conv_w = np.asarray(gdn["in_proj"]), np.asarray(gdn["conv_w"])
    # k of key head 1 and v of value head 3 (= key head 1, second value head of its group)
    np.testing.assert_array_equal(in_proj[:, col + dk:col + 2 * dk].T,
                                  qkvz[group + dk:group + 2 * dk])
    v3 = in_proj[:, col + 2 * dk + dv:col + 2 * dk + 2 * dv].T
    np.testing.assert_array_equal(v3, qkvz[group + 2 * dk + dv:group + 2 * dk + 2 * dv])
    np.testing.assert_array_equal(conv_w[:, cw + dk:cw + 2 * dk].T, conv[kd + dk:kd + 2 * dk])
    np.testing.assert_array_equal(conv_w[:, cw + 2 * dk + dv:2 * cw].T,
                                  conv[2 * kd + 3 * dv:2 * kd + 4 * dv])


def test_missing_tensor_is_named(tmp_path):
    tensors = read_all(FIXTURES / "qwen3_5")
    del tensors["model.layers.1.linear_attn.dt_bias"]
    with pytest.raises(ValueError, match=r"model\.layers\.1\.linear_attn\.dt_bias.*missing"):
        load_checkpoint(copy_with(tmp_path, "qwen3_5", tensors))


def test_unexpected_tensor_is_named(tmp_path):
    tensors = read_all(FIXTURES / "qwen3_5")
    tensors["model.layers.0.linear_attn.bogus.weight"] = np.zeros(3, np.float32)
    tensors["mtp.layers.0.weight"] = np.zeros(3, np.float32)  # ignored like transformers does
    with pytest.raises(ValueError, match=r"unexpected.*linear_attn\.bogus\.weight"):
        load_checkpoint(copy_with(tmp_path, "qwen3_5", tensors))


def test_mtp_head_loads_when_asked(tmp_path):
    """``mtp.*`` (Qwen3-Next names) -> ``params["mtp"]``: the layer's tensors map as a full
    attention layer's do, ``fc`` transposed; ignored without ``mtp=True``; a ``ValueError``
    when asked for a head the checkpoint lacks."""
    tensors = read_all(FIXTURES / "qwen3_next")
    full = [k for k in tensors if k.startswith("model.layers.3.")]
    for k in full:
        tensors["mtp.layers.0." + k[len("model.layers.3."):]] = tensors[k]
    rng = np.random.default_rng(0)
    h = tensors["model.norm.weight"].shape[0]
    for name, shape in (("fc.weight", (h, 2 * h)), ("pre_fc_norm_embedding.weight", (h,)),
                        ("pre_fc_norm_hidden.weight", (h,)), ("norm.weight", (h,))):
        tensors["mtp." + name] = rng.normal(size=shape).astype(np.float32)
    path = copy_with(tmp_path, "qwen3_next", tensors)
    cfg, params = load_checkpoint(path, mtp=True)
    assert cfg.num_mtp_layers == 1
    mtp = params["mtp"]
    np.testing.assert_array_equal(mtp["fc"], tensors["mtp.fc.weight"].T)
    np.testing.assert_array_equal(mtp["hidden_norm"], tensors["mtp.pre_fc_norm_hidden.weight"])
    for kind in ("attn", "moe"):
        for name, w in params["layers"][3][kind].items():
            np.testing.assert_array_equal(mtp["layer"][kind][name], w)
    plain_cfg, plain = load_checkpoint(path)
    assert "mtp" not in plain and plain_cfg.num_mtp_layers == 0
    with pytest.raises(ValueError, match="MTP head"):
        load_checkpoint(FIXTURES / "qwen3_next", mtp=True)


def test_misshaped_tensor_names_expected_shape(tmp_path):
    tensors = read_all(FIXTURES / "qwen3_next")
    key = "model.layers.3.self_attn.k_proj.weight"
    tensors[key] = tensors[key][:-1]
    with pytest.raises(ValueError, match=r"k_proj\.weight.*\(31, 32\).*expected \(32, 32\)"):
        load_checkpoint(copy_with(tmp_path, "qwen3_next", tensors))


def test_sharded_checkpoint_equals_single(tmp_path):
    tensors = read_all(FIXTURES / "qwen3_next")
    out = tmp_path / "sharded"
    out.mkdir()
    shutil.copy(FIXTURES / "qwen3_next" / "config.json", out / "config.json")
    keys = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": keys[::2],
              "model-00002-of-00002.safetensors": keys[1::2]}
    for fname, ks in shards.items():
        save_file({k: tensors[k] for k in ks}, str(out / fname))
    weight_map = {k: f for f, ks in shards.items() for k in ks}
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert_same_params(load_checkpoint(out)[1], load_checkpoint(FIXTURES / "qwen3_next")[1])


def test_fused_expert_tensors_equal_per_expert(tmp_path):
    tensors = read_all(FIXTURES / "qwen3_5_moe")
    for layer in range(4):
        pre = f"model.layers.{layer}.mlp.experts."
        gate_up, down = [], []
        for e in range(4):
            g = tensors.pop(f"{pre}{e}.gate_proj.weight")
            gate_up.append(np.concatenate([g, tensors.pop(f"{pre}{e}.up_proj.weight")]))
            down.append(tensors.pop(f"{pre}{e}.down_proj.weight"))
        tensors[pre + "gate_up_proj"] = np.stack(gate_up)
        tensors[pre + "down_proj"] = np.stack(down)
    fused = load_checkpoint(copy_with(tmp_path, "qwen3_5_moe", tensors))[1]
    assert_same_params(fused, load_checkpoint(FIXTURES / "qwen3_5_moe")[1])


def test_bf16_checkpoint_and_bf16_params(tmp_path):
    tensors = read_all(FIXTURES / "qwen3_5")
    out = tmp_path / "bf16"
    out.mkdir()
    shutil.copy(FIXTURES / "qwen3_5" / "config.json", out / "config.json")
    save_jax({k: jnp.asarray(v, jnp.bfloat16) for k, v in tensors.items()},
             str(out / "model.safetensors"))
    _, from_bf16 = load_checkpoint(out, jnp.float32)
    _, cast = load_checkpoint(FIXTURES / "qwen3_5", jnp.bfloat16)
    assert all(p.dtype == jnp.bfloat16 for p in jax.tree_util.tree_leaves(cast))
    assert_same_params(from_bf16, cast)  # bf16 on disk == fp32 on disk rounded to bf16


def test_missing_files_are_value_errors(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        load_checkpoint(tmp_path)
    shutil.copy(FIXTURES / "qwen3_5" / "config.json", tmp_path / "config.json")
    with pytest.raises(ValueError, match="model.safetensors"):
        load_checkpoint(tmp_path)


def test_from_hf_config_variants():
    base = json.loads((FIXTURES / "qwen3_5" / "config.json").read_text())
    direct = ModelConfig.from_hf_config(base)
    vl = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
          "text_config": {k: v for k, v in base.items() if k != "architectures"}}
    assert ModelConfig.from_hf_config(vl) == direct
    legacy = {k: v for k, v in base.items() if k not in ("rope_parameters", "layer_types")}
    legacy.update(rope_theta=10000.0, partial_rotary_factor=0.25, full_attention_interval=4)
    assert ModelConfig.from_hf_config(legacy) == direct
    assert (direct.linear_conv_dim, direct.rotary_dim) == (2 * 2 * 8 + 4 * 8, 4)
    with pytest.raises(ValueError, match="unsupported"):
        ModelConfig.from_hf_config({**base, "architectures": ["LlamaForCausalLM"],
                                    "model_type": "llama"})
    with pytest.raises(ValueError, match="RoPE"):
        ModelConfig.from_hf_config({**base, "rope_parameters": {"rope_type": "yarn"}})
