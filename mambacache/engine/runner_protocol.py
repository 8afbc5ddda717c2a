"""What the step loop (``step_loop.py``) needs of a runner, and its record of a dispatched step.

``Runner`` is a ``typing.Protocol``: ``ModelRunner`` (``runners/model_runner.py``, the device) and
``ShadowRunner`` (``shadow/runner.py``, the data-flow oracle) both satisfy it
(``tests/test_runner_protocol.py``). ``InFlight`` is one dispatched step whose sampled tokens
have not been read yet.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from mambacache.engine.step.plan import ScheduledSeq


@runtime_checkable
class Runner(Protocol):
    """What the loop needs of a runner (``ModelRunner`` on the device, ``ShadowRunner``)."""

    model_cfg: Any  # the model's config (ModelConfig, or ShadowModelConfig): vocab, context
    last_drafts: Any  # [mtp] int32 [rows, k] drafts the last step made on the device, or None

    @property
    def programs_compiled(self) -> int: ...

    def programs_per_width(self) -> dict[int, int]: ...

    def run(self, scheduled: Sequence[ScheduledSeq]) -> tuple[Any, Any]:
        """Dispatch one step; its sampled tokens and logprobs (one per logits row), read with
        ``np.asarray`` (which waits for the device and raises if the step failed)."""

    def run_multi(self, scheduled: Sequence[ScheduledSeq], iterations: int) -> tuple[Any, Any]:
        """[multi-step decode] Dispatch ``iterations`` decode iterations of decode rows (row i
        runs ``scheduled[i].steps`` of them, fewer if it stops: ``engine/runners/multi_step.py``);
        tokens and logprobs ``[iterations, rows]``."""

    def copy_slots(self, pairs: Sequence[tuple[int, int]]) -> None: ...

    def copy_pages(self, pairs: Sequence[tuple[int, int]]) -> None:
        """[speculative tree, page size > 1] KV page ``dst`` becomes a copy of page ``src``."""

    def transfer(self, t: Any, in_use: Any = None) -> None:
        """[host tier] Issue a ``cache.host_tier.Transfer`` between device and host pools."""

    def load_ready(self, device_slot: int) -> bool:
        """[host tier] Whether a promotion's load into ``device_slot`` has landed."""

    def finish_load(self, device_slot: int) -> None:
        """[host tier] Write a landed load into the device pools (before any step reads it)."""

    def pools_lost(self) -> bool: ...

    def reset_pools(self) -> None: ...


@dataclasses.dataclass
class InFlight:
    """A dispatched step whose sampled tokens have not been read."""

    scheduled: list[ScheduledSeq]
    rows: list[tuple[int, int]]  # (index into scheduled, first logits row) of sampling rows
    tokens: Any  # [L] int32, on the device until read
    logprobs: Any  # [L] float32
    drafts: Any = None  # [speculative mtp] int32 [rows, k]: the MTP head's drafts per row
    iterations: int = 1  # [multi-step decode] K: tokens and logprobs are [K, L]
