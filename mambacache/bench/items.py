"""What every workload hands out and checks: ``BenchItem`` (one request to send) and
``check_ints`` (the ``ValueError`` of an int field below its minimum). Below ``workloads.py``
and ``sharegpt.py``, which both use them (so neither imports the other back)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any


def require(cond: bool, msg: str) -> None:
    """``ValueError(msg)`` unless ``cond``."""
    if not cond:
        raise ValueError(msg)


def check_ints(obj: Any, names: Sequence[str], minimum: int, section: str = "workload") -> None:
    """``ValueError`` unless each field in ``names`` is an int (not a bool) >= ``minimum``."""
    for name in names:
        value = getattr(obj, name)
        require(isinstance(value, int) and not isinstance(value, bool) and value >= minimum,
                f"{section}.{name} must be an int >= {minimum}, got {value!r}")


@dataclasses.dataclass
class BenchItem:
    """One request to send: ``prompt`` int ids, ``max_new_tokens``, owner ``client``, ``turn``."""

    prompt: list[int]
    max_new_tokens: int
    client: int = 0
    turn: int = 0
