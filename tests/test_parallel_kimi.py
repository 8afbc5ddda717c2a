"""Tensor parallel 2 / 4 for ``tiny_kimi_linear`` on 4 forced CPU devices (one subprocess):
same tokens, logprobs within 1e-4 and the same cache hits as one device; KDA heads and MLA
query heads split over "tp", the MLA latent pages replicated (one latent row per token: no head
axis to split), the SSM pool split on KDA heads. Behind the ``slow`` marker:
``pytest -q -m slow tests/test_parallel_kimi.py``.
"""

from __future__ import annotations

import pytest

from tests.multidevice import TP_WORKLOAD, assert_matches_one_device, finish_worker, start_worker

_WORKER = """
import json
import jax, numpy as np
import mambacache as mc
from mambacache.engine.engine import Engine
from models.params import init_params
from models.presets import get_preset

""" + TP_WORKLOAD + """
model_cfg = get_preset("tiny_kimi_linear")
params = init_params(model_cfg, seed=3)
result = {}
for tp in (1, 2, 4):
    cfg = mc.EngineConfig().replace(**{**base, "parallel.tensor_parallel": tp})
    engine = Engine(cfg, model=(model_cfg, params))
    outs = engine.generate(prompts, sp) + engine.generate(prompts[:1], sp)
    engine.check_integrity()
    pools = engine.runner.pools
    result[tp] = dict(
        tokens=[o.output_token_ids for o in outs], logprobs=[o.output_logprobs for o in outs],
        cached=[o.cached_tokens for o in outs],
        ssm_shard=list(pools.ssm[0].addressable_shards[0].data.shape),
        latent_shard=list(pools.k_pages[0].addressable_shards[0].data.shape),
        latent_whole=list(pools.k_pages[0].shape), num_v_pages=len(pools.v_pages))
print(json.dumps(result))
"""


@pytest.fixture(scope="module")
def mesh_run():
    return finish_worker(start_worker(_WORKER), "kimi tp worker", timeout=1800)


@pytest.mark.slow  # three engines compiled in one subprocess
@pytest.mark.parametrize("tp", ["2", "4"])
def test_tensor_parallel_matches_one_device(mesh_run, tp):
    ref, got = mesh_run["1"], mesh_run[tp]
    assert_matches_one_device(ref, got)
    assert got["ssm_shard"][1] == 4 // int(tp)  # KDA heads split over the mesh
    assert got["latent_shard"] == got["latent_whole"]  # the latent pages replicated
    assert got["latent_whole"][2:] == [1, 32 + 8] and got["num_v_pages"] == 0
