"""``compile.separate_sampler`` (``engine/runners/sampler_program.py``): a plain step as the step
program without its sampler, then the sampler program (one per logits-row count). Tokens and
logprobs equal the fused step's (greedy and seeded sampling, overlap on and off); after the
warm-up nothing compiles; ``"auto"`` is off on CPU; a bad value is an error naming it."""

from __future__ import annotations

import numpy as np
import pytest

import mambacache as mc
from mambacache.engine.runners.sampler_program import SplitStep, separate_sampler_on
from tests.engine_helpers import assert_same_outputs, make_engine, rand_tokens
from tests.multidevice import TP_WORKLOAD, run_worker

ON = {"compile.separate_sampler": "on"}


def _prompts_and_params() -> tuple[list[list[int]], list[mc.SamplingParams]]:
    rng = np.random.default_rng(11)
    prefix = rand_tokens(rng, 21)
    prompts = [prefix + rand_tokens(rng, n) for n in (3, 8, 1)] + [rand_tokens(rng, 13)]
    params = [mc.SamplingParams(max_new_tokens=5),  # greedy
              mc.SamplingParams(max_new_tokens=5, temperature=0.8, top_k=40, top_p=0.9, seed=1),
              mc.SamplingParams(max_new_tokens=5, temperature=1.0, top_p=0.7, seed=2),
              mc.SamplingParams(max_new_tokens=5, temperature=0.6, top_k=5, seed=3)]
    return prompts, params


@pytest.mark.parametrize("overlap", [True, False])
def test_split_step_samples_what_the_fused_step_samples(overlap):
    prompts, params = _prompts_and_params()
    outs = {}
    for split in ("off", "on"):
        engine = make_engine(**{"scheduler.overlap": overlap, "compile.separate_sampler": split})
        kinds = {type(f) for f in engine.runner.step_programs.values()}
        assert (kinds == {SplitStep}) == (split == "on"), kinds
        outs[split] = engine.generate(prompts, params) + engine.generate(prompts[:2],
                                                                         params[:1] * 2)
    assert_same_outputs(outs["on"], outs["off"], atol=0.0)
    assert len({tuple(o.output_token_ids) for o in outs["on"][:4]}) > 1


def test_after_warmup_nothing_compiles_and_the_report_lists_the_samplers():
    engine = make_engine(**ON, **{"scheduler.max_running_requests": 5,
                                  "scheduler.chunked_prefill_size": 40})
    warm = engine.warmup(48, logit_controls=True)
    rows = {(s["num_logits"], s["logit_controls"]) for s in warm["program_list"]}
    assert warm["sampler_programs"] == len(rows) < warm["programs"], warm
    assert any(c for _, c in rows), rows  # the penalty variants: sampler programs of their own
    # at most one compile per row count (fewer: another test's engine compiled some already)
    assert warm["sampler_compiles"] <= warm["sampler_programs"], warm
    assert warm["sampler_compile_s"] >= 0.0
    prompts, params = _prompts_and_params()
    params[1] = mc.SamplingParams(max_new_tokens=5, temperature=0.8, seed=1,
                                  presence_penalty=0.5, repetition_penalty=1.3)
    engine.generate(prompts, params)
    engine.generate(prompts[:1], params[:1])
    assert engine.metrics()["programs_compiled"] == 0, engine.runner.compiles.by_function


def test_auto_is_off_on_cpu_and_on_on_tpu():
    assert not separate_sampler_on("auto", "cpu") and not separate_sampler_on("auto", "gpu")
    assert separate_sampler_on("auto", "tpu") and separate_sampler_on("on", "cpu")
    assert not separate_sampler_on("off", "tpu")
    engine = make_engine()
    assert mc.EngineConfig().compile.separate_sampler == "auto"
    assert not engine.runner.separate_sampler
    assert not any(isinstance(f, SplitStep) for f in engine.runner.step_programs.values())


@pytest.mark.parametrize("value", ["yes", True, ""])
def test_bad_value_is_an_error_naming_it(value):
    with pytest.raises(ValueError, match=r"compile\.separate_sampler.*" + repr(value)[:3]):
        mc.EngineConfig().replace(**{"compile.separate_sampler": value})
    with pytest.raises(ValueError, match=r"compile\.separate_sampler"):
        separate_sampler_on(value, "tpu")


def test_sizing_compiles_the_step_and_its_sampler():
    """``parallel/sizing.compile_step`` with the key on: both programs compiled, their cost the
    fused step's (the same arithmetic, within 10 %)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh

    from mambacache.parallel import sizing

    cfg = mc.EngineConfig.load(None, {"scheduler.max_running_requests": 4,
                                      "cache.page_size": 16})
    model_cfg = make_engine().model_cfg
    mesh = Mesh(np.asarray(jax.devices()[:1]), ("tp",))
    params = sizing.abstract_params(model_cfg, jnp.float32)
    pools = sizing.abstract_pools(model_cfg, 64, 16, 5, jnp.float32)
    shape = sizing.largest_step_shapes(cfg, model_cfg)["decode"]
    mems = [sizing.compile_step(model_cfg, shape, params=params, pools=pools, page_size=16,
                                kernels="reference", mesh=mesh, separate_sampler=split)
            for split in (False, True)]
    assert mems[1].flops == pytest.approx(mems[0].flops, rel=0.1), mems
    assert mems[1].temp_bytes > 0, mems


_TP_WORKER = """
import json
import jax, numpy as np
import mambacache as mc
from mambacache.engine.engine import Engine
from mambacache.engine.runners.sampler_program import SplitStep
from models.params import init_params
from models.presets import get_preset
""" + TP_WORKLOAD + """
model_cfg = get_preset("tiny_qwen3_next_tp4")
params = init_params(model_cfg, seed=3)
sampled = [sp, mc.SamplingParams(max_new_tokens=5, temperature=0.9, top_p=0.8, seed=4)]
result = {}
for split in ("off", "on"):
    cfg = mc.EngineConfig().replace(**{**base, "parallel.tensor_parallel": 2,
                                       "compile.separate_sampler": split})
    engine = Engine(cfg, model=(model_cfg, params))
    warm = engine.warmup(64)
    outs = engine.generate(prompts, sampled) + engine.generate(prompts[:1], sp)
    result[split] = dict(tokens=[o.output_token_ids for o in outs],
                         logprobs=[o.output_logprobs for o in outs],
                         split=isinstance(engine.runner.step_programs[True], SplitStep),
                         sampler_programs=warm["sampler_programs"],
                         after=engine.metrics()["programs_compiled"])
print(json.dumps(result))
"""


def test_tensor_parallel_2_split_equals_fused_and_compiles_nothing_after_warmup():
    """Under TP 2 (a CPU mesh) the split step's sampler program (replicated out shardings)
    samples the fused step's tokens (logprobs within 1e-6); after the warm-up nothing
    compiles."""
    got = run_worker(_TP_WORKER)
    assert got["on"]["split"] and not got["off"]["split"], got
    assert got["on"]["tokens"] == got["off"]["tokens"]
    # the fused program's log-softmax may sum the vocabulary in shards (its logits' sharding is
    # XLA's choice there, replicated here): equal to float32 rounding, not bit for bit
    np.testing.assert_allclose(np.concatenate(got["on"]["logprobs"]),
                               np.concatenate(got["off"]["logprobs"]), atol=1e-6, rtol=0)
    assert got["on"]["sampler_programs"] > 0 and got["on"]["after"] == 0, got["on"]
