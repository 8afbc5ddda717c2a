"""The dependency rules of pyproject.toml's import-linter contracts hold, and each one fails when
a forbidden import is planted (so the check cannot pass by checking nothing)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).with_name("lint-imports")
PACKAGES = ("mambacache", "models", "pallas_kernels")
CONTRACT_NAMES = {c["id"]: c["name"] for c in tomllib.loads(
    (ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]}


def _lint(cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(LINT), "--no-cache"], cwd=cwd, capture_output=True, text=True,
                          env={"PYTHONPATH": str(cwd), "PATH": "/usr/bin:/bin"}, timeout=120)


def test_contracts_kept():
    out = _lint(ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 broken" in out.stdout


@pytest.fixture(scope="module")
def tree_copy(tmp_path_factory) -> Path:
    dst = tmp_path_factory.mktemp("tree")
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, dst / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", dst / "pyproject.toml")
    return dst


@pytest.mark.parametrize("module, planted, contract", [
    ("mambacache/cache/allocator.py", "import jax", "cache-host-only"),
    ("mambacache/cache/radix.py", "import mambacache.engine.step.batch", "cache-host-only"),
    ("mambacache/engine/scheduler.py", "import mambacache.bench.workloads", "engine-no-tools"),
    ("models/mtp.py", "import mambacache.config", "models-no-mambacache"),
    ("pallas_kernels/_common.py", "import models.layers", "kernels-standalone"),
    ("models/families/granite.py", "import models.loader", "families-no-engine"),
    ("models/families/granite.py", "import models.families.qwen", "families-independent"),
    ("mambacache/engine/step/plan.py", "import mambacache.engine.runners.pools",
     "engine-layers"),
    ("mambacache/engine/leases/lease.py", "import mambacache.engine.speculative.verify",
     "engine-layers"),
])
def test_planted_import_breaks_its_contract(tree_copy, module, planted, contract):
    path = tree_copy / module
    original = path.read_text()
    path.write_text(original + f"\n{planted}  # planted by the test\n")
    try:
        out = _lint(tree_copy)
    finally:
        path.write_text(original)
    assert out.returncode != 0, out.stdout
    lines = [re.sub(r" \(\d+ ignored imports?\)$", "", line) for line in out.stdout.splitlines()]
    broken = [line for line in lines if line.endswith("BROKEN")]
    assert broken == [f"{CONTRACT_NAMES[contract]} BROKEN"], out.stdout


def test_cache_imports_without_jax():
    """At run time too: the host cache and the simulator's tree load without JAX."""
    code = ("import sys, mambacache.cache.radix, mambacache.cache.snapshot_plan, mambacache; "
            "assert 'jax' not in sys.modules, sorted(m for m in sys.modules if 'jax' in m)")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)
