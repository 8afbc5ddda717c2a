"""Benchmark: workload generators, config validation, one tiny end-to-end run through ``main``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mambacache.bench.cli import load_setup, main
from mambacache.bench.report import format_table
from mambacache.bench.runner import BenchSection, summarize
from mambacache.bench.workloads import (
    Branching,
    GeneratedSharedPrefix,
    IdealHits,
    MultiTurn,
    NoReuse,
    Trace,
    ideal_hit_rate,
    max_seq_len,
    workload_from_dict,
)

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "bench"
VOCAB = 512


def _lcp(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_gsp_shapes_groups_and_seed():
    spec = GeneratedSharedPrefix(num_groups=3, prompts_per_group=4, system_prompt_len=20,
                                 question_len=5, output_len=7)
    items = spec.source(VOCAB, seed=1).start()
    assert len(items) == 12
    assert all(len(it.prompt) == 25 and it.max_new_tokens == 7 for it in items)
    for g in range(3):
        group = [it.prompt for it in items if it.client == g]
        assert len(group) == 4
        assert all(p[:20] == group[0][:20] for p in group)
    other = [it.prompt for it in items if it.client != items[0].client]
    assert all(_lcp(items[0].prompt, p) < 20 for p in other)
    again = spec.source(VOCAB, seed=1).start()
    assert [it.prompt for it in again] == [it.prompt for it in items]
    assert [it.prompt for it in spec.source(VOCAB, seed=2).start()] != [it.prompt for it in items]
    ordered = GeneratedSharedPrefix(num_groups=3, prompts_per_group=4, system_prompt_len=20,
                                    question_len=5, output_len=7, ordered=True)
    assert [it.client for it in ordered.source(VOCAB, 1).start()] == [0] * 4 + [1] * 4 + [2] * 4


def test_gsp_range_ratio_bounds():
    spec = GeneratedSharedPrefix(num_groups=2, prompts_per_group=50, system_prompt_len=40,
                                 question_len=20, output_len=10, range_ratio=0.5)
    items = spec.source(VOCAB, 0).start()
    assert all(20 + 10 <= len(it.prompt) <= 60 and 5 <= it.max_new_tokens <= 10 for it in items)
    assert len({len(it.prompt) for it in items}) > 3


def test_ideal_hit_rate_identical_prompts():
    spec = GeneratedSharedPrefix(num_groups=2, prompts_per_group=5, system_prompt_len=30,
                                 question_len=0, output_len=1)
    prompts = [it.prompt for it in spec.source(VOCAB, 0).start()]
    assert ideal_hit_rate(prompts) == pytest.approx((2 * 4 * 29) / (10 * 30))
    assert ideal_hit_rate([[1, 2, 3], [1, 2, 4], [1, 2, 3, 5], [7]]) == pytest.approx(
        (0 + 2 + 3 + 0) / 11)
    assert ideal_hit_rate([]) == 0.0


def test_ideal_hits_counts_finished_outputs():
    ideal = IdealHits()
    assert ideal.send([1, 2, 3]) == 0
    ideal.insert([1, 2, 3, 8, 9])  # finished: prompt + output
    assert ideal.send([1, 2, 3, 8, 9, 4]) == 5  # next turn reuses the output too
    assert ideal.rate == pytest.approx(5 / 9)


def test_multi_turn_appends_output_and_message():
    spec = MultiTurn(num_clients=2, num_rounds=3, system_prompt_len=10, user_len=4,
                     output_len=3)
    src = spec.source(VOCAB, 0)
    first = src.start()
    assert src.total == 6 and len(first) == 2
    assert first[0].prompt[:10] == first[1].prompt[:10]
    nxt = src.follow_up(first[0], [7, 8, 9])
    assert nxt.prompt[:14] == first[0].prompt and nxt.prompt[14:17] == [7, 8, 9]
    assert len(nxt.prompt) == 21 and nxt.turn == 1 and nxt.client == 0
    last = src.follow_up(nxt, [1, 2, 3])
    assert last.turn == 2 and src.follow_up(last, [4, 5, 6]) is None


def test_no_reuse_and_branching_shapes():
    items = NoReuse(num_prompts=10, input_len=50, output_len=4).source(VOCAB, 0).start()
    assert len(items) == 10 and all(len(it.prompt) == 50 for it in items)
    assert ideal_hit_rate([it.prompt for it in items]) < 0.05
    spec = Branching(num_trees=2, fewshot_len=16, branch_factor=2, depth=2, segment_len=9,
                     ordered=True)
    prompts = [it.prompt for it in spec.source(VOCAB, 0).start()]
    assert len(prompts) == 2 * (2 + 4)
    roots = prompts[:2]  # depth-1 nodes of tree 0, then their children
    assert all((len(p) - 16) % 2 == 1 for p in roots)
    for child in prompts[2:6]:
        assert any(child[:len(r)] == r for r in roots)
        assert (len(child) - 16) % 2 == 0  # two odd segments


def test_trace(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"prompt": [1, 2, 3], "output": [4, 5]}\n\n{"prompt": [1], "output": [9]}\n')
    items = Trace(path=str(path)).source(VOCAB, 0).start()
    assert [(it.prompt, it.max_new_tokens) for it in items] == [([1, 2, 3], 2), ([1], 1)]
    assert len(Trace(path=str(path), max_requests=1).source(VOCAB, 0).start()) == 1
    with pytest.raises(ValueError, match="does not exist"):
        Trace(path=str(tmp_path / "missing.jsonl")).source(VOCAB, 0)


@pytest.mark.parametrize("data, match", [
    ({"kind": "nope"}, "workload.kind"),
    ({"kind": "no_reuse", "num_prompts": 0}, "num_prompts"),
    ({"kind": "no_reuse", "bogus": 1}, "bogus"),
    ({"kind": "generated_shared_prefix", "range_ratio": 1.5}, "range_ratio"),
    ({"kind": "generated_shared_prefix", "system_prompt_len": 0, "question_len": 0},
     "system_prompt_len"),
    ({"kind": "trace"}, "workload.path"),
])
def test_workload_validation(data, match):
    with pytest.raises(ValueError, match=match):
        workload_from_dict(data)


def test_bench_section_validation():
    with pytest.raises(ValueError, match="bench.arrival"):
        BenchSection(arrival="burst")
    with pytest.raises(ValueError, match="bench.rate"):
        BenchSection(arrival="poisson", rate=0.0)
    with pytest.raises(ValueError, match="bench.repeats"):
        BenchSection(repeats=0)


def test_presets_load():
    from mambacache.bench.workloads import WORKLOADS
    from mambacache.config import read_toml

    # spec_tree.toml's workload is scripts/bench_spec_tree.py's own (a trace on the shadow runner)
    names = sorted(p.stem for p in CONFIGS.glob("*.toml")
                   if read_toml(p).get("workload", {}).get("kind") in WORKLOADS)
    assert "spec_tree" not in names and (CONFIGS / "spec_tree.toml").is_file()
    assert {"gsp_sglang", "gsp_identical", "multi_turn", "no_reuse", "branching"} <= set(names)
    for name in names:
        setup = load_setup(str(CONFIGS / f"{name}.toml"))
        assert setup.engine.model.preset == "tiny_qwen3_next"
    with pytest.raises(ValueError, match="unknown config section"):
        load_setup(str(CONFIGS / "no_reuse.toml"), {"nosuch.key": 1})


def test_summarize_tpot():
    from mambacache.bench.runner import Finished

    stats = summarize([Finished(10, 5, 0, 0.1, 0.5, None), Finished(10, 1, 0, 0.2, 0.2, None),
                       Finished(10, 3, 0, 0.0, 0.0, "boom")], duration_s=2.0)
    assert stats["completed"] == 2 and stats["failed"] == 1
    assert stats["request_throughput"] == pytest.approx(1.0)
    assert stats["input_throughput"] == pytest.approx(10.0)
    assert stats["tpot_mean"] == pytest.approx(0.1)
    assert stats["ttft_mean"] == pytest.approx(0.15)


def test_main_end_to_end_identical(tmp_path):
    out = tmp_path / "r.json"
    sets = ["workload.num_groups=2", "workload.prompts_per_group=4",
            "workload.system_prompt_len=48", "cache.num_kv_tokens=2048",
            "cache.num_mamba_slots=16", "scheduler.max_running_requests=4",
            "scheduler.chunked_prefill_size=64", "model.kernels='reference'"]
    argv = ["--config", str(CONFIGS / "gsp_identical.toml"), "--out", str(out), "--quiet"]
    for s in sets:
        argv += ["--set", s]
    result = main(argv)
    data = json.loads(out.read_text())
    assert data["cache_on"]["completed"] == 8 == result["cache_off"]["completed"]
    for mode in ("cache_on", "cache_off"):
        for key in ("request_throughput", "input_throughput", "output_throughput", "ttft_mean",
                    "ttft_p99", "tpot_mean", "hit_rate", "ideal_hit_rate",
                    "computed_prefill_tokens", "programs_compiled"):
            assert key in data[mode], (mode, key)
    assert set(data["ratios"]) >= {"request_throughput", "input_throughput", "output_throughput"}
    assert data["cache_on"]["hit_rate"] > 0 and data["cache_off"]["hit_rate"] == 0
    assert data["cache_on"]["ideal_hit_rate"] == pytest.approx(2 * 3 * 47 / (8 * 48))
    assert data["cache_on"]["computed_prefill_tokens"] < data["cache_off"][
        "computed_prefill_tokens"]
    # warm-up covers the timed passes by construction: JAX's events saw no compile in them
    assert data["warmup_max_seq_len"] == 48 + 1  # system prompt + one output token
    assert data["warmup_programs"] >= 2
    for mode in ("cache_on", "cache_off"):
        assert data[mode]["timed_compiles"] == 0, data[mode]["timed_compiled_functions"]
        assert data[mode]["compiled_while_timed"] is False
        assert data[mode]["programs_compiled"] == 0
    assert "COMPILED WHILE TIMED" not in format_table(result)
    flagged = {**result, "cache_on": {**result["cache_on"], "timed_compiles": 2,
                                      "timed_compile_s": 3.0}}
    assert "COMPILED WHILE TIMED" in format_table(flagged)


def test_max_seq_len_follows_every_turn():
    spec = MultiTurn(num_clients=2, num_rounds=3, system_prompt_len=10, user_len=4,
                     output_len=3)
    # turn 3: system 10 + 3 x (user 4 + output 3)
    assert max_seq_len(spec.source(VOCAB, 0)) == 10 + 3 * (4 + 3)
    gsp = GeneratedSharedPrefix(num_groups=2, prompts_per_group=3, system_prompt_len=20,
                                question_len=5, output_len=7)
    assert max_seq_len(gsp.source(VOCAB, 0)) == 32


def test_plot_without_matplotlib_is_a_clear_error(monkeypatch):
    import sys

    from mambacache.bench.report import require_matplotlib

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import raises ImportError
    with pytest.raises(RuntimeError, match="pip install"):
        require_matplotlib()
    with pytest.raises(RuntimeError, match="matplotlib"):
        main(["--config", str(CONFIGS / "gsp_identical.toml"), "--plot", "x.png", "--quiet"])
