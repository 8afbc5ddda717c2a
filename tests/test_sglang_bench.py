"""SGLang's own ``bench_serving --backend sglang`` (sglang 0.5.20 in its own environment: its
native ``/generate`` client) against the server on the generated-shared-prefix shape (issue 31):
every request completes with its output length, and the shared prefixes are served from the
cache.

Marker ``sglang_bench`` (excluded by default; needs sglang installed ``--no-deps`` beside CPU
torch and transformers, in the Python named by ``SGLANG_PYTHON``, default
``/work/sglenv/bin/python``): ``pytest -m sglang_bench -n 0 tests/test_sglang_bench.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from serve_helpers import running_server

pytestmark = pytest.mark.sglang_bench

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "sglang_bench_serving.py"
GROUPS, PER_GROUP, SYSTEM, QUESTION, OUTPUT = 2, 4, 128, 16, 4


def sglang_python() -> str:
    path = os.environ.get("SGLANG_PYTHON", "/work/sglenv/bin/python")
    if not Path(path).exists():
        pytest.fail(f"{path} does not exist: set SGLANG_PYTHON to a Python with sglang==0.5.20 "
                    "installed --no-deps (plus torch, transformers)")
    return path


def test_sglang_bench_serving_generated_shared_prefix(tmp_path):
    python = sglang_python()
    tok = tmp_path / "byte_tokenizer"
    subprocess.run([sys.executable, str(SCRIPT), "--write-tokenizer", str(tok)], check=True)
    out = tmp_path / "result.jsonl"
    with running_server(**{"serve.warmup": False}) as srv:
        before = srv.on_engine(lambda e: e.metrics()["cached_tokens"])
        run = subprocess.run(
            [python, str(SCRIPT), "--tokenizer", str(tok), "--base-url", srv.url,
             "--dataset-name", "generated-shared-prefix", "--gsp-num-groups", str(GROUPS),
             "--gsp-prompts-per-group", str(PER_GROUP), "--gsp-system-prompt-len", str(SYSTEM),
             "--gsp-question-len", str(QUESTION), "--gsp-output-len", str(OUTPUT),
             "--seed", "1", "--disable-tqdm", "--output-file", str(out)],
            capture_output=True, text=True, timeout=1200,
            env={**os.environ, "HOME": str(tmp_path)})  # its dataset cache stays in tmp_path
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        cached = srv.on_engine(lambda e: e.metrics()["cached_tokens"]) - before
        srv.wait_idle()
        srv.on_engine(lambda e: e.check_integrity())
    result = json.loads(out.read_text().splitlines()[-1])
    n = GROUPS * PER_GROUP
    assert result["completed"] == n and result["total_output_tokens"] == n * OUTPUT, result
    # every request after a group's first (and after the client's one warm-up request) finds
    # the group's system prompt cached
    assert cached >= (n - GROUPS) * SYSTEM, (cached, result)
