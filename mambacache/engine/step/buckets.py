"""Step shapes: the buckets a step is padded to, and the finite set of programs they allow.

A jitted step compiles once per ``StepShape`` (with the pools' shapes, fixed per engine). The
rules keep the set small and known for a configuration (``Buckets.program_set``):

* **pages per sequence** ``P``: a ladder anchored at ``max_pages`` (the bucket of
  ``max_seq_len``) that divides by ``PAGE_STEP`` (4) down to ``MIN_PAGE_BUCKET``: 4096 pages
  give 64, 256, 1024, 4096. Attention over the padded page table costs up to 4x the pages held
  on the CPU reference (it gathers all P; fixing P at ``max_pages`` made an 8-request 60-token
  generate 10x slower at context 4096), and the ladder has half the rungs of powers of two.
* **decode** (every row one token, no snapshot target): the width ``B`` follows the running
  batch on a ladder of powers of two from ``MIN_SEQ_BUCKET`` up to ``max_seqs`` (a decode of 3
  requests computes 4 rows when 64 may run); ``T = L = B``; snapshots ``MIN_SNAPSHOT_BUCKET``.
* **extend** (anything else): ``B = L = max_seqs`` is fixed, so only the packed tokens ``T``
  (powers of two from ``MIN_TOKEN_BUCKET`` up to ``max_step_tokens``: ``chunked_prefill_size``
  plus one row of 1 + drafts per running request) and ``P`` vary; snapshots
  ``S = min(T, max_snapshots)`` (at least ``MIN_SNAPSHOT_BUCKET``): a step's snapshots are
  distinct offsets of its rows, so never more than its tokens. [speculative] verify rows take
  ``L`` > ``B`` logits rows: a ladder up to ``max_logit_rows``.

[deterministic] ``min_rows`` (``DETERMINISTIC_MIN_ROWS`` under ``model.deterministic``, else 0):
every program computes at least that many token rows and logits rows (the runner's
``max_seqs`` is rounded up to it), so the shapes a request's rows meet do not depend on how many
others share its step: on XLA CPU a row-wise reduction over fewer than 8 rows is vectorised
along the row and sums in another order (``docs/engine.md``, "Deterministic mode").

* **multi-step decode** (``scheduler.decode_steps`` K > 1, ``engine/runners/multi_step.py``): the
  decode widths again, each running K iterations (``iterations``); its pages cover every row's
  last iteration.

So the set is ``(widths (x 2 with K > 1) + token ladder (x logits ladder)) x page ladder``
programs. A step
outside it (a sequence longer than ``max_seq_len``, more snapshots than ``S``) still runs, on the
next power of two: that program is not in the warmed set and counts as a compile
(``engine/runners/compiles.py``). Host only (no JAX).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from mambacache.engine.step.plan import SeqSpec

MIN_TOKEN_BUCKET = 16
MIN_PAGE_BUCKET = 64
MIN_SNAPSHOT_BUCKET = 8
MIN_SEQ_BUCKET = 4  # decode widths: 4, 8, 16, ... up to max_running_requests (rounded up)
PAGE_STEP = 4  # pages per sequence: max_pages, max_pages / 4, ... down to MIN_PAGE_BUCKET
DETERMINISTIC_MIN_ROWS = 32  # [deterministic] the fewest rows (tokens, logits) a program has


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
    iterations: int = 1  # [multi-step decode] K decode iterations in the program

    def sizes(self) -> dict[str, int]:
        """``build_forward_batch``'s keyword arguments."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in ("decode", "iterations")}

    @property
    def key(self) -> tuple:
        """``(decode, *sorted(sizes))`` (and ``("iterations", K)`` for a multi-step one): the
        runner's ``program_keys`` entry."""
        more = (("iterations", self.iterations),) if self.iterations > 1 else ()
        return (self.decode, *sorted(self.sizes().items()), *more)

    @property
    def compile_weight(self) -> int:
        """Tokens x iterations x pages per sequence: the order compiles start in (largest
        first, the longest compiles)."""
        return self.num_tokens * self.iterations * self.num_pages_per_seq

    def describe(self) -> str:
        """``decode 4 rows x 8 pages`` / ``extend 256 tokens x 64 pages`` (logs and errors)."""
        if self.decode:
            return (f"decode {self.num_seqs} rows x {self.num_pages_per_seq} pages"
                    + (f" x {self.iterations} iterations" if self.iterations > 1 else ""))
        return f"extend {self.num_tokens} tokens x {self.num_pages_per_seq} pages"


@dataclasses.dataclass(frozen=True)
class Buckets:
    """The ladders of one runner: ``max_seqs`` (widest step, a power of two), ``max_seq_len``
    (tokens of the longest sequence the set covers), ``max_step_tokens`` (most tokens one step
    packs), ``max_logit_rows`` (most logits rows, > max_seqs only with verify rows),
    ``max_snapshots`` (the snapshot cap of an extend step; 0: ``2 * max_seqs``), ``min_rows``
    (the fewest token rows and decode width of a program; 0: the module's minimums),
    ``decode_steps`` (K > 1: the multi-step decode programs too)."""

    page_size: int
    max_seqs: int
    max_seq_len: int
    max_step_tokens: int
    max_logit_rows: int = 0
    max_snapshots: int = 0
    min_rows: int = 0
    decode_steps: int = 1

    def __post_init__(self) -> None:
        for name in ("page_size", "max_seqs", "max_seq_len", "max_step_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"Buckets.{name} must be >= 1, got {getattr(self, name)}")
        if self.min_rows > self.max_seqs:
            raise ValueError(f"Buckets.min_rows ({self.min_rows}) exceeds max_seqs "
                             f"({self.max_seqs})")

    @property
    def min_width(self) -> int:
        return max(MIN_SEQ_BUCKET, self.min_rows)

    @property
    def min_tokens(self) -> int:
        return max(MIN_TOKEN_BUCKET, self.min_rows)

    @property
    def max_pages(self) -> int:
        return bucket(-(-self.max_seq_len // self.page_size), MIN_PAGE_BUCKET)

    def page_ladder(self) -> list[int]:
        """``max_pages`` divided by ``PAGE_STEP`` while at least ``MIN_PAGE_BUCKET``, ascending."""
        out, n = [], self.max_pages
        while n >= MIN_PAGE_BUCKET:
            out.append(n)
            n //= PAGE_STEP
        return out[::-1]

    def pages_for(self, pages: int) -> int:
        """The smallest rung holding ``pages`` (past ``max_pages``: the next power of two)."""
        return next((p for p in self.page_ladder() if p >= pages), bucket(pages, 1))

    def widths(self) -> list[int]:
        return sorted({min(w, self.max_seqs) for w in ladder(self.min_width, self.max_seqs)})

    def token_ladder(self) -> list[int]:
        return ladder(self.min_tokens, self.max_step_tokens)

    def snapshots_for(self, num_tokens: int) -> int:
        cap = bucket(self.max_snapshots or 2 * self.max_seqs, 1)
        return max(MIN_SNAPSHOT_BUCKET, min(num_tokens, cap))

    def logit_ladder(self) -> list[int]:
        if self.max_logit_rows <= self.max_seqs:
            return [self.max_seqs]
        return [self.max_seqs] + ladder(2 * self.max_seqs, self.max_logit_rows)

    def shape(self, seqs: Sequence[SeqSpec], decode: bool, logit_rows: int) -> StepShape:
        """The shape ``seqs`` run at (``decode``: ``step.plan.is_decode_step``)."""
        pages = self.pages_for(max(-(-(s.prefix_len + len(s.tokens)) // self.page_size)
                                   for s in seqs))
        if decode:
            width = min(bucket(len(seqs), self.min_width), self.max_seqs)
            return StepShape(True, width, width, pages, MIN_SNAPSHOT_BUCKET, width)
        tokens = bucket(sum(len(s.tokens) for s in seqs), self.min_tokens)
        snaps = max(self.snapshots_for(tokens),
                    bucket(sum(len(s.snapshots) for s in seqs), MIN_SNAPSHOT_BUCKET))
        logits = self.max_seqs if logit_rows <= self.max_seqs else bucket(logit_rows, 1)
        return StepShape(False, tokens, self.max_seqs, pages, snaps, logits)

    def multi_shape(self, ends: Sequence[int], iterations: int) -> StepShape:
        """[multi-step decode] The shape of ``len(ends)`` rows running ``iterations``
        iterations, row i's last one ending at ``ends[i]`` tokens."""
        pages = self.pages_for(-(-max(ends) // self.page_size))
        width = min(bucket(len(ends), self.min_width), self.max_seqs)
        return StepShape(True, width, width, pages, MIN_SNAPSHOT_BUCKET, width, iterations)

    def program_set(self) -> list[StepShape]:
        """Every shape a step of at most ``max_seq_len`` tokens per sequence can take."""
        pages = self.page_ladder()
        decode = [StepShape(True, w, w, p, MIN_SNAPSHOT_BUCKET, w) for w in self.widths()
                  for p in pages]
        extend = [StepShape(False, t, self.max_seqs, p, self.snapshots_for(t), n)
                  for t in self.token_ladder() for n in self.logit_ladder() for p in pages]
        multi = [dataclasses.replace(s, iterations=self.decode_steps) for s in decode] \
            if self.decode_steps > 1 else []
        return decode + multi + extend
