"""The jitted step programs: the model's forward over a ``ForwardBatch`` with the pools donated,
then the sampler (and the MTP head's drafts, the speculative chain's carry), one program family
per (model config, kernels, decode, kernel family), cached so engines over the same model share
compiled programs; the slot copy program. ``runners/model_runner.py`` pads steps to their shapes and
calls them; ``parallel/sizing.py`` compiles them for a mesh without running.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from mambacache.engine.runners.pools import PoolState
from mambacache.engine.sampling.sampler import SamplingBatch, sample
from mambacache.engine.speculative import chain_step
from mambacache.engine.step.batch import ForwardBatch
from models.model import forward as model_forward
from models.mtp import mtp_draft
from pallas_kernels import ops


def with_known_tokens(batch: ForwardBatch, tokens: jax.Array,
                      prev_index: jax.Array) -> ForwardBatch:
    """[overlap] ``batch`` with each ``prev_index`` >= 0 position's input id read from the
    previous step's sampled ``tokens`` int32 ``[F]`` (row ``prev_index``); -1 keeps the id."""
    ids = jnp.where(prev_index >= 0, tokens[jnp.maximum(prev_index, 0)], batch.input_ids)
    return dataclasses.replace(batch, input_ids=ids)


def write_future(future: jax.Array, tokens: jax.Array) -> jax.Array:
    """``future`` int32 ``[F]`` with its first ``min(L, F)`` rows the sampled ``tokens``
    int32 ``[L]`` (logits row i at i), what the next step's ``with_known_tokens`` reads."""
    n = min(tokens.shape[0], future.shape[0])
    return future.at[:n].set(tokens[:n])


def _step(params: Any, pools: PoolState, future: Any, batch: ForwardBatch,
          sb: SamplingBatch, prev_index: jax.Array, spec_in: Any = None, *, cfg: Any,
          kernels: str, decode: bool, mesh: Any = None, num_drafts: int = 0, spec_k: int = 0,
          num_alts: int = 0):
    """``future`` int32 ``[F]`` (donated): the previous step's sampled tokens, logits row i at
    i; ``prev_index`` int32 ``[T]``: -1 (the token in ``batch.input_ids`` is known) or the row
    of ``future`` that holds the token [overlap]. Returns the new ``future`` with the pools.
    [speculative] ``spec_k`` > 0: ``future`` is the carry of ``chain_step.empty_carry`` and
    ``spec_in`` the step's ``drafters.mtp_inputs`` + ``speculative.chain.chain_inputs`` (chained
    rows are shifted by the previous step's outcome); ``num_drafts`` > 0: the MTP head drafts that
    many tokens per sequence for the next step (``models/mtp.py``), returned last, then
    ``num_alts`` alternatives to the first [speculative tree]."""
    draft_ids = None
    if spec_k:
        batch, sb, draft_ids = chain_step.apply(batch, sb, future, spec_in,
                                                page_size=pools.k_pages[0].shape[1],
                                                mtp=num_drafts > 0)
    batch = with_known_tokens(batch, future["tokens"] if spec_k else future, prev_index)
    out = model_forward(params, pools, batch, cfg=cfg, kernels=kernels, decode=decode,
                        mesh=mesh, return_hidden=num_drafts > 0)
    pools, logits = out[:2]
    deterministic = getattr(cfg, "deterministic", False)
    # [deterministic] the sampler's row sums in a fixed order (engine/sampling/sampler.py)
    tokens, logprobs = sample(logits, sb, fixed_order=deterministic)
    drafts = None
    if num_drafts:
        impl = ops.resolve_impl(kernels)
        pools, drafts = mtp_draft(params, pools, batch, out[2], tokens,
                                  {**spec_in, "draft_ids": draft_ids}, cfg=cfg,
                                  num_drafts=num_drafts, impl=impl, mesh=mesh,
                                  num_alts=num_alts)
    if spec_k:
        future = chain_step.outcome(future, tokens, spec_in, draft_ids, drafts)
    else:
        future = write_future(future, tokens)
    if not num_drafts:
        return pools, future, tokens, logprobs
    return pools, future, tokens, logprobs, drafts


def jitted_step(cfg: Any, kernels: str, decode: bool, num_drafts: int = 0, spec_k: int = 0,
                num_alts: int = 0):
    """One jitted program family per (model config, kernels, decode, kernel family): engines over
    the same model share compiled programs. Pools (argument 1) are donated.

    One program per ``buckets.StepShape`` (and pool shapes).
    """
    return _jitted_step(cfg, kernels, decode, ops.kernel_family(), num_drafts, spec_k, num_alts)


@functools.cache
def _jitted_step(cfg: Any, kernels: str, decode: bool, family: str, num_drafts: int = 0,
                 spec_k: int = 0, num_alts: int = 0):
    del family  # a cache key only: ``ops`` reads PALLAS_FAMILY when tracing
    return jax.jit(functools.partial(_step, cfg=cfg, kernels=kernels, decode=decode,
                                     num_drafts=num_drafts, spec_k=spec_k, num_alts=num_alts),
                   donate_argnums=(1, 2))


def jitted_sharded_step(cfg: Any, kernels: str, decode: bool, pool_sh: Any, out_sh: Any,
                        mesh: Any, num_drafts: int = 0, spec_k: int = 0, num_alts: int = 0):
    """``jitted_step`` pinned to ``mesh`` (tensor parallel, ``mambacache.parallel.mesh``):
    params come placed (their shardings are the inputs'), pools keep ``pool_sh`` across steps,
    tokens and logprobs come back with ``out_sh`` (replicated). The model runs every kernel op
    per device in ``shard_map`` over the mesh's ``"tp"`` axis (``pallas_kernels.ops``)."""
    return _jitted_sharded_step(cfg, kernels, decode, pool_sh, out_sh, mesh, ops.kernel_family(),
                                num_drafts, spec_k, num_alts)


@functools.cache
def _jitted_sharded_step(cfg: Any, kernels: str, decode: bool, pool_sh: Any, out_sh: Any,
                         mesh: Any, family: str, num_drafts: int = 0, spec_k: int = 0,
                         num_alts: int = 0):
    del family  # a cache key only, as in ``_jitted_step``
    outs = (pool_sh, out_sh, out_sh, out_sh) + ((out_sh,) if num_drafts else ())
    return jax.jit(functools.partial(_step, cfg=cfg, kernels=kernels, decode=decode, mesh=mesh,
                                     num_drafts=num_drafts, spec_k=spec_k, num_alts=num_alts),
                   donate_argnums=(1, 2), out_shardings=outs)


def _step_logits(params: Any, pools: PoolState, future: jax.Array, batch: ForwardBatch,
                 prev_index: jax.Array, *, cfg: Any, kernels: str, decode: bool,
                 mesh: Any = None) -> tuple[PoolState, jax.Array]:
    """[compile.separate_sampler] ``_step`` without its sampler (no speculative decoding): the
    pools and the logits float32 ``[L, V]``; ``future`` int32 ``[F]`` is read (not donated) for
    the overlap's previous tokens. ``engine/runners/sampler_program.py`` samples them."""
    batch = with_known_tokens(batch, future, prev_index)
    pools, logits = model_forward(params, pools, batch, cfg=cfg, kernels=kernels,
                                  decode=decode, mesh=mesh)[:2]
    return pools, logits


@functools.cache
def jitted_step_logits(cfg: Any, kernels: str, decode: bool, family: str, pool_sh: Any = None,
                       out_sh: Any = None, mesh: Any = None):
    """``_step_logits`` jitted (pools donated), cached like ``_jitted_step``; with ``mesh`` the
    pools keep ``pool_sh`` and the logits come back with ``out_sh`` (``_jitted_sharded_step``)."""
    del family  # a cache key only, as in ``_jitted_step``
    fn = functools.partial(_step_logits, cfg=cfg, kernels=kernels, decode=decode, mesh=mesh)
    if mesh is None:
        return jax.jit(fn, donate_argnums=(1,))
    return jax.jit(fn, donate_argnums=(1,), out_shardings=(pool_sh, out_sh))


def _copy_slots(pools: PoolState, src: jax.Array, dst: jax.Array) -> PoolState:
    """Padding pairs are (0, 0): the zero state onto itself."""
    return pools.replace(conv=tuple(a.at[dst].set(a[src]) for a in pools.conv),
                         ssm=tuple(a.at[dst].set(a[src]) for a in pools.ssm))


def _copy_pages(pools: PoolState, src: jax.Array, dst: jax.Array) -> PoolState:
    """Padding pairs are (0, 0): the dump page onto itself."""
    return pools.replace(k_pages=tuple(a.at[dst].set(a[src]) for a in pools.k_pages),
                         v_pages=tuple(a.at[dst].set(a[src]) for a in pools.v_pages))


@functools.cache
def copy_pages_fn():
    """[speculative tree, page size > 1] The jitted KV page copy (pools donated): ``(pools,
    src int32[n], dst int32[n]) -> pools``, every attention layer's K and V pages."""
    return jax.jit(_copy_pages, donate_argnums=(0,))


@functools.cache
def copy_slots_fn():
    """The jitted slot copy (pools donated): ``(pools, src int32[n], dst int32[n]) -> pools``."""
    return jax.jit(_copy_slots, donate_argnums=(0,))
