"""``compile.while_loading`` (``engine/runners/loading_compiles.py``): the warm-up's programs
compile from abstract params and pools while the weights load; the warm-up then runs them without
compiling, a request after it compiles nothing, the tokens are the plain path's, and a compile
that failed in the pool raises at warm-up naming its program."""

from __future__ import annotations

import pytest

import mambacache as mc
from mambacache.engine.engine import Engine
from mambacache.engine.runners.loading_compiles import LoadingCompiles
from mambacache.engine.runners.model_runner import ModelRunner

# odd sizes: programs no other test's engine compiled in this process
SMALL = {"model.kernels": "reference", "scheduler.max_running_requests": 3,
         "scheduler.chunked_prefill_size": 24, "cache.page_size": 16,
         "compile.cache_dir": "off"}
PROMPTS = [[5, 17, 3, 99, 4, 4, 4], [5, 17, 3, 8]]
BOUND = 32


def _run(overrides: dict, **kwargs) -> tuple[dict, list, int]:
    engine = Engine(mc.EngineConfig.load(None, SMALL | overrides), **kwargs)
    warm = engine.warmup(BOUND)
    outs = engine.generate(PROMPTS, mc.SamplingParams(max_new_tokens=4, temperature=0.0))
    got = [(o.output_token_ids, o.output_logprobs) for o in outs]
    return warm, got, engine.metrics()["programs_compiled"]


@pytest.mark.parametrize("split", ["off", "on"])  # compile.separate_sampler
def test_programs_compiled_while_loading_are_the_ones_the_engine_runs(split):
    key = {"compile.separate_sampler": split}
    warm, got, after = _run({"compile.while_loading": "on"} | key, warmup_max_seq_len=BOUND)
    early = warm["while_loading"]
    assert early is not None and early["usable"], early
    assert early["programs"] == warm["programs"] >= 3
    # the warm-up itself compiled nothing: every compile it reports happened while loading
    assert warm["compiles"] == early["counted"][0], warm
    assert after == 0
    plain, want, plain_after = _run({"compile.while_loading": "off"} | key)
    assert plain["while_loading"] is None and plain_after == 0
    assert got == want


def test_auto_compiles_while_loading_only_for_a_caller_that_warms_up(monkeypatch):
    started = []
    monkeypatch.setattr(LoadingCompiles, "start",
                        classmethod(lambda cls, cfg, bound=None: started.append(bound)))
    cfg = mc.EngineConfig.load(None, SMALL)
    assert cfg.compile.while_loading == "auto"
    Engine(cfg)
    assert started == []
    Engine(cfg, warmup_max_seq_len=0)  # 0: the model's context
    Engine(cfg, warmup_max_seq_len=BOUND)
    Engine(cfg.replace(**{"compile.while_loading": "off"}), warmup_max_seq_len=BOUND)
    Engine(cfg.replace(**{"compile.ahead_of_time": False}), warmup_max_seq_len=BOUND)
    assert started == [None, BOUND]


def test_a_failed_compile_raises_at_warmup_naming_the_program(monkeypatch):
    def compile_ahead(self, shape, logit_controls=False):
        if shape.decode:
            raise ValueError("injected")
        return 0.0  # the extends: not compiled (the test needs only the failure)

    monkeypatch.setattr(ModelRunner, "compile_ahead", compile_ahead)
    engine = Engine(mc.EngineConfig.load(None, SMALL | {"compile.while_loading": "on"}))
    with pytest.raises(RuntimeError, match=r"program decode \d+ rows x \d+ pages .*injected"):
        engine.warmup(BOUND)


@pytest.mark.parametrize("value", ["yes", True, ""])
def test_bad_while_loading_is_an_error_naming_the_value(value):
    with pytest.raises(ValueError, match=r"compile\.while_loading"):
        mc.EngineConfig().replace(**{"compile.while_loading": value})
