"""Draft trees (``speculative.topk`` > 1, ``engine/speculative/tree.py``): config limits, the
drafters' branches, the shadow runner's data-flow oracle over every branch row (outputs of
``method = "none"``, cache on and off, chunk cuts, preemption, failing steps, a planted bug:
the winner's pages not adopted), and the real tiny model (tokens of ``none`` exactly, logprobs
within 1e-4, greedy and seeded sampling; the MTP head's top-k)."""

from __future__ import annotations

import numpy as np
import pytest

import mambacache as mc
from mambacache.config import SpeculativeConfig
from mambacache.engine.leases.lease import Lease
from mambacache.engine.shadow.runner import DataflowError
from mambacache.engine.speculative.drafters import Drafter, NgramDrafter
from tests.engine_helpers import (
    assert_same_outputs,
    make_engine,
    spec_params,
    spec_prompts,
)
from tests.shadow_helpers import greedy, greedy_outputs, random_prompts, shadow_engine

VOCAB = 12
TREE = {"speculative.method": "ngram", "speculative.topk": 4, "cache.page_size": 1}


def _shadow(runner: dict | None = None, **overrides):
    return shadow_engine({"markov": 1, "vocab_size": VOCAB, **(runner or {})},
                         **{**TREE, **overrides})


def test_config_limits():
    cfg = mc.EngineConfig()
    assert cfg.speculative.topk == 1
    # any page size (issue 39: page size 1 was required)
    cfg.replace(**{"speculative.method": "ngram", "speculative.topk": 4, "cache.page_size": 4})
    with pytest.raises(ValueError, match=r"speculative.topk \(9\) exceeds 8"):
        cfg.replace(**{"speculative.topk": 9})
    with pytest.raises(ValueError, match="speculative.topk"):
        cfg.replace(**{"speculative.topk": 0})
    cfg.replace(**{"speculative.topk": 4, "cache.page_size": 4})  # speculation off: no limit


class _Req:
    def __init__(self, tokens):
        self.token_ids, self.request_id = np.asarray(tokens, np.int32), 0


def test_ngram_tree_branches():
    d = NgramDrafter(SpeculativeConfig(method="ngram", ngram_min=1, ngram_max=2))
    toks = [1, 2, 5, 6, 1, 2, 7, 8, 1, 2, 5, 9, 3, 1, 2]
    # suffix [1, 2]: its occurrences latest first, each path once (branches 0 and 2 share
    # their first token); the first branch is the chain's proposal; the shorter suffix [2]
    # adds no new path
    assert d.propose_tree_for(_Req(toks), 2, 4) == [[5, 9], [7, 8], [5, 6]]
    assert d.propose_tree_for(_Req(toks), 2, 4)[0] == d.propose(np.asarray(toks), 2)
    assert d.propose_tree_for(_Req(toks), 2, 2) == [[5, 9], [7, 8]]
    assert d.propose_tree_for(_Req(toks), 1, 4) == [[5], [7]]  # [5] twice: one path
    assert d.propose_tree_for(_Req([1, 2, 3]), 2, 4) == []


@pytest.mark.parametrize("cache,page", [(True, 1), (False, 1), (True, 4), (False, 3)])
def test_shadow_same_outputs_as_none(cache, page):
    """Page size > 1: a branch starting inside a page reads a copy of that page's tokens before
    its start (``Runner.copy_pages``; the oracle checks every KV read against its path)."""
    prompts = random_prompts(VOCAB, 6)
    kw = {"cache.page_size": page, "cache.enable": cache}
    ref = greedy_outputs(shadow_engine({"markov": 1, "vocab_size": VOCAB}, **kw), prompts, 40)
    eng = _shadow(**kw)
    assert greedy_outputs(eng, prompts, 40) == ref
    m = eng.metrics()
    assert m["spec_verify_rows"] > m["spec_verify_steps"] > 0, m  # trees ran
    assert m["spec_branch_wins"] > 0, m  # and a branch other than the first was taken
    assert m["spec_tokens_per_verify"] > 1.5, m
    eng.check_integrity()
    assert eng.scheduler.speculative.free_lanes() == list(range(8))


@pytest.mark.parametrize("page", [1, 4])
def test_tree_accepts_at_least_its_chain(monkeypatch, page):
    """Issue 39: on every step a tree runs, its first branch is the chain's drafts (the
    drafter's ``propose`` over the same tokens, the same length) and the tree accepts at least
    what that chain would (branch 0's row samples the chain row's tokens)."""
    from mambacache.engine.speculative.verify import SpecDecoder, accepted_drafts

    seen = []
    orig = SpecDecoder.choose_branch

    def choose(self, s, tokens):
        chain = self.drafter.propose(s.req.token_ids, len(s.drafts))
        win = orig(self, s, tokens)
        seen.append((tuple(chain) == s.drafts, accepted_drafts(s.drafts, tokens[0]),
                     accepted_drafts(win.drafts, tokens[win.branch])))
        return win

    monkeypatch.setattr(SpecDecoder, "choose_branch", choose)
    prompts = random_prompts(VOCAB, 6)
    eng = _shadow(**{"cache.page_size": page})
    assert greedy_outputs(eng, prompts, 40) == greedy_outputs(
        shadow_engine({"markov": 1, "vocab_size": VOCAB}, **{"cache.page_size": page}),
        prompts, 40)
    assert seen and all(same for same, _, _ in seen), seen
    assert all(tree >= chain for _, chain, tree in seen), seen
    assert any(tree > chain for _, chain, tree in seen), seen


def test_shadow_followup_hits_verified_prefix():
    """Only verified tokens reach the cache: a follow-up hits every computed token, and the
    tree's states and KV are those of its own path (``check_integrity``: ``check_tree``)."""
    eng = _shadow()
    prompts = random_prompts(VOCAB, 6)
    first = eng.generate(prompts, greedy(40))
    assert eng.metrics()["spec_branch_wins"] > 0
    for prompt, out in zip(prompts[:2], first[:2], strict=True):
        second = eng.generate([prompt + out.output_token_ids + [3, 4]], greedy(4))[0]
        assert second.cached_tokens == len(prompt) + 40 - 1
    eng.check_integrity()


def test_shadow_chunks_preemption_and_failure():
    prompts = random_prompts(VOCAB, 8, length=37, seed=1)
    kw = {"cache.num_kv_tokens": 100, "cache.num_mamba_slots": 5,
          "scheduler.chunked_prefill_size": 7, "scheduler.max_running_requests": 6}
    ref = greedy_outputs(shadow_engine({"markov": 1, "vocab_size": VOCAB}, **kw), prompts, 30)
    eng = _shadow(**kw)
    assert greedy_outputs(eng, prompts, 30) == ref
    m = eng.metrics()
    assert m["preemptions"] > 0 and m["spec_verify_rows"] > m["spec_verify_steps"], m
    eng.check_integrity()
    for lose in (False, True):
        eng = _shadow(runner={"fail_step": lambda step: step == 9,
                              "lose_pools_on_failure": lose})
        outs = eng.generate(prompts, greedy(30))
        assert any(o.finish_reason == "error" for o in outs)
        for out in outs:
            if out.finish_reason == "length":
                assert out.output_token_ids == eng.runner.expected_output(
                    out.prompt_token_ids, 30)
        eng.check_integrity()


def test_trees_run_synchronously():
    """On a runner that chains rows on the device (``spec_k``), a chain keeps the overlapped
    loop and a tree falls back to the synchronous one (never a tree chained in flight)."""
    from mambacache.engine.engine import Engine
    from mambacache.engine.shadow.runner import ShadowRunner

    depth = {}
    for topk in (1, 4):
        cfg = mc.EngineConfig().replace(**{**TREE, "speculative.topk": topk})
        runner = ShadowRunner.for_config(cfg)
        runner.spec_k = cfg.speculative.num_draft_tokens  # as ModelRunner's
        depth[topk] = Engine(cfg, runner=runner).loop.depth
    assert depth == {1: 1, 4: 0}


def test_planted_bug_winner_pages_not_adopted(monkeypatch):
    """The data-flow oracle catches a winner branch whose KV pages are dropped."""
    orig = Lease.settle_branches
    monkeypatch.setattr(Lease, "settle_branches",
                        lambda self, start, winner: orig(self, start, 0))
    with pytest.raises(DataflowError):
        _shadow().generate(random_prompts(VOCAB, 6), greedy(40))


def test_planted_bug_branch_page_not_copied(monkeypatch):
    """Page size 4: the oracle catches a branch row whose first page lacks the tokens before
    its start (the copy skipped); with the copy, the same run is exact and copies happened."""
    from mambacache.engine.shadow.runner import ShadowRunner

    copied = []
    orig = ShadowRunner.copy_pages
    monkeypatch.setattr(ShadowRunner, "copy_pages",
                        lambda self, pairs: (copied.extend(pairs), orig(self, pairs)))
    prompts = random_prompts(VOCAB, 6)
    assert greedy_outputs(_shadow(**{"cache.page_size": 4}), prompts, 40) == greedy_outputs(
        shadow_engine({"markov": 1, "vocab_size": VOCAB}, **{"cache.page_size": 4}), prompts, 40)
    assert copied
    monkeypatch.setattr(ShadowRunner, "copy_pages", lambda self, pairs: None)
    with pytest.raises(DataflowError):
        _shadow(**{"cache.page_size": 4}).generate(prompts, greedy(40))


# ---- the real tiny model -----------------------------------------------------------------
K = 3
NEW = 12


class CheatTree(Drafter):
    """Three branches with distinct first tokens: the reference continuation (one token in
    three after the first corrupted) at branch ``n % 3`` (so each branch index wins), the
    others wrong from their first token."""

    def __init__(self, sequences: list[list[int]], vocab: int):
        self.sequences, self.vocab = sequences, vocab

    def propose_tree_for(self, req, k: int, topk: int) -> list[list[int]]:
        tokens = req.token_ids.tolist()
        n = len(tokens)
        for seq in self.sequences:
            if k > 0 and len(seq) > n and seq[:n] == tokens:
                ref = seq[n:n + k]
                good = [t if j == 0 or (n + j) % 3 != 1 else (t + 1) % self.vocab
                        for j, t in enumerate(ref)]
                bad = [[(ref[0] + i) % self.vocab] + ref[1:] for i in (1, 2)]
                tree = bad[:n % 3] + [good] + bad[n % 3:]
                return tree[:topk]
        return []

    def propose(self, tokens, k):
        raise AssertionError("a tree drafter's chain is its first branch")


@pytest.mark.slow  # ~1 min each on 2 busy cores (the page-1 programs compile): -m slow
@pytest.mark.parametrize("sampled,overrides", [
    (False, {"scheduler.chunked_prefill_size": 13}),
    (True, {"cache.num_kv_tokens": 60, "cache.num_mamba_slots": 3}),
    (False, {"cache.page_size": 4, "scheduler.chunked_prefill_size": 13}),
    (True, {"cache.page_size": 4, "cache.num_kv_tokens": 48, "cache.num_mamba_slots": 3}),
], ids=["greedy-chunk13", "sampled-preempt", "greedy-page4", "sampled-page4-preempt"])
def test_model_same_as_none(sampled, overrides):
    ref = make_engine(**{"cache.enable": False}).generate(spec_prompts(), spec_params(sampled, NEW))
    eng = make_engine(**{**TREE, "speculative.topk": 3, "speculative.num_draft_tokens": K,
                         "scheduler.check_integrity_every_step": True, **overrides})
    eng.scheduler.speculative.drafter = CheatTree(
        [o.prompt_token_ids + o.output_token_ids for o in ref], eng.model_cfg.vocab_size)
    assert eng.loop.depth == 0  # trees run synchronously
    outs = eng.generate(spec_prompts(), spec_params(sampled, NEW))
    assert_same_outputs(outs, ref, atol=1e-4)
    m = eng.metrics()
    assert m["spec_verify_rows"] > m["spec_verify_steps"] > 0 and m["spec_branch_wins"] > 0, m
    assert m["spec_tokens_per_verify"] > 1.5, m
    if "cache.num_kv_tokens" in overrides:
        assert m["preemptions"] > 0, m
    eng.check_integrity()


@pytest.mark.slow  # ~2 min on 2 busy cores (a second model, page-4 programs)
def test_model_tree_page4_as_chain():
    """Issue 39 item 3 at page size 4: prompt lookup on the branchy tiny model (layers scaled
    by 0.2: its greedy output cycles), trees (top-k 4) give the tokens and logprobs of the
    chain and of no speculation, and at least the chain's tokens per verify."""
    from mambacache.engine.engine import Engine, load_model

    base = mc.EngineConfig().replace(**{"model.init_branch_scale": 0.2, "cache.page_size": 4,
                                        "scheduler.chunked_prefill_size": 13,
                                        "model.kernels": "reference"})
    model = load_model(base)
    rng = np.random.default_rng(5)
    seeds = [rng.integers(3, 300, 6).tolist() for _ in range(3)]
    # the next token depends mostly on the last one: ``a`` (what follows each seed prompt) is
    # planted once, then twice with other continuations, so prompt lookup of ``a[0]`` proposes
    # a tree whose later branch is the path the model takes
    prompts = []
    for p, o in zip(seeds, Engine(base, model=model).generate(
            seeds, mc.SamplingParams(max_new_tokens=4)), strict=True):
        a, z = o.output_token_ids, rng.integers(3, 300, (2, 3)).tolist()
        prompts.append([1, 2] + a + [4, 5, a[0]] + z[0] + [6, a[0]] + z[1] + [7] + p)
    sp = mc.SamplingParams(max_new_tokens=24)
    runs = {}
    for name, over in (("none", {}), ("chain", {"speculative.topk": 1}),
                       ("tree", {"speculative.topk": 4})):
        spec = {"speculative.method": "ngram", "speculative.num_draft_tokens": 4} if over else {}
        eng = Engine(base.replace(**spec, **over), model=model)
        runs[name] = eng.generate(prompts, sp), eng.metrics()
        eng.check_integrity()
    assert_same_outputs(runs["tree"][0], runs["none"][0], atol=1e-4)
    assert_same_outputs(runs["tree"][0], runs["chain"][0], atol=1e-4)
    tree, chain = runs["tree"][1], runs["chain"][1]
    assert tree["spec_verify_rows"] > tree["spec_verify_steps"] > 0, tree
    assert tree["spec_tokens_per_verify"] >= chain["spec_tokens_per_verify"] > 1.5, (tree, chain)


_TP_WORKER = """
import json
import numpy as np
import mambacache as mc
from mambacache.engine.engine import Engine
from models.mtp import with_seeded_mtp
from models.params import init_params
from models.presets import get_preset
from tests.test_spec_tree import CheatTree

model_cfg = get_preset("tiny_qwen3_next_tp4")
params = init_params(model_cfg, seed=3)
base = {"cache.num_kv_tokens": 1024, "cache.num_mamba_slots": 16, "cache.page_size": 1,
        "scheduler.max_running_requests": 4, "model.kernels": "reference",
        "speculative.num_draft_tokens": 3, "speculative.topk": 3}
rng = np.random.default_rng(0)
prompts = [rng.integers(0, 512, n).tolist() for n in (9, 23)]
sp = mc.SamplingParams(max_new_tokens=10)
result = {}
for name, model, method in (("ngram", (model_cfg, params), "ngram"),
                            ("mtp", with_seeded_mtp(model_cfg, params, seed=4), "mtp")):
    ref = Engine(mc.EngineConfig().replace(**base), model=model).generate(prompts, sp)
    cfg = mc.EngineConfig().replace(**{**base, "parallel.tensor_parallel": 2,
                                       "speculative.method": method})
    engine = Engine(cfg, model=model)
    if method == "ngram":
        engine.scheduler.speculative.drafter = CheatTree(
            [o.prompt_token_ids + o.output_token_ids for o in ref], 512)
    outs = engine.generate(prompts, sp)
    engine.check_integrity()
    m = engine.metrics()
    result[name] = dict(ref=[o.output_token_ids for o in ref],
                        tokens=[o.output_token_ids for o in outs],
                        diff=max(abs(x - y) for a, b in zip(ref, outs)
                                 for x, y in zip(a.output_logprobs, b.output_logprobs)),
                        rows=m["spec_verify_rows"], verifies=m["spec_verify_steps"],
                        wins=m["spec_branch_wins"])
print(json.dumps(result))
"""


@pytest.mark.slow
def test_tensor_parallel():
    """Trees at TP 2 (ngram with the cheat tree, the MTP head's top-k): the tokens of method
    none at TP 1, logprobs within 1e-4, trees ran and a later branch won."""
    from tests.multidevice import finish_worker, start_worker

    res = finish_worker(start_worker(_TP_WORKER), timeout=900)  # 4 engines' compiles
    for name in ("ngram", "mtp"):
        r = res[name]
        assert r["tokens"] == r["ref"] and r["diff"] <= 1e-4, (name, r)
        assert r["rows"] > r["verifies"] > 0, (name, r)
    assert res["ngram"]["wins"] > 0, res


def test_warmup_compiles_the_branch_page_copy():
    """A tree at page size > 1 copies each branch's first page before its step
    (``Runner.copy_pages``): the warm-up compiles that program too, so the first tree step
    compiles nothing while serving."""
    eng = make_engine(**{**TREE, "cache.page_size": 4})
    eng.warmup(max_seq_len=24)
    before = eng.metrics()["programs_compiled"]
    eng.runner.copy_pages([(1, 2)])  # what a tree step dispatches (free pages: no state moves)
    assert eng.metrics()["programs_compiled"] == before
    eng.check_integrity()
