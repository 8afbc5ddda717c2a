"""Run a worker script in a subprocess with 4 forced CPU devices; it prints one JSON line last."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NUM_DEVICES = 4

#: The workload of the tensor-parallel workers (spliced into their scripts after ``import jax,
#: numpy as np`` and ``import mambacache as mc``): pools, two prompts that share a 24-token
#: system prompt, 5 new tokens each.
TP_WORKLOAD = """
assert len(jax.devices()) == 4, jax.devices()
base = {"cache.num_kv_tokens": 1024, "cache.num_mamba_slots": 16, "cache.page_size": 4,
        "scheduler.max_running_requests": 4, "scheduler.chunked_prefill_size": 32,
        "model.kernels": "reference"}
rng = np.random.default_rng(0)
system = rng.integers(0, 512, 24).tolist()
prompts = [system + rng.integers(0, 512, n).tolist() for n in (5, 40)]
sp = mc.SamplingParams(max_new_tokens=5)
"""


def assert_matches_one_device(ref: dict, got: dict) -> None:
    """A TP run's ``tokens`` and ``cached`` equal one device's (with a hit), ``logprobs``
    within 1e-4."""
    assert got["tokens"] == ref["tokens"]
    assert got["cached"] == ref["cached"] and got["cached"][-1] > 0
    for a, b in zip(ref["logprobs"], got["logprobs"], strict=True):
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) <= 1e-4


def start_worker(worker: str, *args: str, env: dict[str, str] | None = None,
                 unset: tuple[str, ...] = ()) -> subprocess.Popen:
    """Start ``python -c worker args...`` in the repo root on ``NUM_DEVICES`` CPU devices."""
    flags = os.environ.get("XLA_FLAGS", "")
    flags += f" --xla_force_host_platform_device_count={NUM_DEVICES}"
    full_env = {**os.environ, "XLA_FLAGS": flags.strip(),
                "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT), **(env or {})}
    for name in unset:
        full_env.pop(name, None)
    return subprocess.Popen([sys.executable, "-c", worker, *args], cwd=ROOT, env=full_env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish_worker(proc: subprocess.Popen, label: str = "worker", timeout: float = 300) -> dict:
    """Wait for ``proc``; its last stdout line parsed as JSON (an assertion shows stderr). A
    worker still running after ``timeout`` seconds is killed (never left behind) and fails."""
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, stderr = proc.communicate()
        raise AssertionError(f"{label} still running after {timeout} s, killed; stderr: "
                             f"{stderr[-4000:]}") from None
    assert proc.returncode == 0, (label, stderr[-4000:])
    return json.loads(stdout.strip().splitlines()[-1])


def run_worker(worker: str, *args: str, **kw) -> dict:
    """``start_worker`` then ``finish_worker``."""
    return finish_worker(start_worker(worker, *args, **kw))
