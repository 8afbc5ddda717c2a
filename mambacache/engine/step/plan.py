"""What one step does, on the host: its rows (``SeqSpec``), and the rule no step may break.

Host only (numpy ints, no JAX): the scheduler builds a step from these, a runner executes it
(the model runner on the device, the shadow runner on the host), and ``step_hazards`` checks the
rule that makes in-place kernels safe. On GPU/TPU the kernels update the pools in place
(aliased), rows in any order, so within one step:
  * no state slot or KV page is written by one row and read or written by another row;
  * (checked against the allocators by ``Scheduler.check_step``) no row reads a FREE slot, and
    every slot a row reads is locked in the tree or held by the reading request.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from mambacache.engine.request import Request
    from mambacache.engine.sampling.params import SamplingParams
    from mambacache.engine.speculative.chain import Chain


@dataclasses.dataclass(frozen=True, init=False)
class SeqSpec:
    """Host description of one sequence in a step (used to build a ``ForwardBatch``).

    ``prefix_len`` tokens are already in the KV pages and in the state at ``read_slot``;
    ``tokens`` are the extend. ``page_ids`` must cover ``prefix_len + len(tokens)`` tokens (more
    are ignored). ``read_slot`` 0 is the zero state (only with ``prefix_len == 0``);
    ``write_slot`` 0 drops the final state. ``snapshots``: (offset in the extend, 1..len(tokens),
    destination slot): the state after that many extend tokens. ``prev_index`` >= 0 [overlap]:
    the last extend token is a placeholder for the token that row ``prev_index`` of the previous
    step sampled (still on the device; the step reads it from there).
    """

    tokens: Sequence[int]
    prefix_len: int
    page_ids: Sequence[int]
    read_slot: int
    write_slot: int
    snapshots: Sequence[tuple[int, int]] = ()  # (offset in extend, dest slot)
    logits: str = "last"  # "last", "all" or "none"
    prev_index: int = -1  # [overlap] row of the previous step that samples the last token

    def __init__(self, tokens: Sequence[int], prefix_len: int, page_ids: Sequence[int],
                 read_slot: int, write_slot: int, snapshots: Sequence[tuple[int, int]] = (),
                 logits: str = "last", prev_index: int = -1):
        # the generated frozen __init__ sets each field through object.__setattr__ (about half
        # a row's spec cost, built per row of every step); item writes into the instance dict
        # set the same fields (no keyword dict built), and the instance stays frozen
        # (assignment raises FrozenInstanceError). Hot callers pass the fields by position.
        d = self.__dict__
        d["tokens"], d["prefix_len"], d["page_ids"] = tokens, prefix_len, page_ids
        d["read_slot"], d["write_slot"], d["snapshots"] = read_slot, write_slot, snapshots
        d["logits"], d["prev_index"] = logits, prev_index

    @property
    def end(self) -> int:
        """Tokens of the sequence after this step."""
        return self.prefix_len + len(self.tokens)

    def written_slots(self) -> list[int]:
        return [s for s in [self.write_slot, *(slot for _, slot in self.snapshots)] if s]

    def read_pages(self, page_size: int) -> np.ndarray:
        """Pages holding the KV this row attends to: all of ``[0, end)``."""
        return np.asarray(self.page_ids[:-(-self.end // page_size)], np.int64)

    def written_pages(self, page_size: int) -> np.ndarray:
        """Pages this row writes KV into: those covering ``[prefix_len, end)``."""
        first, last = self.prefix_len // page_size, -(-self.end // page_size)
        return np.asarray(self.page_ids[first:last], np.int64)


@dataclasses.dataclass(slots=True)  # built and read per row of every step
class ScheduledSeq:
    """One request's part of a step: tokens ``[start, end)`` of ``req.token_ids``.

    ``spec`` is built once the whole step is decided (admissions may still add snapshots to
    requests scheduled earlier in the same step).
    """

    req: Request
    start: int
    end: int
    spec: SeqSpec | None = None
    write_slot: int | None = None  # where the step leaves the state (running slot by default)
    # a verify row (engine/speculative/verify.py): the draft tokens after token ``start`` (not part
    # of ``req.token_ids``), and the slot the state after offset j + 1 goes to, per j
    drafts: tuple[int, ...] = ()
    targets: tuple[int, ...] = ()
    # [speculative, overlap] built before the request's previous row was read: shifted on the
    # device by its outcome (engine/speculative/chain.py); ``start``, ``targets`` and ``drafts`` are
    # the host's assumption (every draft of the previous row accepted) until ``resolved``
    chain: Chain | None = None
    resolved: bool = False
    # [speculative, topk > 1] a draft tree is one row per branch: the first row (``branch`` 0,
    # the lease's own pages) lists the others in ``branches``; a branch row (``branch`` >= 1)
    # writes its tokens' KV to ``branch_pages`` (from ``start`` on) and is read with its tree
    branch: int = 0
    branches: tuple[ScheduledSeq, ...] = ()
    branch_pages: np.ndarray | None = None
    # [multi-step decode] the decode iterations this row runs in a K-step dispatch (``end =
    # start + steps``; its spec is the first iteration's), and the one (``snap_iter``, None:
    # none) whose state goes to ``snap_slot``, a page-boundary snapshot
    # (``engine/runners/multi_step.py``)
    steps: int = 1
    snap_iter: int | None = None
    snap_slot: int = 0

    @property
    def verifies(self) -> bool:
        """A verify row: its progress is known only once its tokens are read."""
        return bool(self.drafts) or self.chain is not None

    @property
    def samples(self) -> bool:
        """The chunk reaches the request's last token, so its logits give the next token."""
        return self.end == self.req.num_tokens


#: [overlap] the extend of a decode row whose token is still on the device (read only)
PLACEHOLDER = np.zeros(1, np.int32)
PLACEHOLDER.flags.writeable = False

#: [multi-step decode] stop token ids (EOS included) a row may have for the device to stop it
MAX_DEVICE_STOPS = 8


def device_stop_ids(params: SamplingParams, eos_token_id: int | None) -> tuple[int, ...]:
    """[multi-step decode] The tokens that stop a row on the device (``StepReader.finish_reason``'s
    stop rule): its stop token ids and the EOS unless ``ignore_eos``."""
    stops = tuple(params.stop_token_ids)
    if not params.ignore_eos and eos_token_id is not None:
        stops += (int(eos_token_id),)
    return stops


def logit_rows(
        scheduled: Sequence[ScheduledSeq]) -> tuple[list[SamplingParams | None], list[int]]:
    """Per logits row of a step, in order: the sampling params (None: not sampled) and the
    index of the output token drawn there. A ``logits="all"`` row (verify) has one per token."""
    params: list[SamplingParams | None] = []
    steps: list[int] = []
    for s in scheduled:
        n_out = s.req.num_outputs
        if s.chain is not None:  # as if the row before accepts all its drafts (spec_chain)
            n_out += s.chain.base
        if s.spec.logits == "all":
            params += [s.req.params] * len(s.spec.tokens)
            steps += range(n_out, n_out + len(s.spec.tokens))
        else:
            params.append(s.req.params if s.samples else None)
            steps.append(n_out)
    return params, steps


def first_logit_row(scheduled: Sequence[ScheduledSeq]) -> list[int]:
    """Index of each row's first logits row (``logit_rows``' order)."""
    out, row = [], 0  # plain ints: numpy costs more than it saves for a step's few rows
    for s in scheduled:
        out.append(row)
        row += len(s.spec.tokens) if s.spec.logits == "all" else 1
    return out


def is_decode_step(seqs: Sequence[SeqSpec]) -> bool:
    """The step runs the decode program: every row extends by one token with no snapshot
    target (a page-boundary decode snapshot is the row's write slot, not a target)."""
    return all(len(s.tokens) == 1 and not s.snapshots for s in seqs)


def step_hazards(seqs: Sequence[SeqSpec], page_size: int) -> list[str]:
    """Every cross-row conflict of one step, as messages (empty: the step is safe in place)."""
    if len(seqs) < 2:
        return []
    problems = []
    for kind, written, read in (
            ("slot", [s.written_slots() for s in seqs], [[s.read_slot] if s.read_slot else []
                                                        for s in seqs]),
            ("page", [s.written_pages(page_size) for s in seqs],
             [s.read_pages(page_size) for s in seqs])):
        rows_w = np.repeat(np.arange(len(seqs)), [len(w) for w in written])
        ids_w = np.concatenate([np.asarray(w, np.int64) for w in written])
        order = np.argsort(ids_w, kind="stable")
        ids_s, rows_s = ids_w[order], rows_w[order]
        dup = np.flatnonzero((ids_s[1:] == ids_s[:-1]) & (rows_s[1:] != rows_s[:-1]))
        problems += [f"{kind} {ids_s[i]} written by rows {rows_s[i]} and {rows_s[i + 1]}"
                     for i in dup.tolist()]
        for i, r in enumerate(read):
            r = np.asarray(r, np.int64)
            hit = np.searchsorted(ids_s, r)
            ok = hit < len(ids_s)
            clash = r[ok][ids_s[hit[ok]] == r[ok]]
            for x in clash.tolist():
                writers = set(rows_s[ids_s == x].tolist()) - {i}
                if writers:
                    problems.append(f"row {i} reads {kind} {x} that row {min(writers)} writes")
    return problems
