"""Tensor parallel 2 / 4 for the Mamba2 hybrids on 4 forced CPU devices (one subprocess):
same tokens, logprobs within 1e-4 and the same cache hits as one device.

``tiny_nemotron_h`` and ``tiny_granite_4_h`` have 8 Mamba2 heads in G=2 groups: at TP 2 each
device holds one group, at TP 4 half a group (B and C of its group handed to it by
``ops._ssd_groups``). The SSM pool is split on heads. Behind the ``slow`` marker:
``pytest -q -m slow tests/test_parallel_mamba2.py``.
"""

from __future__ import annotations

import pytest

from mambacache.parallel.mesh import validate_tensor_parallel
from models.presets import get_preset
from tests.multidevice import TP_WORKLOAD, assert_matches_one_device, finish_worker, start_worker

_WORKER = """
import json
import jax, numpy as np
import mambacache as mc
from mambacache.engine.engine import Engine
from models.params import init_params
from models.presets import get_preset

""" + TP_WORKLOAD + """
result = {}
for preset in ("tiny_nemotron_h", "tiny_granite_4_h"):
    model_cfg = get_preset(preset)
    params = init_params(model_cfg, seed=3)
    for tp in (1, 2, 4):
        cfg = mc.EngineConfig().replace(**{**base, "parallel.tensor_parallel": tp})
        engine = Engine(cfg, model=(model_cfg, params))
        outs = engine.generate(prompts, sp) + engine.generate(prompts[:1], sp)
        engine.check_integrity()
        result[f"{preset}/{tp}"] = dict(
            tokens=[o.output_token_ids for o in outs], logprobs=[o.output_logprobs for o in outs],
            cached=[o.cached_tokens for o in outs],
            ssm_shard=list(engine.runner.pools.ssm[0].addressable_shards[0].data.shape))
print(json.dumps(result))
"""


@pytest.fixture(scope="module")
def mesh_run():
    return finish_worker(start_worker(_WORKER), "mamba2 tp worker", timeout=1800)


@pytest.mark.slow  # six engines compiled in one subprocess: 45-60 s each on a loaded 2-core box
@pytest.mark.parametrize("preset", ["tiny_nemotron_h", "tiny_granite_4_h"])
@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_matches_one_device(mesh_run, preset, tp):
    ref, got = mesh_run[f"{preset}/1"], mesh_run[f"{preset}/{tp}"]
    assert_matches_one_device(ref, got)
    assert got["ssm_shard"][1] == 8 // tp  # Mamba2 heads split over the mesh


def test_groups_and_tp_must_divide_one_another():
    cfg = get_preset("tiny_nemotron_h")  # G = 2 groups
    validate_tensor_parallel(cfg, 4, num_devices=4)  # G divides tp: one group per device pair
    with pytest.raises(ValueError, match=r"tensor_parallel=3 and the model's Mamba2 n_groups"):
        validate_tensor_parallel(cfg, 3, num_devices=4)
