"""Multi-host: two processes on this machine (CPU, gloo collectives) run scripts/multihost.sh,
one engine each over a TP-2 mesh spanning both, and agree with a single-device engine."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import mambacache as mc
from tests.engine_helpers import make_engine

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "multihost.sh"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # two JAX processes compiling the step: ~30 s
def test_two_processes_match_one_device():
    env = {**os.environ, "PYTHON": sys.executable, "COORDINATOR": f"127.0.0.1:{free_port()}",
           "NUM_PROCESSES": "2", "XLA_FLAGS": ""}
    procs = [subprocess.Popen(["bash", str(SCRIPT)], env={**env, "PROCESS_ID": str(i)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    outputs = []
    for p in procs:
        out, _ = p.communicate(timeout=240)
        assert p.returncode == 0, out[-3000:]
        outputs.append(out.strip().splitlines()[-1])
    expected = make_engine().generate([[5, 17, 3, 99]], mc.SamplingParams(max_new_tokens=8))
    tokens = expected[0].output_token_ids
    assert outputs == [f"{i} {tokens}" for i in range(2)]
