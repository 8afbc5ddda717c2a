"""Multi-step decode on the device: K decode iterations (model step + sampler) in one dispatch.

``scheduler.decode_steps`` (K > 1): a step whose rows all decode (``multi_plan.multi_step_ok``)
runs ``lax.fori_loop`` over K iterations of the decode program, and the host reads ``[K, L]`` tokens
and logprobs at once, paying its fixed step cost once per K tokens. Iteration j of row b:

  * feeds the token the previous iteration sampled (iteration 0: the row's own input, or the
    previous dispatch's last token from ``future`` [overlap]) at position ``positions[b] + j``;
  * reads the state at ``read_slot[b]`` (j = 0), else where iteration j - 1 wrote it: the row's
    running slot (``write_slot[b]``) or, after its page-boundary iteration ``snap_iter[b]``,
    ``snap_slot[b]``; writes it there likewise (a page-boundary state goes to a fresh slot, as
    a K = 1 decode ending on a boundary does: ``Lease.plan_decode_window``);
  * samples with the key of the token's output index (``step + j``), so tokens and logprobs
    are those of K = 1 steps.

A row runs ``limit[b]`` iterations (the host's: ``max_new_tokens``, pages, one boundary) and
stops after sampling one of its ``stop_ids`` (its stop tokens and EOS: the host's
``StepReader.finish_reason`` rule). From then on it is frozen: its K/V go to the dump page 0 and
its state to the zero slot 0 (``engine/runners/pools.py``), so its running slot holds exactly the
state after its last real token, which the finish inserts into the tree. ``future[b]`` gets the
row's last sampled token, as ``-1 - token`` if the row stopped: a row of the next dispatch that
feeds it [overlap] is frozen from its first iteration (it writes nothing).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mambacache.engine.sampling.sampler import SamplingBatch, sample
from mambacache.engine.step.batch import ForwardBatch
from mambacache.engine.step.plan import MAX_DEVICE_STOPS, ScheduledSeq, device_stop_ids
from models.model import forward as model_forward
from pallas_kernels import ops


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MultiStepRows:
    """Per-row inputs of a multi-step dispatch, ``[B]`` int32 unless said (padding rows: limit 0).

    Attributes:
      limit: iterations the row runs at most (0: padding, frozen throughout).
      snap_iter: the iteration whose state goes to ``snap_slot`` (-1: none).
      snap_slot: that page-boundary snapshot's slot.
      stop_ids: ``[B, MAX_DEVICE_STOPS]`` tokens that stop the row, -1 padded.
    """

    limit: jax.Array
    snap_iter: jax.Array
    snap_slot: jax.Array
    stop_ids: jax.Array

    @classmethod
    def build(cls, scheduled: Sequence[ScheduledSeq], num_rows: int,
              eos_token_id: int | None) -> MultiStepRows:
        """numpy arrays for ``scheduled`` (``steps``, ``snap_iter``, ``snap_slot``, the
        params' stop ids), padded to ``num_rows``."""
        limit = np.zeros(num_rows, np.int32)
        snap_iter = np.full(num_rows, -1, np.int32)
        snap_slot = np.zeros(num_rows, np.int32)
        stop_ids = np.full((num_rows, MAX_DEVICE_STOPS), -1, np.int32)
        for i, s in enumerate(scheduled):
            limit[i], snap_slot[i] = s.steps, s.snap_slot
            if s.snap_iter is not None:
                snap_iter[i] = s.snap_iter
            stops = device_stop_ids(s.req.params, eos_token_id)
            if len(stops) > MAX_DEVICE_STOPS:
                raise ValueError(f"a multi-step row has {len(stops)} stop ids, more than "
                                 f"{MAX_DEVICE_STOPS}")
            stop_ids[i, :len(stops)] = stops
        return cls(limit=limit, snap_iter=snap_iter, snap_slot=snap_slot, stop_ids=stop_ids)


def _multi_step(params: Any, pools: Any, future: jax.Array, batch: ForwardBatch,
                sb: SamplingBatch, prev_index: jax.Array, rows: MultiStepRows, *, cfg: Any,
                kernels: str, iterations: int, page_size: int, mesh: Any = None):
    """The module docstring's K iterations. ``batch``: a decode batch (``T == B == L``) of
    each row's first iteration; ``future`` int32 ``[F]`` (donated); ``prev_index`` ``[B]``.
    Returns the pools, the new ``future``, tokens int32 and logprobs float32
    ``[iterations, B]``."""
    num_rows = batch.input_ids.shape[0]
    fut = future[jnp.maximum(prev_index, 0)]
    has_prev = prev_index >= 0
    done = has_prev & (fut < 0)  # the previous dispatch's row stopped: frozen throughout
    ids = jnp.where(has_prev, jnp.where(fut < 0, -1 - fut, fut), batch.input_ids)
    live = (rows.limit > 0) & ~done
    running = batch.write_slot
    deterministic = getattr(cfg, "deterministic", False)
    toks = jnp.zeros((iterations, num_rows), jnp.int32)
    lps = jnp.zeros((iterations, num_rows), jnp.float32)

    def body(j: jax.Array, carry: tuple) -> tuple:
        pools, ids, live, last, done, toks, lps = carry
        jj = jnp.where(live, j, 0)  # a frozen row keeps its first iteration's in-range shape
        pos = batch.positions + jj
        page = jnp.take_along_axis(batch.page_table, (pos // page_size)[:, None], axis=1)[:, 0]
        read = jnp.where(j == 0, batch.read_slot,
                         jnp.where(rows.snap_iter == j - 1, rows.snap_slot, running))
        write = jnp.where(rows.snap_iter == j, rows.snap_slot, running)
        b = dataclasses.replace(
            batch, input_ids=ids, positions=pos, seq_lens=batch.seq_lens + jj,
            out_cache_loc=jnp.where(live, page * page_size + pos % page_size, 0),
            read_slot=read, write_slot=jnp.where(live, write, 0))
        pools, logits = model_forward(params, pools, b, cfg=cfg, kernels=kernels, decode=True,
                                      mesh=mesh)[:2]
        tok, lp = sample(logits, dataclasses.replace(sb, step=sb.step + j),
                         fixed_order=deterministic)
        tok, lp = tok[:num_rows], lp[:num_rows]
        stop = (tok[:, None] == rows.stop_ids).any(axis=1)
        last = jnp.where(live, tok, last)
        done = done | (live & stop)
        live = live & ~stop & (j + 1 < rows.limit)
        return pools, tok, live, last, done, toks.at[j].set(tok), lps.at[j].set(lp)

    carry = (pools, ids, live, ids, done, toks, lps)
    pools, _, _, last, done, toks, lps = jax.lax.fori_loop(0, iterations, body, carry)
    n = min(num_rows, future.shape[0])
    future = future.at[:n].set(jnp.where(done, -1 - last, last)[:n])
    return pools, future, toks, lps


def jitted_multi_step(cfg: Any, kernels: str, iterations: int, page_size: int):
    """One jitted program family per (model config, kernels, K, page size, kernel family),
    shared by engines over the same model like ``step_program.jitted_step``; pools and ``future``
    (arguments 1, 2) donated. One program per decode ``StepShape`` (and pool shapes)."""
    return _jitted_multi_step(cfg, kernels, iterations, page_size, ops.kernel_family())


@functools.cache
def _jitted_multi_step(cfg: Any, kernels: str, iterations: int, page_size: int, family: str):
    del family  # a cache key only: ``ops`` reads PALLAS_FAMILY when tracing
    return jax.jit(functools.partial(_multi_step, cfg=cfg, kernels=kernels,
                                     iterations=iterations, page_size=page_size),
                   donate_argnums=(1, 2))
