"""The two checks every config section's ``__post_init__`` makes: a ``ValueError`` naming the
key, the limit and the value given."""

from __future__ import annotations


def require(cond: bool, msg: str) -> None:
    """``ValueError(msg)`` unless ``cond``."""
    if not cond:
        raise ValueError(msg)


def positive(name: str, value: int) -> None:
    """``value`` is an int above 0 (``name`` is the dotted key, e.g. ``cache.page_size``)."""
    require(isinstance(value, int) and value > 0, f"{name} must be a positive int, got {value!r}")
