"""Run a worker script in a subprocess with 4 forced CPU devices; it prints one JSON line last."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NUM_DEVICES = 4


def start_worker(worker: str, *args: str, env: dict[str, str] | None = None,
                 unset: tuple[str, ...] = ()) -> subprocess.Popen:
    """Start ``python -c worker args...`` in the repo root on ``NUM_DEVICES`` CPU devices."""
    full_env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={NUM_DEVICES}",
                "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT), **(env or {})}
    for name in unset:
        full_env.pop(name, None)
    return subprocess.Popen([sys.executable, "-c", worker, *args], cwd=ROOT, env=full_env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish_worker(proc: subprocess.Popen, label: str = "worker", timeout: float = 300) -> dict:
    """Wait for ``proc``; its last stdout line parsed as JSON (an assertion shows stderr)."""
    stdout, stderr = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, (label, stderr[-4000:])
    return json.loads(stdout.strip().splitlines()[-1])


def run_worker(worker: str, *args: str, **kw) -> dict:
    """``start_worker`` then ``finish_worker``."""
    return finish_worker(start_worker(worker, *args, **kw))
