"""The registry of model families by name: ``FAMILIES``, ``register``, ``get_family``,
``detect_family``. Below every family and ``models/config.py``: a ``ModelConfig`` finds its family
here by name without importing the families (which import the config: no circle). The families
register themselves in ``models/families/__init__.py``, which ``models/__init__.py`` imports
first, so the registry is full before any config is built.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from models.families.base import Family

FAMILIES: dict[str, Family] = {}


def register(*families: Family) -> None:
    """Add ``families`` by name; a ``ValueError`` names a name registered twice."""
    for family in families:
        if family.name in FAMILIES and FAMILIES[family.name] is not family:
            raise ValueError(f"family {family.name!r} is registered twice")
        FAMILIES[family.name] = family


def get_family(name: str) -> Family:
    """The registered family ``name``; a ``ValueError`` lists the known ones otherwise."""
    if name not in FAMILIES:
        raise ValueError(f"family must be one of {tuple(FAMILIES)}, got {name!r}")
    return FAMILIES[name]


def detect_family(hf: Mapping[str, Any]) -> Family:
    """The family of a Hugging Face ``config.json`` dict: by ``architectures``, else by
    ``model_type``; a ``ValueError`` names both and the supported architectures otherwise."""
    for arch in hf.get("architectures") or []:
        for family in FAMILIES.values():
            if arch in family.architectures:
                return family
    model_type = hf.get("model_type")
    for family in FAMILIES.values():
        if model_type in family.model_types:
            return family
    supported = sorted(a for f in FAMILIES.values() for a in f.architectures)
    raise ValueError(
        f"unsupported Hugging Face config: architectures={hf.get('architectures')!r}, "
        f"model_type={model_type!r}; supported: {supported}")
