"""Speculative decoding on the real tiny model (fp32, reference kernels): the tokens of
``method = "none"`` exactly, logprobs within 1e-4, greedy and seeded sampling, pages 1 and 4,
cache on and off, chunk cuts, preemption; a follow-up request hits the verified prefix; and
a statistical test that accepting while the target's sample equals the draft keeps the target
distribution.

A random-weight model rarely repeats its prompt, so most tests drive the verify path with a
drafter that knows the reference continuation and corrupts one draft in three: drafts are
accepted up to a random offset, so the rollback reads the state of every offset."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mambacache as mc
from mambacache.engine.sampling.sampler import SamplingBatch, sample
from mambacache.engine.speculative.drafters import Drafter
from mambacache.engine.speculative.verify import accepted_drafts
from tests.engine_helpers import (
    assert_same_outputs,
    make_engine,
    rand_tokens,
    spec_params,
    spec_prompts,
)

K = 3
NEW = 12


class CheatDrafter(Drafter):
    """Proposes the reference continuation with every token at a position ``p % 3 == 1``
    replaced (so acceptance stops at varying offsets)."""

    def __init__(self, sequences: list[list[int]], vocab: int):
        self.sequences, self.vocab = sequences, vocab

    def propose(self, tokens: np.ndarray, k: int) -> list[int]:
        n = len(tokens)
        for seq in self.sequences:
            if len(seq) > n and seq[:n] == tokens.tolist():
                return [(t + 1) % self.vocab if (n + j) % 3 == 1 else t
                        for j, t in enumerate(seq[n:n + k])]
        return []


@pytest.fixture(scope="module")
def references():
    """method none, cache off: {sampled: outputs}."""
    eng = make_engine(**{"cache.enable": False})
    return {sampled: eng.generate(spec_prompts(), spec_params(sampled, NEW))
            for sampled in (False, True)}


def _spec_engine(outs, **overrides):
    eng = make_engine(**{"speculative.method": "ngram", "speculative.num_draft_tokens": K,
                         "scheduler.check_integrity_every_step": True, **overrides})
    eng.scheduler.speculative.drafter = CheatDrafter(
        [o.prompt_token_ids + o.output_token_ids for o in outs], eng.model_cfg.vocab_size)
    return eng


SLOW = pytest.mark.slow  # ~1-2 min each on 2 busy CPU cores (compiles): -m slow


@pytest.mark.parametrize("sampled,overrides", [
    (False, {"cache.page_size": 4, "scheduler.chunked_prefill_size": 13}),
    pytest.param(False, {"cache.page_size": 1}, marks=SLOW),
    pytest.param(False, {"cache.page_size": 4, "cache.enable": False}, marks=SLOW),
    pytest.param(False, {"cache.page_size": 4, "cache.num_kv_tokens": 52,
                         "cache.num_mamba_slots": 3}, marks=SLOW),
    pytest.param(True, {"cache.page_size": 1}, marks=SLOW),
], ids=["page4-chunk13", "page1", "page4-cache-off", "page4-preempt", "sampled-page1"])
def test_same_as_none(references, sampled, overrides):
    ref = references[sampled]
    eng = _spec_engine(ref, **overrides)
    outs = eng.generate(spec_prompts(), spec_params(sampled, NEW))
    assert_same_outputs(outs, ref, atol=1e-4)
    m = eng.metrics()
    assert m["spec_verify_steps"] > 0 and 0 < m["spec_accepted_tokens"] < m["spec_draft_tokens"]
    # overlapped (depth 1) as well: drafts made on the host wait for the tokens (issue 39)
    assert m["spec_tokens_per_verify"] > 1.5, m
    if "cache.num_kv_tokens" in overrides:
        assert m["preemptions"] > 0, m
    eng.check_integrity()


@SLOW
@pytest.mark.parametrize("page", [1, 4])
def test_followup_hits_verified_prefix(references, page):
    ref = references[False]
    eng = _spec_engine(ref, **{"cache.page_size": page})
    first = eng.generate(spec_prompts()[:1], spec_params(False, NEW)[:1])[0]
    assert first.output_token_ids == ref[0].output_token_ids
    follow = first.prompt_token_ids + first.output_token_ids + [5, 6]
    second = eng.generate([follow], mc.SamplingParams(max_new_tokens=3))[0]
    computed = len(first.prompt_token_ids) + NEW - 1
    assert second.cached_tokens == computed // page * page
    plain = make_engine(**{"cache.enable": False}).generate([follow],
                                                             mc.SamplingParams(max_new_tokens=3))
    assert_same_outputs([second], plain)


@SLOW
def test_ngram_drafter_exact(references):
    """The real drafter (prompt lookup) on prompts that repeat themselves: exact as well."""
    rng = np.random.default_rng(11)
    prompts = [(lambda b: b * 3 + b[:4])(rand_tokens(rng, 8)) for _ in range(2)]
    params = mc.SamplingParams(max_new_tokens=NEW)
    ref = make_engine(**{"cache.enable": False}).generate(prompts, params)
    eng = make_engine(**{"speculative.method": "ngram", "speculative.num_draft_tokens": K})
    assert_same_outputs(eng.generate(prompts, params), ref)
    assert eng.metrics()["spec_draft_tokens"] > 0


def _verify_trials(logits_table: jax.Array, drafts: list[int], num: int) -> np.ndarray:
    """``num`` seeded runs of the engine's procedure from token 0: verify rows sample the target
    at every position with fold_in(seed, output index), accept while equal to the draft, repeat
    until two tokens are out. Returns ``int[num, 2]``."""
    k, vocab = len(drafts), logits_table.shape[0]
    out = np.zeros((num, 2), np.int64)
    seeds = np.arange(num)
    last = np.zeros(num, np.int64)
    done = np.zeros(num, np.int64)
    while (done < 2).any():
        rows = np.concatenate([last[:, None], np.tile(drafts, (num, 1))], axis=1)  # [num, k+1]
        steps = done[:, None] + np.arange(k + 1)
        sb = SamplingBatch(temperature=jnp.ones(num * (k + 1)), top_k=jnp.zeros(num * (k + 1),
                           jnp.int32), top_p=jnp.ones(num * (k + 1)),
                           seed=jnp.asarray(np.repeat(seeds, k + 1), jnp.int32),
                           step=jnp.asarray(steps.reshape(-1), jnp.int32))
        tokens, _ = sample(logits_table[rows.reshape(-1)], sb)
        tokens = np.asarray(tokens).reshape(num, k + 1)
        for i in np.flatnonzero(done < 2):
            emitted = tokens[i, :accepted_drafts(tuple(drafts), tokens[i]) + 1]
            take = emitted[:2 - done[i]]
            out[i, done[i]:done[i] + len(take)] = take
            done[i] += len(take)
            last[i] = take[-1]
    assert vocab == logits_table.shape[1]
    return out


def test_rejection_sampling_keeps_the_target_distribution():
    """Tiny vocabulary (4), a Markov target, drafts [1, 1] (often right, often wrong): the
    joint law of the first two emitted tokens is the target's (chi-square, 15 dof)."""
    logits = jnp.log(jnp.asarray([[0.1, 0.6, 0.2, 0.1], [0.3, 0.4, 0.2, 0.1],
                                  [0.25, 0.25, 0.25, 0.25], [0.7, 0.1, 0.1, 0.1]]))
    num = 20000
    got = _verify_trials(logits, [1, 1], num)
    p = np.exp(np.asarray(logits))
    expected = num * p[0][:, None] * p  # P(y1) P(y2 | y1), starting after token 0
    counts = np.zeros((4, 4))
    np.add.at(counts, (got[:, 0], got[:, 1]), 1)
    chi2 = ((counts - expected) ** 2 / expected).sum()
    assert chi2 < 37.7, (chi2, counts)  # p = 0.001 critical value at 15 dof
    # the test has power: emitting the draft whenever it is rejected is caught
    wrong = got.copy()
    wrong[got[:, 0] != 1, 0] = 1
    counts_w = np.zeros((4, 4))
    np.add.at(counts_w, (wrong[:, 0], wrong[:, 1]), 1)
    assert ((counts_w - expected) ** 2 / expected).sum() > 1000


@SLOW
@pytest.mark.parametrize("preset", ["tiny_qwen3_5", "tiny_nemotron_h", "tiny_granite_4_h",
                                    "tiny_kimi_linear"])
def test_every_family(preset):
    """Every family's recurrent layers write the per-offset states of a verify row through the
    same ops (snapshot targets): tokens and logprobs of method none, page 4, cache on."""
    from mambacache.engine.engine import Engine, load_model

    cfg = mc.EngineConfig().replace(**{"model.preset": preset, "model.kernels": "reference",
                                       "cache.page_size": 4, "cache.num_mamba_slots": 16,
                                       "cache.num_kv_tokens": 2000})
    model = load_model(cfg)
    params = spec_params(False, NEW)
    ref = Engine(cfg.replace(**{"cache.enable": False}), model=model).generate(spec_prompts(),
                                                                               params)
    eng = Engine(cfg.replace(**{"speculative.method": "ngram", "speculative.num_draft_tokens": K,
                                "scheduler.check_integrity_every_step": True}), model=model)
    eng.scheduler.speculative.drafter = CheatDrafter(
        [o.prompt_token_ids + o.output_token_ids for o in ref], model[0].vocab_size)
    assert_same_outputs(eng.generate(spec_prompts(), params), ref)
    assert eng.metrics()["spec_accepted_tokens"] > 0


_TP_WORKER = """
import json
import numpy as np
import mambacache as mc
from mambacache.engine.engine import Engine
from models.params import init_params
from models.presets import get_preset
from tests.test_speculative_engine import CheatDrafter

model_cfg = get_preset("tiny_qwen3_next_tp4")
params = init_params(model_cfg, seed=3)
base = {"cache.num_kv_tokens": 1024, "cache.num_mamba_slots": 16, "cache.page_size": 1,
        "scheduler.max_running_requests": 4, "model.kernels": "reference",
        "speculative.num_draft_tokens": 3}
rng = np.random.default_rng(0)
prompts = [rng.integers(0, 512, n).tolist() for n in (9, 23)]
sp = mc.SamplingParams(max_new_tokens=10)
ref = Engine(mc.EngineConfig().replace(**base), model=(model_cfg, params)).generate(prompts, sp)
seqs = [o.prompt_token_ids + o.output_token_ids for o in ref]
result = {"ref": [o.output_token_ids for o in ref]}
for tp in (1, 2):
    cfg = mc.EngineConfig().replace(**{**base, "parallel.tensor_parallel": tp,
                                       "speculative.method": "ngram"})
    engine = Engine(cfg, model=(model_cfg, params))
    engine.scheduler.speculative.drafter = CheatDrafter(seqs, 512)
    outs = engine.generate(prompts, sp)
    follow = engine.generate([seqs[0] + [7, 8]], mc.SamplingParams(max_new_tokens=3))
    result[tp] = dict(tokens=[o.output_token_ids for o in outs + follow],
                      logprobs=[o.output_logprobs for o in outs + follow],
                      cached=follow[0].cached_tokens,
                      accepted=engine.metrics()["spec_accepted_tokens"],
                      ssm_sharding=str(getattr(engine.runner.pools.ssm[0].sharding, "spec", "")))
    engine.check_integrity()
from models.mtp import with_seeded_mtp
mtp_model = with_seeded_mtp(model_cfg, params, seed=4)
for tp in (1, 2):  # the MTP drafter's sharded step (its KV layer, drafts over a split vocab)
    cfg = mc.EngineConfig().replace(**{**base, "parallel.tensor_parallel": tp,
                                       "speculative.method": "mtp"})
    engine = Engine(cfg, model=mtp_model)
    outs = engine.generate(prompts, sp)
    result[f"mtp{tp}"] = dict(tokens=[o.output_token_ids for o in outs],
                              drafts=engine.metrics()["spec_draft_tokens"])
print(json.dumps(result))
"""


@SLOW
def test_tensor_parallel():
    """TP 2 with verify rows and the end-state copy: the tokens and logprobs of TP 1, the
    follow-up hits the verified prefix, the pools keep their sharding through ``copy_slots``."""
    from tests.multidevice import run_worker

    res = run_worker(_TP_WORKER)
    one, two = res["1"], res["2"]
    assert one["tokens"][:2] == two["tokens"][:2] == res["ref"]
    assert one["tokens"] == two["tokens"] and one["accepted"] > 0
    for a, b in zip(one["logprobs"], two["logprobs"], strict=True):
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) <= 1e-4
    assert one["cached"] == two["cached"] == 9 + 10 - 1
    assert "tp" in two["ssm_sharding"], two["ssm_sharding"]
    assert res["mtp1"]["tokens"] == res["mtp2"]["tokens"] == res["ref"]
    assert res["mtp1"]["drafts"] > 0 and res["mtp2"]["drafts"] > 0
