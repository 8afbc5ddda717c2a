"""Per-position log-probabilities of a token sequence: prompt logprobs (``echo``) and the top
alternatives of every position, computed from scratch.

``Scorer.score(ids, top_n)`` runs the model once over ``ids`` with the zero initial state, on
scratch pools of its own (KV pages for the sequence, no state slot kept): it never reads the
radix cache and never writes the engine's pools, so a prefix being cached or not cannot change
its values, and a cached prefix is never disturbed. Entry ``i`` is ``log p(ids[i] | ids[:i])``
(``None`` for ``i = 0``); ``top[i]`` the ``top_n`` most likely tokens at position ``i`` with
their logprobs (the unscaled distribution, as the sampler reports logprobs).

Who calls it: the server, on the engine thread (``EngineLoop.call``), since it runs the model
on the engine's device and params. Shapes are bucketed (tokens to a power of two >= 16) so a
few programs serve every length. One device only: a tensor-parallel engine is refused.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from mambacache.engine.runners.loading import model_dtype
from mambacache.engine.runners.pools import PoolState
from mambacache.engine.step.batch import build_forward_batch
from mambacache.engine.step.plan import SeqSpec
from models.model import forward
from pallas_kernels.fixed_order import log_softmax

if TYPE_CHECKING:
    from mambacache.engine.engine import Engine
    from models.config import ModelConfig

MAX_TOP_N = 20  # OpenAI's limit for top_logprobs; computed always, sliced on the host
MIN_TOKENS_BUCKET = 16


@dataclasses.dataclass(frozen=True)
class Scored:
    """``logprobs[i]``: log p(ids[i] | ids[:i]), None at 0; ``top[i]``: [(id, logprob)] at i."""

    ids: list[int]
    logprobs: list[float | None]
    top: list[list[tuple[int, float]]]


def tokens_bucket(n: int) -> int:
    return max(MIN_TOKENS_BUCKET, 1 << (max(n, 1) - 1).bit_length())


@functools.cache
def _score_fn(cfg: ModelConfig, kernels: str):
    def run(params, pools, batch, targets):
        _, logits = forward(params, pools, batch, cfg=cfg, kernels=kernels)
        # [deterministic] the same fixed-order sum as the sampler's logprobs
        logprobs = log_softmax(logits.astype(jnp.float32),
                               fixed_order=getattr(cfg, "deterministic", False))
        picked = jnp.take_along_axis(logprobs, targets[:, None], axis=-1)[:, 0]
        top_lp, top_id = jax.lax.top_k(logprobs, MAX_TOP_N)
        return picked, top_lp, top_id

    return jax.jit(run)


class Scorer:
    """Scores sequences with ``engine``'s model on scratch pools (grown to the longest bucket)."""

    def __init__(self, engine: Engine):
        if getattr(engine, "mesh", None) is not None:
            raise ValueError("prompt / top logprobs need a one-device engine; this one is "
                             "tensor parallel (parallel.tensor_parallel > 1)")
        self.engine = engine
        self.page_size = engine.cfg.cache.page_size
        self.pools: PoolState | None = None
        self.num_pages = 0

    def _pools_for(self, num_tokens: int) -> PoolState:
        pages = -(-num_tokens // self.page_size)
        if self.pools is None or pages > self.num_pages:
            self.pools = PoolState.create(self.engine.model_cfg, pages, self.page_size, 1,
                                          model_dtype(self.engine.cfg))
            self.num_pages = pages
        return self.pools

    def score(self, ids: Sequence[int], top_n: int = 0) -> Scored:
        """Logprobs of ``ids`` (``0 <= top_n <= 20`` alternatives per position)."""
        ids = [int(t) for t in ids]
        limit = self.engine.model_cfg.max_position_embeddings
        if not 1 <= len(ids) <= limit:
            raise ValueError(f"scoring {len(ids)} tokens, the limit is [1, {limit}]")
        if not 0 <= top_n <= MAX_TOP_N:
            raise ValueError(f"top logprobs {top_n}, the limit is {MAX_TOP_N}")
        T = tokens_bucket(len(ids))
        pools = self._pools_for(T)
        # pages 1..n (page 0 is the dump page); read slot 0 = zero state, write slot 0 dropped
        spec = SeqSpec(tokens=ids, prefix_len=0, page_ids=list(range(1, self.num_pages + 1)),
                       read_slot=0, write_slot=0, snapshots=[], logits="all")
        batch = build_forward_batch([spec], self.page_size, num_tokens=T,
                                    num_pages_per_seq=self.num_pages, num_logits=T)
        targets = np.zeros(T, np.int32)
        targets[:len(ids) - 1] = ids[1:]
        runner = self.engine.runner
        fn = _score_fn(self.engine.model_cfg, runner.kernels)
        picked, top_lp, top_id = jax.device_get(fn(runner.params, pools, batch,
                                                   jnp.asarray(targets)))
        n = len(ids)
        logprobs: list[float | None] = [None] + [float(x) for x in picked[:n - 1]]
        # the distribution at position i (i >= 1) is the logits row of token i - 1
        top = [[]] + [[(int(t), float(lp)) for t, lp in zip(top_id[i, :top_n], top_lp[i, :top_n],
                                                            strict=True)]
                      for i in range(n - 1)]
        return Scored(ids, logprobs, top)
