"""Qwen3-Next / Qwen3.5 hybrid models in JAX: config, presets, params, loader, forward."""

# first: the families register themselves (models/family_registry.py) before any config is built
import models.families  # noqa: F401  isort: skip

from models.config import ModelConfig
from models.loader import load_checkpoint
from models.model import forward
from models.params import init_params, param_shapes
from models.presets import PRESETS, get_preset

__all__ = ["PRESETS", "ModelConfig", "forward", "get_preset", "init_params", "load_checkpoint",
           "param_shapes"]
