"""Step shapes: the buckets a step is padded to, and the finite set of programs they allow.

A jitted step compiles once per ``StepShape`` (with the pools' shapes, fixed per engine). The
rules keep the set small and known for a configuration (``Buckets.program_set``):

* **decode** (every row one token, no snapshot target): the width ``B`` follows the running
  batch on a ladder of powers of two from ``MIN_SEQ_BUCKET`` up to ``max_seqs`` (a decode of 3
  requests computes 4 rows when 64 may run); pages per sequence ``P`` on a ladder of powers of
  two from ``MIN_PAGE_BUCKET``; ``T = L = B``; snapshots fixed at ``MIN_SNAPSHOT_BUCKET``.
* **extend** (anything else): ``B = L = max_seqs`` and ``P = max_pages`` (the bucket of
  ``max_seq_len``) are fixed, so only the packed tokens ``T`` vary, on a ladder of powers of
  two from ``MIN_TOKEN_BUCKET`` up to ``max_step_tokens`` (``chunked_prefill_size`` plus one
  row of 1 + drafts per running request); snapshots ``S = min(T, max_snapshots)`` (at least
  ``MIN_SNAPSHOT_BUCKET``): a step's snapshots are distinct offsets of its rows, so never more
  than its tokens. [speculative] verify rows take ``L`` > ``B`` logits rows: a ladder up to
  ``max_logit_rows``.

So the set is ``widths x page ladder`` decode programs plus ``token ladder`` (x logits ladder)
extend programs. A step outside it (a sequence longer than ``max_seq_len``, more snapshots than
``S``) still runs, on the next power of two: that program is not in the warmed set and counts as
a compile (``engine/compiles.py``). Host only (no JAX).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from mambacache.engine.step_plan import SeqSpec

MIN_TOKEN_BUCKET = 16
MIN_PAGE_BUCKET = 64
MIN_SNAPSHOT_BUCKET = 8
MIN_SEQ_BUCKET = 4  # decode widths: 4, 8, 16, ... up to max_running_requests (rounded up)


def bucket(n: int, minimum: int) -> int:
    """The smallest power of two >= max(n, minimum)."""
    n = max(int(n), minimum, 1)
    return 1 << (n - 1).bit_length()


def ladder(low: int, high: int) -> list[int]:
    """Powers of two from ``bucket(low)`` to ``bucket(high)``, both included."""
    out, n = [], bucket(low, 1)
    while n <= bucket(high, low):
        out.append(n)
        n *= 2
    return out


@dataclasses.dataclass(frozen=True, order=True)
class StepShape:
    """The padded sizes of one step program (``build_forward_batch``'s keyword arguments)."""

    decode: bool
    num_tokens: int
    num_seqs: int
    num_pages_per_seq: int
    num_snapshots: int
    num_logits: int

    def sizes(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name != "decode"}

    @property
    def key(self) -> tuple:
        """``(decode, *sorted(sizes))``: the runner's ``program_keys`` entry."""
        return (self.decode, *sorted(self.sizes().items()))


@dataclasses.dataclass(frozen=True)
class Buckets:
    """The ladders of one runner: ``max_seqs`` (widest step, a power of two), ``max_seq_len``
    (tokens of the longest sequence the set covers), ``max_step_tokens`` (most tokens one step
    packs), ``max_logit_rows`` (most logits rows, > max_seqs only with verify rows),
    ``max_snapshots`` (the snapshot cap of an extend step; 0: ``2 * max_seqs``)."""

    page_size: int
    max_seqs: int
    max_seq_len: int
    max_step_tokens: int
    max_logit_rows: int = 0
    max_snapshots: int = 0

    def __post_init__(self) -> None:
        for name in ("page_size", "max_seqs", "max_seq_len", "max_step_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"Buckets.{name} must be >= 1, got {getattr(self, name)}")

    @property
    def max_pages(self) -> int:
        return bucket(-(-self.max_seq_len // self.page_size), MIN_PAGE_BUCKET)

    def widths(self) -> list[int]:
        return sorted({min(w, self.max_seqs) for w in ladder(MIN_SEQ_BUCKET, self.max_seqs)})

    def token_ladder(self) -> list[int]:
        return ladder(MIN_TOKEN_BUCKET, self.max_step_tokens)

    def snapshots_for(self, num_tokens: int) -> int:
        cap = bucket(self.max_snapshots or 2 * self.max_seqs, 1)
        return max(MIN_SNAPSHOT_BUCKET, min(num_tokens, cap))

    def logit_ladder(self) -> list[int]:
        if self.max_logit_rows <= self.max_seqs:
            return [self.max_seqs]
        return [self.max_seqs] + ladder(2 * self.max_seqs, self.max_logit_rows)

    def shape(self, seqs: Sequence[SeqSpec], decode: bool, logit_rows: int) -> StepShape:
        """The shape ``seqs`` run at (``decode``: ``step_plan.is_decode_step``)."""
        pages = bucket(max(-(-(s.prefix_len + len(s.tokens)) // self.page_size) for s in seqs),
                       MIN_PAGE_BUCKET)
        if decode:
            width = min(bucket(len(seqs), MIN_SEQ_BUCKET), self.max_seqs)
            return StepShape(True, width, width, pages, MIN_SNAPSHOT_BUCKET, width)
        tokens = bucket(sum(len(s.tokens) for s in seqs), MIN_TOKEN_BUCKET)
        snaps = max(self.snapshots_for(tokens),
                    bucket(sum(len(s.snapshots) for s in seqs), MIN_SNAPSHOT_BUCKET))
        logits = self.max_seqs if logit_rows <= self.max_seqs else bucket(logit_rows, 1)
        return StepShape(False, tokens, self.max_seqs, max(pages, self.max_pages), snaps,
                         logits)

    def program_set(self) -> list[StepShape]:
        """Every shape a step of at most ``max_seq_len`` tokens per sequence can take."""
        decode = [StepShape(True, w, w, p, MIN_SNAPSHOT_BUCKET, w) for w in self.widths()
                  for p in ladder(MIN_PAGE_BUCKET, self.max_pages)]
        extend = [StepShape(False, t, self.max_seqs, self.max_pages, self.snapshots_for(t),
                            n) for t in self.token_ladder() for n in self.logit_ladder()]
        return decode + extend
