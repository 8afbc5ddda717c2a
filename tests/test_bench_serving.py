"""The serving benchmark client against a real server (one for the module): each dataset runs,
every request completes with its output length, and the cached share the server reports is the
ideal one where the cache can reach it."""

from __future__ import annotations

import json

import pytest
from serve_helpers import running_server

from mambacache.bench.serving import main


@pytest.fixture(scope="module")
def srv():
    with running_server() as handle:
        yield handle


def bench(srv, *flags: str) -> dict:
    return main(["--base-url", srv.url, "--disable-tqdm", *flags])


def test_generated_shared_prefix_hits_the_ideal(srv, tmp_path):
    out = tmp_path / "r.jsonl"
    r = bench(srv, "--dataset-name", "generated-shared-prefix", "--gsp-num-groups", "2",
              "--gsp-prompts-per-group", "4", "--gsp-system-prompt-len", "64",
              "--gsp-question-len", "0", "--gsp-output-len", "3", "--output-file", str(out))
    assert (r["completed"], r["failed"], r["output_tokens"]) == (8, 0, 24)
    assert r["input_tokens"] == 8 * 64
    ideal = 6 * 63 / (8 * 64)  # per group: the first prompt misses, 3 hit all but the last token
    assert r["ideal_cached_share"] == pytest.approx(ideal)
    assert abs(r["cached_share"] - ideal) <= 0.01 * ideal
    assert r["ttft_p50"] > 0 and r["itl_mean"] > 0 and r["tpot_mean"] > 0
    assert json.loads(out.read_text().splitlines()[-1])["completed"] == 8
    srv.wait_idle()


def test_multi_turn_and_random(srv):
    r = bench(srv, "--dataset-name", "multi-turn", "--multi-turn-num-clients", "2",
              "--multi-turn-num-rounds", "3", "--multi-turn-system-prompt-len", "0",
              "--multi-turn-user-len", "8", "--multi-turn-output-len", "4", "--max-concurrency",
              "2", "--seed", "3")
    assert (r["completed"], r["failed"], r["output_tokens"]) == (6, 0, 24)
    assert r["ideal_cached_share"] > 0.4  # earlier turns and their outputs
    assert abs(r["cached_share"] - r["ideal_cached_share"]) <= 0.01 * r["ideal_cached_share"]
    r = bench(srv, "--dataset-name", "random", "--num-prompts", "4", "--random-input-len", "20",
              "--random-output-len", "2", "--request-rate", "50", "--disable-stream")
    assert (r["completed"], r["failed"], r["input_tokens"], r["output_tokens"]) == (4, 0, 80, 8)
    srv.wait_idle()
    srv.on_engine(lambda e: e.check_integrity())
