"""The suite's test-only XLA flags are set only where the running XLA knows them
(`tests/conftest.py`): XLA aborts the process on a flag it does not know."""

from __future__ import annotations

import os

from conftest import TEST_XLA_FLAGS, known_test_flags, xla_knows

UNKNOWN = "--xla_mambacache_no_such_flag=true"


def test_an_unknown_flag_is_refused_and_left_out():
    assert not xla_knows([UNKNOWN])
    known = "--xla_backend_optimization_level=0"
    assert known_test_flags((known, UNKNOWN)) == [known]


def test_the_session_runs_with_every_flag_its_xla_knows():
    flags = os.environ.get("XLA_FLAGS", "")
    if os.environ.get("MAMBACACHE_TEST_XLA_OPT") == "1":
        assert not any(f in flags for f in TEST_XLA_FLAGS)
        return
    for flag in TEST_XLA_FLAGS:
        assert (flag in flags) == xla_knows([flag]), (flag, flags)
