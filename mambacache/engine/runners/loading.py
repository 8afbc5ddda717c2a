"""The model an engine serves: ``load_model`` (a Hugging Face or Orbax directory, or a seeded
preset), ``served_model_config`` (the config's overrides applied) and ``model_dtype``. Imports JAX
and the model lazily, so the host-only engine pieces (the simulator's) never load them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mambacache.config import EngineConfig

if TYPE_CHECKING:
    from models.config import ModelConfig


def model_dtype(cfg: EngineConfig) -> Any:
    """The JAX dtype of ``model.dtype`` (params, KV pages and conv states; SSM states are fp32)."""
    import jax.numpy as jnp

    return jnp.bfloat16 if cfg.model.dtype == "bfloat16" else jnp.float32


def served_model_config(cfg: EngineConfig, model_cfg: ModelConfig) -> ModelConfig:
    """The model config an engine serves: ``model_cfg`` (loaded, or read without a weight) with
    the config's ``model.deterministic`` and ``model.context_length`` cap applied. The engine
    and the programs compiled while its weights load (``loading_compiles.py``) derive it here,
    so the two agree."""
    import dataclasses

    if cfg.model.deterministic != model_cfg.deterministic:  # [deterministic]
        model_cfg = dataclasses.replace(model_cfg, deterministic=cfg.model.deterministic)
    return cfg.model.capped(model_cfg)  # model.context_length


def load_model(cfg: EngineConfig) -> tuple[Any, Any]:
    """(model config, params) from ``model.path`` or ``model.preset``.

    ``model.path``: an Orbax directory (``checkpoint.convert_hf_to_orbax`` / ``save_params``:
    holds ``model.json``), restored straight onto the ``parallel.tensor_parallel`` mesh so no
    device holds the whole model; otherwise a Hugging Face directory.
    """
    from pathlib import Path

    dtype = model_dtype(cfg)
    if cfg.model.path is not None:
        if (Path(cfg.model.path) / "model.json").is_file():
            from mambacache.parallel.checkpoint import restore_params
            from mambacache.parallel.mesh import make_mesh

            tp = cfg.parallel.tensor_parallel
            return restore_params(cfg.model.path, make_mesh(tp) if tp > 1 else None, dtype)
        from models.loader import load_checkpoint

        return load_checkpoint(cfg.model.path, dtype=dtype,
                               mtp=cfg.speculative.method == "mtp")
    from models.params import init_params
    from models.presets import get_preset

    model_cfg = get_preset(cfg.model.preset)
    _check_random_init_fits(cfg.model.preset, model_cfg, dtype)
    params = init_params(model_cfg, seed=cfg.model.seed, dtype=dtype)
    scale = cfg.model.init_branch_scale
    if scale != 1.0:  # every matrix inside the layers (norms, A_log, dt_bias are 1-D)
        import jax

        params = {**params, "layers": jax.tree_util.tree_map(
            lambda w: w * scale if w.ndim >= 2 else w, params["layers"])}
    if cfg.speculative.method == "mtp":  # the presets' drafter: a seeded MTP head
        from models.mtp import with_seeded_mtp

        return with_seeded_mtp(model_cfg, params, seed=cfg.model.seed)
    return model_cfg, params


def _memory_limit_bytes() -> int:
    """What the first device can hold: the allocator's limit on GPU / TPU, the memory the host
    has available on CPU (``/proc/meminfo``; no limit if unreadable)."""
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 2**63


def _check_random_init_fits(preset: str, model_cfg: ModelConfig, dtype: Any) -> None:
    """A real-size preset (``models/hf_configs/``) is a published model's shape without its
    weights: random-initialising it is allowed (benchmarks at real size) only where the weights
    fit, else a ``ValueError`` with the numbers before anything is allocated."""
    from models.presets import is_real_preset

    if not is_real_preset(preset):
        return
    from models.sizes import model_sizes

    need = model_sizes(model_cfg, dtype).weight_bytes
    limit = _memory_limit_bytes()
    if need > limit:
        raise ValueError(
            f"model.preset {preset!r} is a real-size preset: its random weights need "
            f"{need / 2**30:.1f} GiB but the device has {limit / 2**30:.1f} GiB; real-size "
            f"presets are for sizing (python -m mambacache.plan, python -m mambacache.simulate); "
            f"serve a checkpoint with model.path")
