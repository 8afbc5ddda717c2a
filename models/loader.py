"""``load_checkpoint(path, dtype) -> (cfg, params)`` from a Hugging Face directory.

Reads ``config.json`` and ``model.safetensors`` (or a sharded ``model.safetensors.index.json``);
the family (``models/families/``) names and regroups the trunk's tensors into the layout of
``models/params.py`` (``Family.load_trunk``; helpers in ``models/hf_tensors.py``), this module
adds the ``lm_head`` (tied or not), the optional MTP head and the checks: a missing, unexpected
or mis-shaped tensor is a ``ValueError`` naming it.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig
from models.params import check_params
from models.safetensors_io import TensorSource, checkpoint_files

IGNORED = (re.compile(r"^mtp\."), re.compile(r"^model\.visual\."), re.compile(r"\.rotary_emb\."))


def load_checkpoint(path: str | Path, dtype: Any = jnp.float32,
                    mtp: bool = False) -> tuple[ModelConfig, dict]:
    """Load ``(cfg, params)`` from a Hugging Face checkpoint directory, params cast to ``dtype``.
    ``mtp``: also load the multi-token-prediction head (``mtp.*``, ``models/mtp.py``); a
    ``ValueError`` if the checkpoint has none. Without it ``mtp.*`` is ignored."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"no config.json in {str(path)!r}")
    cfg = ModelConfig.from_hf_config(json.loads((path / "config.json").read_text()))
    src = TensorSource(checkpoint_files(path))
    v, h = cfg.vocab_size, cfg.hidden_size
    family = cfg.model_family
    tree: dict[str, Any] = family.load_trunk(cfg, src)
    if "lm_head.weight" in src or not cfg.tie_word_embeddings:
        tree["lm_head"] = src.get("lm_head.weight", (v, h)).T
    else:
        tree["lm_head"] = np.asarray(tree["embed"]).T
    if mtp:
        if not family.supports_mtp or "mtp.fc.weight" not in src:
            raise ValueError(f"speculative.method 'mtp' needs an MTP head (mtp.* tensors); "
                             f"the {cfg.family} checkpoint in {str(path)!r} has none")
        cfg = dataclasses.replace(cfg, num_mtp_layers=1)
        tree["mtp"] = family.load_mtp(cfg, src)
    extra = sorted(k for k in src.keys() - src.used if not any(p.search(k) for p in IGNORED))
    if extra:
        raise ValueError(f"unexpected checkpoint tensor(s) {extra[:8]}"
                         f"{' ...' if len(extra) > 8 else ''} for {cfg.family}")
    params = _to_jax(tree, dtype)
    check_params(cfg, params)
    return cfg, params


def _to_jax(tree: Any, dtype: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _to_jax(v, dtype) for k, v in tree.items()}
    if isinstance(tree, tuple):
        return tuple(_to_jax(v, dtype) for v in tree)
    return jnp.asarray(np.ascontiguousarray(tree), dtype=dtype)
