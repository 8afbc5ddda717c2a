"""Penalties and grammar masks (``engine/sampling/logit_controls.py``): exact against a numpy
reference written from the definitions, on the device inside the sampler, and through the engine
(the overlapped loop feeds every row its whole history; a mask holds every sampled token)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mambacache as mc
from mambacache.engine.sampling.logit_controls import (
    RowControls,
    apply_controls,
    history_counts,
    pack_controls,
)
from mambacache.engine.sampling.sampler import SamplingBatch, sample
from tests.engine_helpers import make_engine, rand_tokens

VOCAB = 97


def reference(logits: np.ndarray, prompt: list[int], output: list[int],
              p: mc.SamplingParams, allowed: np.ndarray | None = None) -> np.ndarray:
    """One row, from the definitions: token by token over the vocabulary, float32."""
    out = logits.astype(np.float32).copy()
    rep = np.float32(p.repetition_penalty)
    for t in range(len(out)):
        if p.repetition_penalty != 1.0 and (t in prompt or t in output):
            out[t] = out[t] / rep if out[t] > 0 else out[t] * rep
        c = np.float32(output.count(t))
        out[t] = out[t] - (np.float32(p.frequency_penalty) * c
                           + np.float32(p.presence_penalty) * np.float32(c > 0))
    if allowed is not None:
        out[~allowed] = -np.inf
    return out


class FakeRequest:
    def __init__(self, prompt, output, params):
        self.prompt, self.output_ids, self.params = np.asarray(prompt, np.int32), output, params


class SetMatcher:
    """A constraint allowing a fixed set of tokens (a stand-in for a grammar)."""

    def __init__(self, allowed: set[int]):
        self.allowed, self.seen = allowed, []

    def fill_bitmask(self, out: np.ndarray) -> None:
        out[:] = 0
        for t in self.allowed:
            out[t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))

    def accept(self, token: int) -> bool:
        self.seen.append(token)
        return token in self.allowed

    @property
    def done(self) -> bool:
        return False


class SetConstraint:
    def __init__(self, allowed: set[int]):
        self.allowed, self.matchers = allowed, []

    def matcher(self) -> SetMatcher:
        self.matchers.append(SetMatcher(self.allowed))
        return self.matchers[-1]


def _case(seed: int, rows: int = 5):
    rng = np.random.default_rng(seed)
    logits = (rng.normal(size=(rows, VOCAB)) * 3).astype(np.float32)
    logits[:, :8] = rng.choice([-0.0, 0.0, 1.5, -1.5], size=(rows, 8))  # signs, zeros
    cases = []
    for _ in range(rows):
        params = mc.SamplingParams(
            presence_penalty=float(rng.choice([0.0, 0.5, -1.25, 2.0])),
            frequency_penalty=float(rng.choice([0.0, 0.3, -2.0, 1.1])),
            repetition_penalty=float(rng.choice([1.0, 1.3, 0.7, 2.0])))
        prompt = rng.integers(0, VOCAB, rng.integers(1, 30)).tolist()
        output = rng.integers(0, 12, rng.integers(0, 40)).tolist()  # repeats
        cases.append((prompt, output, params))
    return logits, cases


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_penalties_and_masks_equal_the_numpy_reference_bit_for_bit(seed):
    logits, cases = _case(seed)
    rng = np.random.default_rng(100 + seed)
    rows, expected = [], []
    for i, (prompt, output, p) in enumerate(cases):
        allowed = rng.random(VOCAB) < 0.5 if i % 2 else None
        matcher = SetMatcher(set(np.flatnonzero(allowed).tolist())) if i % 2 else None
        ids, counts = history_counts(FakeRequest(prompt, output, p))
        rows.append(RowControls(i, p, ids, counts, matcher))
        expected.append(reference(logits[i], prompt, output, p, allowed))
    c = pack_controls(rows, len(cases) + 1, VOCAB)  # the last row: padding, unchanged
    got = np.asarray(jax.jit(apply_controls)(jnp.asarray(np.vstack([logits, logits[:1]])), c))
    np.testing.assert_array_equal(got[:-1], np.stack(expected))
    np.testing.assert_array_equal(got[-1], logits[0])


def test_sampler_picks_from_controlled_logits_and_reports_the_models_logprobs():
    logits, cases = _case(3, rows=4)
    rows = [RowControls(i, p, *history_counts(FakeRequest(pr, out, p)))
            for i, (pr, out, p) in enumerate(cases)]
    params = [p for _, _, p in cases]
    sb = SamplingBatch.from_params(params, [0] * 4, 4, pack_controls(rows, 4, VOCAB))
    tokens, logprobs = jax.jit(sample)(jnp.asarray(logits), sb)
    ref = np.stack([reference(logits[i], pr, out, p) for i, (pr, out, p) in enumerate(cases)])
    np.testing.assert_array_equal(tokens, ref.argmax(-1))
    raw = np.asarray(jax.nn.log_softmax(jnp.asarray(logits), axis=-1))
    np.testing.assert_allclose(logprobs, raw[np.arange(4), ref.argmax(-1)], atol=1e-6, rtol=0)


def test_penalty_bounds_name_the_field_and_the_limit():
    for kwargs, words in [({"presence_penalty": 2.5}, ["presence_penalty", "[-2, 2]", "2.5"]),
                          ({"frequency_penalty": -3}, ["frequency_penalty", "[-2, 2]"]),
                          ({"repetition_penalty": 0.0}, ["repetition_penalty", "(0, 2]"]),
                          ({"repetition_penalty": 2.5}, ["repetition_penalty", "(0, 2]"]),
                          ({"constraint": object()}, ["constraint", "matcher"])]:
        with pytest.raises(ValueError) as err:
            mc.SamplingParams(**kwargs)
        assert all(w in str(err.value) for w in words), (kwargs, str(err.value))


def test_engine_penalties_read_every_token_whatever_the_overlap():
    """The overlapped loop holds a penalized request back while its token is on the device:
    its tokens equal the synchronous loop's, and differ from the same prompt's unpenalized
    ones (rows 0 and 1 share a prompt): negative penalties make it repeat its tokens."""
    prompts = [rand_tokens(np.random.default_rng(i), 12) for i in (0, 0, 2)]
    pen = mc.SamplingParams(max_new_tokens=12, repetition_penalty=0.5, frequency_penalty=-2.0,
                            presence_penalty=-1.0, ignore_eos=True)
    plain = mc.SamplingParams(max_new_tokens=12, ignore_eos=True)
    mixed = [pen, plain, pen]
    over = make_engine(**{"scheduler.overlap": True}).generate(prompts, mixed)
    sync = make_engine(**{"scheduler.overlap": False}).generate(prompts, mixed)
    for a, b in zip(over, sync, strict=True):
        assert a.output_token_ids == b.output_token_ids
    assert len(set(over[0].output_token_ids)) < len(set(over[1].output_token_ids))


def test_engine_mask_holds_every_sampled_token():
    allowed = {3, 40, 41, 77, 200}
    con = SetConstraint(allowed)
    params = [mc.SamplingParams(max_new_tokens=16, temperature=1.0, seed=s, constraint=con,
                                ignore_eos=True) for s in range(2)]
    outs = make_engine().generate([rand_tokens(np.random.default_rng(9), 10)] * 2, params)
    for out, m in zip(outs, con.matchers, strict=True):
        assert len(out.output_token_ids) == 16 and set(out.output_token_ids) <= allowed
        assert m.seen == out.output_token_ids  # every token went through its matcher once


def test_warmup_with_logit_controls_leaves_nothing_to_compile():
    """``warmup(logit_controls=True)`` compiles the penalty / grammar variant of every step
    shape: penalized and constrained requests then compile nothing; after a plain warm-up the
    same requests compile their programs (pages of 2: shapes no other test here compiles)."""
    prompts = [rand_tokens(np.random.default_rng(i), n) for i, n in ((3, 12), (4, 40), (5, 7))]
    pen = mc.SamplingParams(max_new_tokens=9, repetition_penalty=1.3, presence_penalty=0.5,
                            ignore_eos=True)
    masked = mc.SamplingParams(max_new_tokens=9, constraint=SetConstraint({3, 40, 77}),
                               ignore_eos=True)
    params = [pen, masked, mc.SamplingParams(max_new_tokens=9)]
    cfg = {"cache.page_size": 2, "scheduler.max_running_requests": 4}
    plain = make_engine(**cfg)
    assert plain.warmup(max_seq_len=64)["controls_programs"] == 0
    plain.generate(prompts, params)
    assert plain.metrics()["programs_compiled"] > 0  # the controlled variants, on first use
    eng = make_engine(**cfg, **{"scheduler.chunked_prefill_size": 32})  # other shapes again
    warm = eng.warmup(max_seq_len=64, logit_controls=True)
    assert warm["controls_programs"] == warm["programs"] > 0, warm
    outs = eng.generate(prompts, params)
    assert eng.metrics()["programs_compiled"] == 0, eng.metrics()
    assert set(outs[1].output_token_ids) <= {3, 40, 77}
