"""Sampling parameters (host) and the jitted sampler (device).

Each request draws with its own key, ``fold_in(key(seed), output_index)``, so a request's tokens
do not depend on which other requests share its batch or on whether the cache served its prompt.
Penalties and grammar masks (``engine/sampling/logit_controls.py``) change the logits a row samples
from; the logprob returned is the model's own (before them), as vLLM's default reports it.

[deterministic] ``sample(..., fixed_order=True)`` (``model.deterministic``): every row sum of the
sampler (``log_softmax``, the top-p softmax and its cumulative sum) takes the fixed order of
``pallas_kernels/fixed_order.py``, so a seeded request samples the same tokens alone or batched.
The sort, ``argmax`` and the Gumbel draw are exact whatever the batch.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from mambacache.engine.sampling.logit_controls import LogitControls, apply_controls
from mambacache.engine.sampling.params import SamplingParams
from pallas_kernels.fixed_order import log_softmax, prefix_sum, softmax

INT32_MAX = int(np.iinfo(np.int32).max)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling inputs, ``[L]`` each: float32 temperature/top_p, int32 the rest."""

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    seed: jax.Array
    step: jax.Array  # index of the token being sampled within its request's output
    controls: LogitControls | None = None  # penalties / masks; None: no row has any

    @classmethod
    def from_params(cls, params: list[SamplingParams | None], steps: list[int],
                    num_rows: int, controls: LogitControls | None = None) -> SamplingBatch:
        """Rows past ``len(params)`` (or ``None`` rows) are padding and sample greedily.
        Packing never raises for one row: ``SamplingParams`` bounds every field, and ``top_k`` is
        clipped to int32 regardless (a top_k at or past the vocabulary is no limit), so a row
        whose checks were bypassed cannot fail the other rows of its step."""
        temp = np.zeros(num_rows, np.float32)
        top_k = np.zeros(num_rows, np.int32)
        top_p = np.ones(num_rows, np.float32)
        seed = np.zeros(num_rows, np.int32)
        step = np.zeros(num_rows, np.int32)
        for i, p in enumerate(params):
            if p is not None:
                temp[i], top_p[i], seed[i] = p.temperature, p.top_p, p.seed
                top_k[i] = min(max(int(p.top_k), 0), INT32_MAX)
                step[i] = steps[i]
        return cls(temperature=temp, top_k=top_k, top_p=top_p, seed=seed, step=step,
                   controls=controls)


def _sample_row(logits: jax.Array, temp, top_k, top_p, seed, step, *,
                fixed_order: bool = False):
    """logits ``[V]`` float32 -> (token int32, logprob float32 of that token, unscaled)."""
    logprobs = log_softmax(logits, fixed_order=fixed_order)
    greedy = jnp.argmax(logits).astype(jnp.int32)
    order = jnp.argsort(-logits)
    sorted_logits = logits[order] / jnp.maximum(temp, 1e-6)
    rank = jnp.arange(logits.shape[0])
    keep = jnp.where(top_k > 0, rank < top_k, True)
    probs = softmax(jnp.where(keep, sorted_logits, -jnp.inf), fixed_order=fixed_order)
    keep = keep & (prefix_sum(probs, fixed_order=fixed_order) - probs < top_p)
    key = jax.random.fold_in(jax.random.key(seed), step)
    pick = jax.random.categorical(key, jnp.where(keep, sorted_logits, -jnp.inf))
    token = jnp.where(temp > 0, order[pick].astype(jnp.int32), greedy)
    return token, logprobs[token]


def _greedy_rows(logits: jax.Array, *, fixed_order: bool = False) -> tuple[jax.Array, jax.Array]:
    """Every row greedy: argmax and its log-probability, no sort of the vocabulary."""
    token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logprobs = log_softmax(logits, fixed_order=fixed_order)
    return token, jnp.take_along_axis(logprobs, token[:, None], axis=-1)[:, 0]


def sample(logits: jax.Array, sb: SamplingBatch, *,
           fixed_order: bool = False) -> tuple[jax.Array, jax.Array]:
    """logits ``[L, V]`` -> tokens int32 ``[L]``, logprobs float32 ``[L]``. A step whose rows
    are all greedy (temperature 0) skips the per-row sort of the vocabulary (``lax.cond`` on
    the device: one program either way); its tokens and logprobs are the same. With
    ``sb.controls`` the rows sample from the controlled logits; logprobs are the raw logits'.
    ``fixed_order``: the module docstring's [deterministic] note."""
    logits = logits.astype(jnp.float32)
    row = functools.partial(_sample_row, fixed_order=fixed_order)
    greedy = functools.partial(_greedy_rows, fixed_order=fixed_order)

    def full(x: jax.Array) -> tuple[jax.Array, jax.Array]:
        return jax.vmap(row)(x, sb.temperature, sb.top_k, sb.top_p, sb.seed, sb.step)

    if sb.controls is None:
        return jax.lax.cond(jnp.all(sb.temperature <= 0), greedy, full, logits)
    controlled = apply_controls(logits, sb.controls)
    tokens, _ = jax.lax.cond(jnp.all(sb.temperature <= 0), greedy, full, controlled)
    raw = log_softmax(logits, fixed_order=fixed_order)
    return tokens, jnp.take_along_axis(raw, tokens[:, None], axis=-1)[:, 0]
