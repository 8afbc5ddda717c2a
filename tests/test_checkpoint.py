"""Warm restarts: save the whole cache, restore it in a NEW process, get the same hits and outputs;
restores onto a different model or pool layout are refused; HF -> Orbax params round trip."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import mambacache as mc
from mambacache.engine.engine import Engine
from mambacache.parallel.checkpoint import convert_hf_to_orbax, restore_params
from tests.engine_helpers import BASE, assert_same_outputs, make_engine, rand_tokens

ROOT = Path(__file__).resolve().parents[1]
SP = mc.SamplingParams(max_new_tokens=4)
CKPT_OVERRIDES = {"cache.page_size": 4, "cache.checkpoint_interval": 16}


def _workload(seed: int):
    rng = np.random.default_rng(seed)
    system = rand_tokens(rng, 40)
    first = [system + rand_tokens(rng, 9) for _ in range(3)] + [rand_tokens(rng, 30)]
    return first, rng


def _next_requests(first, rng):
    """Requests that reuse the first workload: repeats, a shared prefix, a follow-up turn."""
    return [first[0], first[1][:44] + rand_tokens(rng, 5), first[3] + rand_tokens(rng, 7)]


_RESTORED = """
import json, sys
import mambacache as mc
from tests.engine_helpers import make_engine
overrides, path, prompts = json.loads(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
engine = make_engine(**overrides)
engine.restore(path)
engine.check_integrity()
outs = [engine.generate([p], mc.SamplingParams(max_new_tokens=4))[0] for p in prompts]
engine.check_integrity()
print(json.dumps([[o.cached_tokens, o.output_token_ids, o.output_logprobs] for o in outs]))
"""


@pytest.mark.slow  # ~90 s; the in-process restore tests cover the same files in CI
def test_restored_engine_in_new_process_has_same_hits_and_outputs(tmp_path):
    engine = make_engine(**CKPT_OVERRIDES)
    first, rng = _workload(0)
    for p in first:
        engine.generate([p], SP)
    engine.save(str(tmp_path / "cache"))
    nxt = _next_requests(first, rng)
    proc = subprocess.run(
        [sys.executable, "-c", _RESTORED, json.dumps(CKPT_OVERRIDES), str(tmp_path / "cache"),
         json.dumps(nxt)], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    restored = json.loads(proc.stdout.strip().splitlines()[-1])
    live = [engine.generate([p], SP)[0] for p in nxt]
    assert [r[0] for r in restored] == [o.cached_tokens for o in live]
    assert all(o.cached_tokens > 0 for o in live), [o.cached_tokens for o in live]
    for r, o in zip(restored, live, strict=True):
        assert r[1] == o.output_token_ids
        np.testing.assert_allclose(r[2], o.output_logprobs, atol=1e-5, rtol=0)


def test_restore_in_process_matches_and_cold_engine_misses(tmp_path):
    engine = make_engine(**CKPT_OVERRIDES)
    first, rng = _workload(1)
    for p in first:
        engine.generate([p], SP)
    engine.save(str(tmp_path / "c"))
    nxt = _next_requests(first, rng)
    warm = make_engine(**CKPT_OVERRIDES)
    warm.restore(str(tmp_path / "c"))
    assert warm.cache.stats()["tree_states"] == engine.cache.stats()["tree_states"]
    cold = make_engine(**CKPT_OVERRIDES)
    outs_w = [warm.generate([p], SP)[0] for p in nxt]
    outs_c = [cold.generate([p], SP)[0] for p in nxt]
    assert all(o.cached_tokens > 0 for o in outs_w)
    assert outs_c[0].cached_tokens == 0
    assert_same_outputs(outs_w, outs_c)
    warm.check_integrity()


def test_restore_refuses_other_model_and_layout(tmp_path):
    engine = make_engine(**CKPT_OVERRIDES)
    for p in _workload(2)[0]:
        engine.generate([p], SP)
    assert engine.cache.stats()["tree_states"] > 1
    engine.save(str(tmp_path / "c"))
    other_seed = Engine(mc.EngineConfig().replace(**{**BASE, **CKPT_OVERRIDES, "model.seed": 7}))
    with pytest.raises(ValueError, match="different model: parameter checksums"):
        other_seed.restore(str(tmp_path / "c"))
    other_arch = Engine(mc.EngineConfig().replace(
        **{**BASE, **CKPT_OVERRIDES, "model.preset": "tiny_qwen3_5"}))
    with pytest.raises(ValueError, match="different model: model differs"):
        other_arch.restore(str(tmp_path / "c"))
    with pytest.raises(ValueError, match="page_size"):
        make_engine(**{**CKPT_OVERRIDES, "cache.page_size": 2}).restore(str(tmp_path / "c"))
    with pytest.raises(ValueError, match="no meta.json"):
        make_engine(**CKPT_OVERRIDES).restore(str(tmp_path / "missing"))
    small = make_engine(**{**CKPT_OVERRIDES, "cache.num_mamba_slots": 1})
    with pytest.raises(ValueError, match="state slots"):
        small.restore(str(tmp_path / "c"))


def test_save_refused_while_requests_run(tmp_path):
    engine = make_engine(**CKPT_OVERRIDES)
    engine.add_request(rand_tokens(np.random.default_rng(3), 10), SP)
    with pytest.raises(ValueError, match="while requests run"):
        engine.save(str(tmp_path / "c"))


def test_hf_to_orbax_round_trip(tmp_path):
    from models.loader import load_checkpoint

    src = ROOT / "tests" / "fixtures" / "qwen3_next"
    cfg = convert_hf_to_orbax(src, tmp_path / "orbax")
    cfg2, params = restore_params(tmp_path / "orbax")
    ref_cfg, ref = load_checkpoint(src)
    assert cfg == cfg2 == ref_cfg
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="no model.json"):
        restore_params(tmp_path)
    # params exported before the group-major layout (no param_layout) are refused, not misread
    meta_path = tmp_path / "orbax" / "model.json"
    meta = json.loads(meta_path.read_text())
    del meta["param_layout"]
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="layout None"):
        restore_params(tmp_path / "orbax")


# ---- all or nothing (issue 24): a failed restore leaves the engine exactly as it was --------
def _pools_dirs(path: Path) -> list[Path]:
    return [p for p in path.iterdir() if p.is_dir() and p.name.startswith("pools")]


def _corrupt(kind: str, good: Path, other: Path) -> None:
    """Damage the saved cache ``good`` the way an interrupted or careless overwrite would."""
    import shutil

    meta_path = good / "meta.json"
    if kind == "pools_missing":
        for d in _pools_dirs(good):
            shutil.rmtree(d)
    elif kind == "old_meta_beside_new_pools":  # other's meta, good's pools under its name
        meta = json.loads((other / "meta.json").read_text())
        for d in _pools_dirs(good):
            d.rename(good / meta.get("pools", "pools"))
        meta_path.write_text(json.dumps(meta))
    elif kind == "same_counts_other_rows":  # counts agree, the rows are someone else's
        meta, theirs = json.loads(meta_path.read_text()), json.loads(
            (other / "meta.json").read_text())
        for d in _pools_dirs(good):
            shutil.rmtree(d)
        shutil.copytree(other / theirs.get("pools", "pools"), good / meta.get("pools", "pools"))
    elif kind == "truncated_meta":
        meta_path.write_text(meta_path.read_text()[:100])
    elif kind == "tree_names_an_unsaved_page":
        meta = json.loads(meta_path.read_text())
        meta["tree"]["states"][-1]["pages"][0] = 10**6
        meta_path.write_text(json.dumps(meta))
    elif kind == "tree_missing":
        meta = json.loads(meta_path.read_text())
        del meta["tree"]
        meta_path.write_text(json.dumps(meta))


@pytest.fixture(scope="module")
def two_saves(tmp_path_factory):
    """Two saved caches from different workloads with the same numbers of pages and slots."""
    root = tmp_path_factory.mktemp("saves")
    for name, seed in (("a", 5), ("b", 6)):
        engine = make_engine(**CKPT_OVERRIDES)
        for p in _workload(seed)[0]:
            engine.generate([p], SP)
        engine.save(str(root / name))
    return root


@pytest.mark.parametrize("kind", ["pools_missing", "old_meta_beside_new_pools",
                                  "same_counts_other_rows", "truncated_meta",
                                  "tree_names_an_unsaved_page", "tree_missing"])
def test_failed_restore_is_a_value_error_and_changes_nothing(tmp_path, two_saves, kind):
    import shutil

    a, b = json.loads((two_saves / "a" / "meta.json").read_text()), json.loads(
        (two_saves / "b" / "meta.json").read_text())
    assert (len(a["tree"]["pages"]), len(a["tree"]["slots"])) == (
        len(b["tree"]["pages"]), len(b["tree"]["slots"]))  # the same-counts case is real
    shutil.copytree(two_saves / "a", tmp_path / "a")
    _corrupt(kind, tmp_path / "a", two_saves / "b")
    engine = make_engine(**CKPT_OVERRIDES)
    before = engine.cache.stats()
    with pytest.raises(ValueError) as info:
        engine.restore(str(tmp_path / "a"))
    assert str(tmp_path / "a") in str(info.value) or "saved cache" in str(info.value), info.value
    assert engine.cache.stats() == before
    engine.check_integrity()
    first, rng = _workload(5)
    prompts = _next_requests(first, rng)
    off = make_engine(**CKPT_OVERRIDES, **{"cache.enable": False})
    outs = [engine.generate([p], SP)[0] for p in prompts]
    assert outs[0].cached_tokens == 0  # nothing of the damaged save was loaded
    assert_same_outputs(outs, [off.generate([p], SP)[0] for p in prompts])


def test_interrupted_overwrite_keeps_the_old_save(tmp_path, monkeypatch):
    """A save killed while it writes the pools leaves the previous save whole: meta.json is
    replaced atomically, last, and names its own pools directory."""
    from mambacache.parallel import checkpoint

    engine = make_engine(**CKPT_OVERRIDES)
    first, rng = _workload(7)
    for p in first:
        engine.generate([p], SP)
    engine.save(str(tmp_path / "c"))
    engine.generate([rand_tokens(rng, 33)], SP)  # the tree changes

    def killed(path, tree):
        (path / "partial").mkdir(parents=True)
        raise KeyboardInterrupt("killed while writing the pools")

    monkeypatch.setattr(checkpoint, "_save_tree", killed)
    with pytest.raises(KeyboardInterrupt):
        engine.save(str(tmp_path / "c"))
    monkeypatch.undo()
    warm = make_engine(**CKPT_OVERRIDES)
    warm.restore(str(tmp_path / "c"))
    nxt = _next_requests(first, rng)
    outs = [warm.generate([p], SP)[0] for p in nxt]
    assert all(o.cached_tokens > 0 for o in outs)
    off = make_engine(**CKPT_OVERRIDES, **{"cache.enable": False})
    assert_same_outputs(outs, [off.generate([p], SP)[0] for p in nxt])


def test_restore_into_a_moved_split_too_small_changes_nothing(tmp_path):
    """[rebalance] A save needing more state slots than the engine's pools hold since its
    device split moved (its config still names the larger split, so the dry run on a cache
    built from the config passes): ``ValueError`` naming the directory and both sizes; the
    cache as it was (before: every page of the save held by nobody). Host bookkeeping only:
    the tree is built on the cache directly, no step runs."""
    from radix_helpers import serve

    budget = {"cache.num_kv_tokens": 0, "cache.num_mamba_slots": 0,
              "cache.memory_bytes": 1_606_400, "cache.rebalance": True}
    saver = make_engine(**budget)
    splits = saver.rebalancer.splits
    few = min(range(len(splits)), key=lambda k: splits[k][1])
    saver.rebalancer.move_now(max(range(len(splits)), key=lambda k: splits[k][1]))
    rng = np.random.default_rng(3)
    for _ in range(splits[few][1] + 2):
        serve(saver.cache, rand_tokens(rng, 12), output=(1,))
    assert saver.cache.stats()["slots_tree"] > splits[few][1]
    saver.save(str(tmp_path / "s"))
    engine = make_engine(**budget)
    engine.rebalancer.move_now(few)
    before = engine.cache.stats()
    with pytest.raises(ValueError, match="state slots") as info:
        engine.restore(str(tmp_path / "s"))
    assert str(tmp_path / "s") in str(info.value) and f"{splits[few][1]} slots" in str(info.value)
    assert engine.cache.stats() == before
    engine.check_integrity()
