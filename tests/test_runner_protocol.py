"""Both runners implement the step loop's ``Runner`` protocol (``engine/step_loop.py``)."""

from __future__ import annotations

import inspect
import re

from mambacache.config import EngineConfig
from mambacache.engine.runner_protocol import Runner
from mambacache.engine.runners.model_runner import ModelRunner
from mambacache.engine.shadow.runner import ShadowRunner

MEMBERS = [n for n in dir(Runner) if not n.startswith("_")] + ["model_cfg", "last_drafts"]


def test_shadow_runner_is_a_runner():
    runner = ShadowRunner.for_config(EngineConfig())
    assert isinstance(runner, Runner)
    assert all(hasattr(runner, name) for name in MEMBERS)


def test_model_runner_has_every_member():
    init = inspect.getsource(ModelRunner.__init__)
    missing = [n for n in MEMBERS
               if not hasattr(ModelRunner, n) and not re.search(rf"self\.{n}\s*[:=]", init)]
    assert missing == []
    assert {"run", "copy_slots", "pools_lost", "reset_pools"} <= set(MEMBERS)
