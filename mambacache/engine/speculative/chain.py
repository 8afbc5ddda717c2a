"""[speculative, overlap] Chained rows: a request's row in step N+1 built before step N is read.

With ``scheduler.overlap`` a request whose step-N row samples (a prefill's last chunk, a decode,
a verify) gets its step-N+1 row before the host knows step N's outcome: how many drafts the
target accepted (``a``), the token after them (the *bonus* ``t_a``), and so where the next row
starts and which slot holds its state. The host plans the row as if step N accepted every
draft it proposes (``Chain.base`` drafts: the latest start); the step shifts it on the device
from step N's outcome, which every step leaves in its carry (``ModelRunner.future``):

  * its first token becomes the bonus, its positions, KV locations, ``seq_lens`` and output
    indices (sampling keys) move back by ``base - a``;
  * it reads ``cand[a]`` (the slot step N wrote the state after ``a + 1`` of its tokens to),
    and writes the state after offset ``j`` to the ``j``-th slot of ``pool`` (running slot +
    scratch lane) that is not ``cand[a]``: the host's ``verify_targets`` rule, on the device;
  * drafts: the MTP head's, made by step N for that row (drafts made on the device). A
    drafter on the host (``ngram``) is never chained: its drafts depend on step N's tokens,
    and a guess of them (an earlier design: the lookup over ``tokens + step N's drafts``,
    valid only if the target took exactly that path) drafted nothing the synchronous loop
    drafted whenever the guess missed (issue 39). The step loop reads step N first instead
    (``StepLoop._drafts_need_tokens``), so those rows are the synchronous loop's.

After the read of step N the host knows ``a`` and resolves the row (``resolve``): its start,
slots and drafts become plain host facts, the same the device used, and its own outcome is
accepted at the read of step N+1 like a synchronous verify row. So at most one outcome per
request is unknown to the host. Rows with no predecessor in flight (``src`` -1) pass through
unchanged: the synchronous loop runs the same program. Host only (numpy); the device's part is
``engine/speculative/chain_step.py``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np


@dataclasses.dataclass
class Chain:
    """A chained row's dependence on its predecessor (the request's row in the step before)."""

    src: int  # the predecessor's row index in the step before
    base: int  # drafts the host assumes the predecessor accepts (all it verifies)
    cand: tuple[int, ...]  # cand[a]: the predecessor's state slot after accepting a drafts
    pool: tuple[int, ...]  # running slot + scratch lane: the row's targets, minus what it reads
    ndraft: int  # draft positions of the row (its extend is 1 + ndraft tokens)
    expect: int = -1  # the device's input: -1, the drafts are the MTP head's (never a guess)


def targets(pool: Sequence[int], read: int, n: int) -> tuple[int, ...]:
    """The first ``n`` slots of ``pool`` other than ``read`` (the verify targets rule)."""
    return tuple(s for s in pool if s != read)[:n]


def chain_inputs(chains: Sequence[Chain | None], num_seqs: int, k: int) -> dict[str, np.ndarray]:
    """int32 host arrays of one step's chains, padded to ``num_seqs`` rows (``-1``: no chain)."""
    src = np.full(num_seqs, -1, np.int32)
    base = np.zeros(num_seqs, np.int32)
    expect = np.full(num_seqs, -1, np.int32)
    ndraft = np.zeros(num_seqs, np.int32)
    cand = np.zeros((num_seqs, k + 1), np.int32)
    cand_idx = np.zeros((num_seqs, k + 1), np.int32)
    pool = np.zeros((num_seqs, k + 2), np.int32)
    for b, c in enumerate(chains):
        if c is None:
            continue
        src[b], base[b], expect[b], ndraft[b] = c.src, c.base, c.expect, c.ndraft
        pool[b, :len(c.pool)] = c.pool
        padded = list(c.cand) + [c.cand[-1]] * (k + 1 - len(c.cand))
        cand[b] = padded
        cand_idx[b] = [c.pool.index(s) for s in padded]
    return {"src": src, "base": base, "expect": expect, "ndraft": ndraft, "cand": cand,
            "cand_idx": cand_idx, "pool": pool}
