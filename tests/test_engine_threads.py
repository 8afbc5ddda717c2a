"""The engine belongs to one thread at a time (``engine/thread_guard.py``): a second thread that
calls in while a step runs gets a ``RuntimeError`` naming both, and nothing is corrupted; once
the first thread is out, another may drive the engine."""

from __future__ import annotations

import threading

import pytest
from shadow_helpers import greedy, shadow_engine


def test_a_second_thread_is_refused_while_a_step_runs():
    engine = shadow_engine()
    inside, release = threading.Event(), threading.Event()
    real_run = engine.runner.run

    def slow_run(*args, **kwargs):
        inside.set()
        assert release.wait(30)
        return real_run(*args, **kwargs)

    engine.runner.run = slow_run
    result: dict[str, object] = {}
    first = threading.Thread(target=lambda: result.update(out=engine.generate([[1, 2, 3]],
                                                                              greedy(3))),
                             name="first-driver")
    first.start()
    assert inside.wait(30)
    for call in (lambda: engine.generate([[4, 5, 6]], greedy(3)), engine.step,
                 lambda: engine.add_request([7, 8], greedy(2)), lambda: engine.abort(0),
                 engine.metrics, engine.check_integrity):
        with pytest.raises(RuntimeError, match="from thread 'MainThread' while thread "
                                               "'first-driver' is inside Engine.generate"):
            call()
    release.set()
    first.join(30)
    engine.runner.run = real_run
    assert len(result["out"][0].output_token_ids) == 3
    assert len(engine.requests) == 0  # the refused add_request held nothing
    engine.check_integrity()
    # the first thread is out: this one may drive the engine now
    assert len(engine.generate([[4, 5, 6]], greedy(3))[0].output_token_ids) == 3
    engine.check_integrity()
