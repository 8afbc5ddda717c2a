"""``model.context_length`` (SGLang's ``--context-length``): the cap on a request, on the warm-up's
longest sequence and on the one request the plan's budget must hold; the plan's longest context
that fits."""

from __future__ import annotations

import json

import pytest

import mambacache as mc
from mambacache.engine.engine import Engine
from mambacache.engine.runners.warmup import engine_buckets
from mambacache.engine.shadow.runner import ShadowRunner
from mambacache.parallel.plan import main as plan_main
from models.presets import get_preset


def _shadow_engine(context_length: int) -> Engine:
    cfg = mc.EngineConfig().replace(**{"model.context_length": context_length,
                                       "cache.num_kv_tokens": 4096})
    return Engine(cfg, runner=ShadowRunner.for_config(cfg, context_len=4096))


def test_a_request_longer_than_the_cap_is_an_error_naming_both_numbers():
    engine = _shadow_engine(100)
    assert engine.model_cfg.max_position_embeddings == 100
    with pytest.raises(ValueError, match=r"prompt \(90\) \+ max_new_tokens \(11\) = 101 exceeds "
                                         r"the context length 100"):
        engine.add_request(list(range(1, 91)), mc.SamplingParams(max_new_tokens=11))
    engine.add_request(list(range(1, 91)), mc.SamplingParams(max_new_tokens=10))  # at the cap


def test_a_cap_above_the_models_context_is_an_error():
    with pytest.raises(ValueError, match=r"model.context_length \(8192\) exceeds the model's "
                                         r"context length 4096"):
        _shadow_engine(8192)
    with pytest.raises(ValueError, match="model.context_length must be an int >= 0"):
        mc.EngineConfig().replace(**{"model.context_length": -1})


def test_zero_keeps_the_models_context_and_the_warmup_follows_the_cap():
    cfg = mc.EngineConfig()
    model_cfg = get_preset(cfg.model.preset)
    assert cfg.model.capped(model_cfg) is model_cfg
    capped = cfg.replace(**{"model.context_length": 256}).model.capped(model_cfg)
    buckets = engine_buckets(cfg, capped, 16)
    assert buckets.max_seq_len == 256
    assert len(buckets.program_set()) < len(engine_buckets(cfg, model_cfg, 16).program_set())


def _plan(tmp_path, *sets: str) -> tuple[int, dict]:
    out = tmp_path / "plan.json"
    args = ["--topology", "h200:1", "--out", str(out)]
    for s in sets:
        args += ["--set", s]
    return plan_main(args), json.loads(out.read_text())


def test_plan_prints_the_longest_context_that_fits_and_it_does(tmp_path, capsys):
    # a budget for the 16 running slots and about 1000 tokens, not the tiny model's 4096
    _, base = _plan(tmp_path, "cache.page_size=16")
    slot, token = base["state_slot_bytes"], base["kv_token_bytes"]
    budget = int(2 * 16 * slot * 1.5 + 1000 * token)
    rc, p = _plan(tmp_path, "cache.page_size=16", f"cache.memory_bytes={budget}")
    assert rc == 1 and not p["fits"] and p["context_len"] == 4096
    longest = p["longest_context"]
    assert 0 < longest < 4096 and longest % 16 == 0
    assert f"{longest:,} tokens fit (--set model.context_length={longest})" \
        in capsys.readouterr().out
    rc, at = _plan(tmp_path, "cache.page_size=16", f"cache.memory_bytes={budget}",
                   f"model.context_length={longest}")
    assert rc == 0 and at["fits"] and at["context_len"] == longest
    rc, past = _plan(tmp_path, "cache.page_size=16", f"cache.memory_bytes={budget}",
                     f"model.context_length={longest + 16}")
    assert rc == 1 and past["longest_context"] == longest
