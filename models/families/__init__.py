"""The model families, each registered by name in ``models/family_registry.py``.

``FAMILIES``, ``get_family``, ``detect_family`` are re-exported here.

Adding a family touches its own module under ``models/families/``, the ``register`` call here
and the tests.
Family modules import nothing of ``mambacache`` (import contract ``families-no-engine``).
"""

from __future__ import annotations

from models.families.base import Family
from models.families.granite import GRANITE
from models.families.kimi_linear import KIMI_LINEAR
from models.families.nemotron_h import NEMOTRON_H
from models.families.qwen import QWEN3_5, QWEN3_5_MOE, QWEN3_NEXT
from models.family_registry import FAMILIES, detect_family, get_family, register

register(QWEN3_NEXT, QWEN3_5, QWEN3_5_MOE, KIMI_LINEAR, NEMOTRON_H, GRANITE)

__all__ = ["FAMILIES", "Family", "detect_family", "get_family"]
