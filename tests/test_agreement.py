"""``mambacache.bench.agreement``: cache on against off by next-token distributions and greedy
decoding. In fp32 the two are the same computation (within 1e-4); the command is what measures
bf16 (docs/bench.md)."""

from __future__ import annotations

import json

import numpy as np

from mambacache.bench import agreement
from mambacache.config import EngineConfig


def test_prompt_set_shares_prefixes_within_groups_and_is_seeded():
    a = agreement.prompt_set(300, groups=2, per_group=2, prefix_len=5, suffix_len=3, seed=1)
    assert a == agreement.prompt_set(300, groups=2, per_group=2, prefix_len=5, suffix_len=3,
                                     seed=1)
    assert [len(p) for p in a] == [8] * 4
    assert a[0][:5] == a[1][:5] and a[0][:5] != a[2][:5] and a[0] != a[1]
    assert min(min(p) for p in a) >= 3


def test_fp32_cache_on_equals_off(tmp_path):
    cfg = EngineConfig.load(None, overrides={"cache.page_size": 4})
    # the second prompt of a group plans the branch snapshot, the third hits it
    out = agreement.run(cfg, groups=1, per_group=3, prefix_len=13, suffix_len=7,
                        max_new_tokens=4)
    dist, greedy = out["distributions"], out["greedy"]
    assert dist["positions"] == 3 * (20 - 12)  # split at the page below the shared prefix
    assert dist["max_abs_logprob_diff"] < 1e-4 and dist["argmax_agreement"] == 1.0
    assert abs(dist["kl_mean"]) < 1e-6
    assert greedy["all_tokens_equal"] == 1.0 and greedy["cached_tokens"] > 0
    assert greedy["max_abs_logprob_diff_before_divergence"] < 1e-4


def test_main_writes_json(tmp_path, monkeypatch, capsys):
    calls = {}

    def fake_run(cfg, *, max_new_tokens):
        calls["dtype"], calls["n"] = cfg.model.dtype, max_new_tokens
        return {"kl": np.float64(0.5).item()}

    monkeypatch.setattr(agreement, "run", fake_run)
    out = tmp_path / "r.json"
    agreement.main(["--set", 'model.dtype="bfloat16"', "--max-new-tokens", "3",
                    "--out", str(out)])
    assert calls == {"dtype": "bfloat16", "n": 3}
    assert json.loads(out.read_text()) == {"kl": 0.5} == json.loads(capsys.readouterr().out)
