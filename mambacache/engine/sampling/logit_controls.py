"""Logit controls: the penalties and grammar masks a step applies to its logits, on the device.

Host side (``controls_for``): for each logits row whose request ``needs_history`` (a penalty or a
``constraint``), the distinct tokens of its history with their output counts, and the token
bitmask its constraint's matcher allows next. Device side (``apply_controls``, inside the jitted
sampler): scatters over those ids and one bitmask test per vocabulary entry.

Invariants:
  * a row's history is known on the host when its step is built: the scheduler dispatches no row
    of a ``needs_history`` request while one of its sampled tokens is still on the device
    [overlap], and gives it no speculative verify rows; ``controls_for`` asserts it;
  * padding entries (id 0, count 0, unseen) change nothing bit for bit (x / 1, x * 1, x + -0.0),
    so the result equals a plain numpy reference exactly (``tests/test_logit_controls.py``);
  * a step with no such row passes ``None``: its program and its results are those of a step
    without controls. With controls, the id width ``K`` is a power of two >= ``MIN_IDS``, so a
    workload adds a few programs per step shape: ``Engine.warmup(logit_controls=True)``
    (``serve.warmup_logit_controls``) compiles the ``K = MIN_IDS`` one of each single-step
    shape (histories of up to 64 distinct tokens); wider ones compile on first use.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from mambacache.engine.step.plan import first_logit_row

if TYPE_CHECKING:
    from mambacache.engine.request import Request
    from mambacache.engine.sampling.params import SamplingParams
    from mambacache.engine.step.plan import ScheduledSeq

#: the smallest id width of a controlled step (fewer programs: K in 64, 128, 256, ...)
MIN_IDS = 64


class ConstraintMatcher(Protocol):
    """One request's grammar state (host): what it allows next, what it was given."""

    def fill_bitmask(self, out: np.ndarray) -> None:
        """Write the allowed next tokens into ``out`` (int32 ``[ceil(vocab / 32)]``, bit
        ``t % 32`` of word ``t // 32`` set when token ``t`` is allowed)."""

    def accept(self, token: int) -> bool:
        """Advance by the sampled ``token``; False if the grammar refuses it."""

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing more: the request stops."""


class TokenConstraint(Protocol):
    """What ``SamplingParams.constraint`` holds: a compiled grammar, one matcher per request."""

    def matcher(self) -> ConstraintMatcher: ...


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LogitControls:
    """Per logits row: ``ids`` int32 ``[L, K]`` distinct history tokens (padding 0),
    ``subtract`` float32 ``[L, K]`` ``frequency * count + presence * (count > 0)`` of each
    (computed on the host in float32, so no fused multiply-add can round it differently),
    ``seen`` bool ``[L, K]`` the id is a real history token (prompt or output), ``repetition``
    float32 ``[L]``, ``bitmask`` int32 ``[L, ceil(V / 32)]`` (all bits set: no constraint)."""

    ids: jax.Array
    subtract: jax.Array
    seen: jax.Array
    repetition: jax.Array
    bitmask: jax.Array


def history_counts(req: Request) -> tuple[np.ndarray, np.ndarray]:
    """Distinct tokens of ``req``'s history and their output counts: the output's tokens, and
    the prompt's too when a repetition penalty reads them (count 0 if only in the prompt)."""
    out_ids, out_counts = np.unique(np.asarray(req.output_ids, np.int32), return_counts=True)
    if req.params.repetition_penalty == 1.0:
        return out_ids, out_counts
    ids = np.union1d(np.unique(req.prompt), out_ids).astype(np.int32)
    counts = np.zeros(len(ids), np.int64)
    counts[np.searchsorted(ids, out_ids)] = out_counts
    return ids, counts


def controls_for(scheduled: Sequence[ScheduledSeq], num_rows: int,
                 vocab_size: int) -> LogitControls | None:
    """The controls of a step (``None`` when no sampling row needs history)."""
    if not any(s.req.params.needs_history for s in scheduled):
        return None
    first = first_logit_row(scheduled)
    rows = []
    for s, row in zip(scheduled, first, strict=True):
        req = s.req
        if not (s.samples and req.params.needs_history):
            continue
        if req.num_pending:
            raise AssertionError(f"request {req.request_id} needs its history on the host but "
                                 f"{req.num_pending} sampled tokens are on the device")
        rows.append(RowControls(row, req.params, *history_counts(req), req.matcher))
    return pack_controls(rows, num_rows, vocab_size) if rows else None


@dataclasses.dataclass(frozen=True)
class RowControls:
    """One controlled logits row, on the host: ``ids`` distinct history tokens, ``counts``
    their output occurrences, the matcher that fills its bitmask (None: every token)."""

    row: int
    params: SamplingParams
    ids: np.ndarray
    counts: np.ndarray
    matcher: ConstraintMatcher | None = None


def pack_controls(rows: Sequence[RowControls], num_rows: int, vocab_size: int) -> LogitControls:
    """The device inputs of ``rows`` (other rows of ``num_rows`` unchanged by them; no rows:
    controls that change nothing, the warm-up's)."""
    longest = max((len(r.ids) for r in rows), default=0)
    width = max(MIN_IDS, 1 << max(longest - 1, 0).bit_length())
    ids = np.zeros((num_rows, width), np.int32)
    subtract = np.zeros((num_rows, width), np.float32)
    seen = np.zeros((num_rows, width), bool)
    repetition = np.ones(num_rows, np.float32)
    bitmask = np.full((num_rows, -(-vocab_size // 32)), -1, np.int32)
    for r in rows:
        n, p = len(r.ids), r.params
        ids[r.row, :n], seen[r.row, :n] = r.ids, True
        subtract[r.row, :n] = penalty_subtract(r.counts, p)
        repetition[r.row] = p.repetition_penalty
        if r.matcher is not None:
            r.matcher.fill_bitmask(bitmask[r.row])
    return LogitControls(ids=ids, subtract=subtract, seen=seen, repetition=repetition,
                         bitmask=bitmask)


def penalty_subtract(counts: np.ndarray, p: SamplingParams) -> np.ndarray:
    """float32 ``frequency * count + presence * (count > 0)`` per token."""
    c = np.asarray(counts, np.float32)
    return (np.float32(p.frequency_penalty) * c
            + np.float32(p.presence_penalty) * (c > 0).astype(np.float32))


def apply_controls(logits: jax.Array, c: LogitControls) -> jax.Array:
    """float32 ``[L, V]`` -> the same with penalties applied, then disallowed tokens at -inf."""
    rows = jnp.arange(logits.shape[0])[:, None]
    rep = c.repetition[:, None]
    hit = logits[rows, c.ids]
    logits = logits.at[rows, c.ids].divide(jnp.where(c.seen & (hit > 0), rep, 1.0))
    logits = logits.at[rows, c.ids].multiply(jnp.where(c.seen & (hit <= 0), rep, 1.0))
    logits = logits.at[rows, c.ids].add(-c.subtract)
    vocab = jnp.arange(logits.shape[1])
    allowed = (c.bitmask[:, vocab // 32] >> (vocab % 32)) & 1
    return jnp.where(allowed == 1, logits, -jnp.inf)
