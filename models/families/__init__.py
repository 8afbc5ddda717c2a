"""The registry of model families: ``FAMILIES`` by name, ``get_family``, ``detect_family``.

Adding a family touches its own module under ``models/families/``, this registry and the tests.
Family modules import nothing of ``mambacache`` (import contract ``families-no-engine``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from models.families.base import Family
from models.families.granite import GRANITE
from models.families.kimi_linear import KIMI_LINEAR
from models.families.nemotron_h import NEMOTRON_H
from models.families.qwen import QWEN3_5, QWEN3_5_MOE, QWEN3_NEXT

FAMILIES: dict[str, Family] = {f.name: f for f in (QWEN3_NEXT, QWEN3_5, QWEN3_5_MOE, KIMI_LINEAR,
                                                    NEMOTRON_H, GRANITE)}


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


__all__ = ["FAMILIES", "Family", "detect_family", "get_family"]
