"""Published configs parse: transformers' defaults of every family (fixtures written by
``scripts/make_config_fixtures.py``), the real-size presets, and their byte sizes.

The sizes are checked against the pools themselves on tiny presets (what ``models/sizes.py``
says a slot and a token take is what ``PoolState.create`` allocates) and against the published
parameter counts on the real ones.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from models.config import ModelConfig
from models.params import param_shapes
from models.presets import REAL_PRESETS, get_preset, hf_config
from models.sizes import abstract_params, model_sizes

DEFAULTS = Path(__file__).parent / "fixtures" / "hf_defaults"
FAMILY_OF_DEFAULT = {"Qwen3NextConfig": "qwen3_next", "Qwen3_5TextConfig": "qwen3_5",
                     "Qwen3_5MoeTextConfig": "qwen3_5_moe", "NemotronHConfig": "nemotron_h",
                     "GraniteMoeHybridConfig": "granitemoehybrid",
                     "KimiLinearConfig": "kimi_linear"}
# published total parameters (billions) of the text model, MTP head excluded; a tied
# embedding counts twice in our layout (lm_head is its own array)
PUBLISHED_B = {"qwen3_next_80b_a3b": 80, "qwen3_5_9b": 9, "qwen3_5_35b_a3b": 35,
               "qwen3_5_122b_a10b": 122, "qwen3_5_397b_a17b": 397,
               "nemotron_h_8b": 8, "nemotron_h_47b": 47, "nemotron_h_56b": 56,
               "nemotron_3_nano_30b_a3b": 31.6, "granite_4_0_h_micro": 3.2 + 0.2,
               "granite_4_0_h_tiny": 6.9 + 0.15, "granite_4_0_h_small": 32.2 + 0.4,
               "kimi_linear_48b_a3b": 48}


@pytest.mark.parametrize("name", sorted(FAMILY_OF_DEFAULT))
def test_transformers_defaults_parse(name):
    """Every family's default config as current transformers saves it (Granite's
    ``time_step_limit`` is ``[0.0, {"__float__": "Infinity"}]`` there) parses."""
    cfg = ModelConfig.from_hf_config(json.loads((DEFAULTS / f"{name}.json").read_text()))
    assert cfg.family == FAMILY_OF_DEFAULT[name]
    assert cfg.num_hidden_layers > 0


def test_granite_infinite_time_step_limit():
    hf = json.loads((DEFAULTS / "GraniteMoeHybridConfig.json").read_text())
    assert hf["time_step_limit"][1] == {"__float__": "Infinity"}
    assert ModelConfig.from_hf_config(hf).time_step_limit == (0.0, float("inf"))


def test_kimi_rope_dim_not_a_quarter_of_the_head():
    """A legal Kimi Linear config whose qk_rope_head_dim is not head_dim / 4 (Qwen's partial
    RoPE rule must not apply: Kimi's MLA is NoPE)."""
    hf = json.loads((DEFAULTS / "KimiLinearConfig.json").read_text())
    hf.update(qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=14)
    cfg = ModelConfig.from_hf_config(hf)
    assert (cfg.head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim) == (20, 8, 14)
    assert cfg.kv_row_shape == (1, 512 + 8)


@pytest.mark.parametrize("name", sorted(REAL_PRESETS))
def test_real_preset_sizes(name):
    cfg = get_preset(name)
    sizes = model_sizes(cfg, jnp.bfloat16)
    assert sizes.num_params == pytest.approx(PUBLISHED_B[name] * 1e9, rel=0.06)
    assert sizes.weight_bytes == 2 * sizes.num_params
    assert sizes.state_bytes > 0 and sizes.kv_bytes_per_token > 0
    assert hf_config(name)["architectures"]


def test_qwen3_next_80b_sizes_by_hand():
    s = model_sizes(get_preset("qwen3_next_80b_a3b"), jnp.bfloat16)
    # 36 GDN layers: conv [3, 2*16*128 + 32*128] bf16 + state [32, 128, 128] f32
    assert s.state_bytes == 36 * (3 * 8192 * 2 + 32 * 128 * 128 * 4)
    # 12 attention layers: K and V of 2 heads x 256
    assert s.kv_bytes_per_token == 12 * 2 * 2 * 256 * 2


def test_abstract_params_allocate_nothing():
    cfg = get_preset("kimi_linear_48b_a3b")
    tree = abstract_params(cfg, jnp.bfloat16)
    leaves = jax.tree_util.tree_leaves(tree)
    assert all(isinstance(x, jax.ShapeDtypeStruct) and x.dtype == jnp.bfloat16 for x in leaves)
    shapes = jax.tree_util.tree_leaves(param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple)
                                       and all(isinstance(d, int) for d in x))
    assert [x.shape for x in leaves] == shapes


@pytest.mark.parametrize("name", ["tiny_qwen3_next", "tiny_nemotron_h", "tiny_kimi_linear"])
def test_sizes_match_the_pools(name):
    from mambacache.engine.runners.pools import PoolState
    cfg, page = get_preset(name), 4
    sizes = model_sizes(cfg, jnp.float32)
    small = PoolState.create(cfg, num_pages=1, page_size=page, num_slots=1).nbytes()
    big = PoolState.create(cfg, num_pages=2, page_size=page, num_slots=3).nbytes()
    assert big["mamba"] - small["mamba"] == 2 * sizes.state_bytes
    assert big["full"] - small["full"] == page * sizes.kv_bytes_per_token
