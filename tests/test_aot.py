"""The compile gate (``pallas_kernels.aot``).

CI (no marker): every family kernel has a gate case, and the bundle-dump reader counts loops
right on a synthetic dump. Behind ``-m aot`` (needs the ``aot`` extra: libtpu, triton; minutes):
``python -m pallas_kernels.aot`` compiles every kernel for v5e / v6e (fp32, bf16) and sm_90 at
the tiny and Qwen3-Next sizes and each family's kernels at Nemotron-H-47B, Granite 4.0-H Small and
Kimi-Linear-48B sizes, and the model's whole step compiles for TPU in bf16::

    pytest -q -m aot tests/test_aot.py
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pallas_kernels.aot import tpu
from pallas_kernels.aot.gate import chunks_per_step, format_row, missing_cases

_DUMP = """\
   0x0   :  { %s1 = smov 0 }
   0x1 LB: > { %s2 = sadd.s32 1, %s3 } /* Start region 7 */
   0x2   : > { %v1 = vld [vmem:[%s1] sm:$0xff] }
   0x3 LB: >> { %v2 = vadd.f32 %v1, %v1 } /* Start region 9 :: Start region 10 */
   0x4   : >> { %p1 = scmp.ge.s32.totalorder %s5, 64 /* loop exit test */ }
   0x5   : >> { %7 = sbr.rel (!%p1) target = $region10 }
   0x6   : > { %p2 = scmp.ge.s32.totalorder %s2, 12 /* loop exit test */ }
   0x7   : > { %8 = sbr.rel (!%p2) target = $region7 }
   0x8   :  { %9 = vsyncadd }
"""


def test_every_family_kernel_has_a_gate_case():
    assert missing_cases() == []


def test_step_bundles_counts_inner_loops_by_their_trip_bound(tmp_path):
    path = tmp_path / "k-final_bundles.txt"
    path.write_text(_DUMP)
    assert tpu.loops(str(path)) == [(1, 7, 64), (3, 5, 64)]
    # grid body 0x1..0x7 once (7 bundles) + the inner 3-bundle loop 63 more times
    assert tpu.step_bundles(str(path)) == 7 + 3 * 63


def test_bundles_are_reported_per_chunk_for_multi_chunk_steps():
    from pallas_kernels.ops import FAMILIES
    n = chunks_per_step(FAMILIES["tpu"].gdr_extend)
    assert n and n > 1
    assert chunks_per_step(FAMILIES["tpu"].conv_decode) is None
    row = dict(target="v5e:2x2", case="gdr_extend", size="tiny", dtype="float32", ok=True,
               bundles={"gdr_chunk_call.1": 100 * n}, chunks_per_step=n)
    assert f"{100 * n} bundles/step = 100 per (chunk, head), {n} chunks/step" in format_row(row)


def test_family_sizes_run_only_that_familys_kernels():
    from pallas_kernels.aot.cases import CASES, SIZES
    from pallas_kernels.aot.gate import run

    assert SIZES["nemotron_h"].runs("ssd_extend") and not SIZES["nemotron_h"].runs("gdr_extend")
    assert SIZES["kimi_linear"].runs("mla_attention_decode")
    assert not SIZES["kimi_linear"].runs("paged_attention")
    assert all(SIZES["qwen3_next"].runs(c) for c in CASES)
    seen = []
    rows = run(["v5e:2x2"], ["gdr_extend", "ssd_decode"], ["nemotron_h"], ["float32"],
               echo=seen.append, case_runner=lambda t, c, sz, d, _: dict(
                   target=t, case=c, size=sz, dtype=d, ok=True))
    assert [r["case"] for r in rows] == ["ssd_decode"] and len(seen) == 1


@pytest.mark.aot
def test_family_real_sizes_compile_for_v5e_v6e_and_sm90(tmp_path):
    out = tmp_path / "gate.json"
    proc = subprocess.run([sys.executable, "-m", "pallas_kernels.aot", "--sizes",
                           "nemotron_h,granite_4_h,kimi_linear", "--json", str(out)],
                          capture_output=True, text=True, timeout=5400)
    rows = json.loads(out.read_text())
    failed = [(r["target"], r["size"], r["dtype"], r["case"], r["error"])
              for r in rows if not r["ok"]]
    assert failed == [] and proc.returncode == 0, (failed, proc.stdout[-2000:])
    assert len(rows) == 3 * 3 * 2 * 6  # targets x sizes x dtypes x the family's 6 cases
    for r in rows:
        if r["target"] == "sm_90" and not r.get("absent"):
            assert r["kernels"] and all(k["registers"] > 0 for k in r["kernels"]), r


@pytest.mark.aot
def test_every_kernel_compiles_for_v5e_v6e_and_sm90(tmp_path):
    out = tmp_path / "gate.json"
    proc = subprocess.run([sys.executable, "-m", "pallas_kernels.aot", "--sizes",
                           "tiny,qwen3_next", "--json", str(out)],
                          capture_output=True, text=True, timeout=3000)
    rows = json.loads(out.read_text())
    failed = [(r["target"], r["size"], r["dtype"], r["case"], r["error"])
              for r in rows if not r["ok"]]
    assert failed == [] and proc.returncode == 0, (failed, proc.stdout[-2000:])
    targets = {(r["target"], r["dtype"]) for r in rows}
    assert targets == {(t, d) for t in ("v5e:2x2", "v6e:2x2", "sm_90")
                       for d in ("float32", "bfloat16")}
    for r in rows:
        if r["target"] == "sm_90" and not r.get("absent"):
            assert r["kernels"] and all(k["registers"] > 0 for k in r["kernels"])
        if r["target"] == "sm_90" and r["case"].startswith("paged_attention"):
            # K/V gathers stay contiguous along the head dim: 16-byte loads, no spills
            assert all(k["u16_loads"] == 0 and k["vec_loads"] > 0 and k["spills"] == 0
                       for k in r["kernels"]), r
        if r["target"] == "sm_90" and r["case"] == "ssd_extend":
            # products on tensor cores, the state pass elementwise (the one-kernel version: 0 MMA,
            # 126 / 183 spills)
            assert all((k["hgmma"] + k["hmma"] > 0) != (k["kernel"] == "_state_pass_kernel")
                       and k["spills"] < 100 for k in r["kernels"]), r
        if r["target"] == "sm_90" and r["case"] == "kda_extend":
            # four launches on tensor cores, the grams and inverse once per (chunk, head) (the
            # one-kernel version: 0 MMA, 791 spills, redone per value tile)
            assert len(r["kernels"]) == 4 and all(
                k["hgmma"] + k["hmma"] > 0 and k["spills"] < 200 for k in r["kernels"]), r


@pytest.mark.aot
def test_model_step_compiles_for_tpu_in_bf16():
    proc = subprocess.run([sys.executable, "scripts/aot_model_step.py", "--dtype", "bfloat16"],
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stdout.count(" ok") == 4  # prefill + decode on v5e and v6e


@pytest.mark.aot
def test_deterministic_variants_compile_for_v5e_v6e_and_sm90(tmp_path):
    """``--fixed-order``: every kernel of ``ops.FIXED_ORDER_KERNELS`` compiled with
    ``fixed_order`` on (``model.deterministic``) for both TPU targets and sm_90, both dtypes."""
    from pallas_kernels.aot.cases import kernel_name
    from pallas_kernels.ops import FIXED_ORDER_KERNELS

    out = tmp_path / "gate.json"
    proc = subprocess.run([sys.executable, "-m", "pallas_kernels.aot", "--sizes", "tiny",
                           "--fixed-order", "--json", str(out)],
                          capture_output=True, text=True, timeout=3000)
    rows = json.loads(out.read_text())
    assert proc.returncode == 0 and all(r["ok"] for r in rows), proc.stdout[-2000:]
    for r in rows:
        family = "gpu" if r["target"] == "sm_90" else "tpu"
        assert r.get("fixed_order", False) == (
            kernel_name(r["case"]) in FIXED_ORDER_KERNELS[family]), r
