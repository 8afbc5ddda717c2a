"""Orbax checkpoints: model params (converted once from Hugging Face) and the whole cache.

* ``convert_hf_to_orbax(hf_dir, out_dir)``: load a Hugging Face checkpoint once
  (``models.loader``) and write the params as an Orbax checkpoint plus ``model.json``.
* ``restore_params(out_dir, mesh)``: restore straight onto the mesh's shardings: every device
  reads only its own shard (the target is a tree of ``ShapeDtypeStruct`` with shardings), so the
  unsharded model is never materialised on one device.
* ``save_cache(engine, path)`` / ``restore_cache(engine, path)``: the tree (``cache_state``) and
  the pool rows it owns (KV pages, conv and SSM slots), compacted. ``meta.json`` is written
  atomically and last; a restore checks everything (model config + parameter checksums, pool
  layout, tree, rows and their checksums) before it changes the engine, and refuses with a
  ``ValueError`` that leaves the engine as it was.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import SingleDeviceSharding

from mambacache.cache.from_config import make_cache_from_config
from mambacache.cache.state import check_room, check_tree_data, dump_tree, load_tree

if TYPE_CHECKING:
    from jax.sharding import Mesh

    from mambacache.engine.engine import Engine
    from mambacache.engine.runners.pools import PoolState
    from models.config import ModelConfig

FORMAT_VERSION = 2  # 2: pools in the directory meta.json names, row checksums
POOL_FIELDS = ("k_pages", "v_pages", "conv", "ssm")


# ------------------------------------------------------------------------------ orbax helpers
def _save_tree(path: Path, tree: dict[str, Any]) -> None:
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path.absolute(), tree, force=True)


def _restore_tree(path: Path, target: dict[str, Any]) -> dict[str, Any]:
    with ocp.StandardCheckpointer() as ckptr:
        return ckptr.restore(path.absolute(), target)


# ------------------------------------------------------------------------------ params
def model_config_dict(model_cfg: ModelConfig) -> dict[str, Any]:
    d = dataclasses.asdict(model_cfg)
    return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}


def convert_hf_to_orbax(hf_dir: str | Path, out_dir: str | Path, dtype: Any = jnp.float32) -> Any:
    """Convert the Hugging Face checkpoint ``hf_dir`` to an Orbax one in ``out_dir``.

    Writes ``out_dir/params`` (Orbax) and ``out_dir/model.json`` (the ``ModelConfig``); returns
    the model config.
    """
    from models.loader import load_checkpoint

    model_cfg, params = load_checkpoint(str(hf_dir), dtype=dtype)
    save_params(out_dir, model_cfg, params)
    return model_cfg


def save_params(out_dir: str | Path, model_cfg: ModelConfig, params: Any) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _save_tree(out / "params", {"params": params})
    from models.params import PARAM_LAYOUT

    dtype = str(jax.tree.leaves(params)[0].dtype)
    (out / "model.json").write_text(json.dumps({"model": model_config_dict(model_cfg),
                                                "dtype": dtype, "param_layout": PARAM_LAYOUT},
                                               indent=1))


def restore_params(out_dir: str | Path, mesh: Mesh | None = None,
                   dtype: Any = None) -> tuple[ModelConfig, Any]:
    """``(model_cfg, params)`` from ``convert_hf_to_orbax``'s ``out_dir``, each leaf restored
    directly with its tensor-parallel sharding on ``mesh`` (``None``: the default device)."""
    from mambacache.parallel.mesh import param_shardings
    from models.config import ModelConfig
    from models.params import PARAM_LAYOUT, param_shapes

    out = Path(out_dir)
    if not (out / "model.json").is_file():
        raise ValueError(f"{str(out)!r} is not an Orbax model directory (no model.json)")
    info = json.loads((out / "model.json").read_text())
    if info.get("param_layout") != PARAM_LAYOUT:
        raise ValueError(f"{str(out)!r} holds params in layout {info.get('param_layout')!r}, this "
                         f"version reads {PARAM_LAYOUT!r}: convert the checkpoint again "
                         f"(convert_hf_to_orbax)")
    model_cfg = ModelConfig(**info["model"])
    dtype = jnp.dtype(dtype or info["dtype"])
    target = jax.tree.map(lambda shape: jax.ShapeDtypeStruct(shape, dtype),
                          param_shapes(model_cfg), is_leaf=_is_shape)
    if mesh is None:
        sh = jax.tree.map(lambda _: SingleDeviceSharding(jax.devices()[0]), target)
    else:
        sh = param_shardings(target, mesh)
    target = jax.tree.map(lambda t, s: jax.ShapeDtypeStruct(t.shape, t.dtype, sharding=s),
                          target, sh)
    return model_cfg, _restore_tree(out / "params", {"params": target})["params"]


def _is_shape(x: Any) -> bool:
    return isinstance(x, tuple) and all(isinstance(d, int) for d in x)


# ------------------------------------------------------------------------------ cache
@jax.jit
def _checksums(params: Any) -> jax.Array:
    leaves = jax.tree.leaves(params)
    return jnp.stack([jnp.sum(jnp.abs(x.astype(jnp.float32))) for x in leaves])


def model_fingerprint(engine: Engine) -> dict[str, Any]:
    """What must match for a saved cache to be valid: the model config, dtype, param sums."""
    return {"model": model_config_dict(engine.model_cfg), "dtype": engine.cfg.model.dtype,
            "param_checksums": np.asarray(_checksums(engine.runner.params)).tolist()}


def pool_layout(pools: PoolState, page_size: int) -> dict[str, Any]:
    """Per field: per-row shape (axis 0 dropped) and dtype of each layer's pool."""
    out: dict[str, Any] = {"page_size": page_size}
    for f in POOL_FIELDS:
        out[f] = [[list(a.shape[1:]), str(a.dtype)] for a in getattr(pools, f)]
    return out


def _require_idle(engine: Engine, verb: str) -> None:
    if engine.has_unfinished():
        raise ValueError(f"cannot {verb} the cache while requests run "
                         f"({len(engine.scheduler.running)} running, "
                         f"{len(engine.scheduler.waiting)} waiting)")


def save_cache(engine: Engine, path: str | Path) -> None:
    """Write the rows of the tree's pages and slots (Orbax, in the order of
    ``meta["tree"]["pages"/"slots"]``) to a fresh ``path/pools-<id>``, then ``path/meta.json``
    (fingerprint, layout, tree, that directory's name, the rows' checksums) atomically and last,
    then remove older pools directories: a save killed at any point leaves the previous one
    whole, and a ``meta.json`` only ever names pools written before it."""
    _require_idle(engine, "save")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tree = dump_tree(engine.cache)
    pools = engine.runner.pools
    rows = _gather_rows(pools, np.asarray(tree["pages"], np.int32),
                        np.asarray(tree["slots"], np.int32))
    pools_dir = f"pools-{uuid.uuid4().hex[:12]}" if rows else None
    meta = {"version": FORMAT_VERSION, "fingerprint": model_fingerprint(engine),
            "layout": pool_layout(pools, engine.cfg.cache.page_size), "tree": tree,
            "pools": pools_dir, "row_checksums": _row_checksums(rows)}
    if rows:
        _save_tree(out / pools_dir, rows)
    tmp = out / f".meta.json.{uuid.uuid4().hex[:8]}"
    with open(tmp, "w") as f:
        f.write(json.dumps(meta))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out / "meta.json")
    for old in out.iterdir():
        if old.is_dir() and old.name.startswith("pools") and old.name != pools_dir:
            shutil.rmtree(old, ignore_errors=True)


def _gather_rows(pools: PoolState, pages: np.ndarray, slots: np.ndarray) -> dict[str, jax.Array]:
    if not len(pages) and not len(slots):
        return {}
    out = {}
    for f in POOL_FIELDS:
        ids = pages if f in ("k_pages", "v_pages") else slots
        for i, a in enumerate(getattr(pools, f)):
            out[f"{f}_{i}"] = jnp.take(a, jnp.asarray(ids), axis=0)  # keeps the head sharding
    return out


def _row_checksums(rows: dict[str, jax.Array]) -> dict[str, float]:
    if not rows:
        return {}
    sums = np.asarray(_checksums(rows)).tolist()  # leaves in sorted key order
    return dict(zip(sorted(rows), sums, strict=True))


def check_compatible(engine: Engine, meta: dict[str, Any]) -> None:
    """``ValueError`` naming the first difference between a saved cache and ``engine``."""
    if meta.get("version") != FORMAT_VERSION:
        raise ValueError(f"saved cache format {meta.get('version')!r}, expected {FORMAT_VERSION}")
    saved, mine = meta["fingerprint"], model_fingerprint(engine)
    for key in ("model", "dtype"):
        if saved[key] != mine[key]:
            diff = {k: (saved[key].get(k), mine[key][k]) for k in mine[key]
                    if saved[key].get(k) != mine[key][k]} if key == "model" else (
                saved[key], mine[key])
            raise ValueError(f"saved cache is for a different model: {key} differs (saved, "
                             f"this engine): {diff}")
    a, b = np.asarray(saved["param_checksums"]), np.asarray(mine["param_checksums"])
    if a.shape != b.shape or not np.allclose(a, b, rtol=1e-5, atol=1e-6):
        raise ValueError("saved cache is for a different model: parameter checksums differ")
    layout = pool_layout(engine.runner.pools, engine.cfg.cache.page_size)
    if meta["layout"] != layout:
        bad = [k for k in layout if meta["layout"].get(k) != layout[k]]
        raise ValueError(f"saved cache has an incompatible pool layout: {bad} differ (saved "
                         f"{[meta['layout'].get(k) for k in bad]}, this engine "
                         f"{[layout[k] for k in bad]})")


def restore_cache(engine: Engine, path: str | Path) -> None:
    """Load ``save_cache``'s output into ``engine`` (idle, with an empty cache), all or nothing:
    the meta, the model, the layout, the tree (rebuilt in a scratch cache first) and the pool
    rows (shapes and checksums) are checked before the engine is touched. Any failure is a
    ``ValueError`` naming the directory and what is wrong, and leaves the engine as it was."""
    _require_idle(engine, "restore")
    src = Path(path)
    stats = engine.cache.stats()
    if stats["pages_tree"] or stats["slots_tree"] or stats["pages_held"] or stats["slots_held"]:
        raise ValueError("restore needs an empty cache; this engine already holds "
                         f"{stats['pages_tree']} pages and {stats['slots_tree']} slots")
    try:
        meta = _read_meta(src)
        check_compatible(engine, meta)
        tree = meta["tree"]
        check_tree_data(tree)
        load_tree(make_cache_from_config(engine.cfg.cache), tree)  # the dry run
        check_room(engine.cache, tree)  # the pools as they are now (a moved split)
        rows = _read_rows(engine, src, meta) if tree["states"] else {}
    except ValueError as err:
        raise ValueError(f"cannot restore the cache from {str(src)!r}: {err}") from None
    if not rows:
        return
    page_map, slot_map = load_tree(engine.cache, tree)
    pools = engine.runner.pools
    new_pages = jnp.asarray([page_map[p] for p in tree["pages"]], jnp.int32)
    new_slots = jnp.asarray([slot_map[s] for s in tree["slots"]], jnp.int32)
    changes = {}
    for f in POOL_FIELDS:
        ids = new_pages if f in ("k_pages", "v_pages") else new_slots
        changes[f] = tuple(_scatter(a, ids, rows[f"{f}_{i}"])
                           for i, a in enumerate(getattr(pools, f)))
    engine.replace_pools(pools.replace(**changes))


META_KEYS = ("version", "fingerprint", "layout", "tree", "pools", "row_checksums")


def _read_meta(src: Path) -> dict[str, Any]:
    if not (src / "meta.json").is_file():
        raise ValueError("it holds no saved cache (no meta.json)")
    try:
        meta = json.loads((src / "meta.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"meta.json is not valid JSON ({err}): a damaged save") from None
    if not isinstance(meta, dict):
        raise ValueError(f"meta.json holds a {type(meta).__name__}, not an object")
    if meta.get("version") != FORMAT_VERSION:
        raise ValueError(f"saved cache format {meta.get('version')!r}, expected {FORMAT_VERSION}")
    missing = [k for k in META_KEYS if k not in meta]
    if missing:
        raise ValueError(f"meta.json lacks {missing}")
    return meta


def _read_rows(engine: Engine, src: Path, meta: dict[str, Any]) -> dict[str, jax.Array]:
    """The saved pool rows, checked against the tree's counts and ``meta``'s checksums."""
    name, tree = meta["pools"], meta["tree"]
    if not isinstance(name, str) or not re.fullmatch(r"pools[-\w]*", name):
        raise ValueError(f"meta.json names the pools directory {name!r}")
    if not (src / name).is_dir():
        raise ValueError(f"the pools directory {name!r} is missing (an interrupted save?)")
    target = _row_shapes(engine.runner.pools, len(tree["pages"]), len(tree["slots"]))
    try:
        rows = _restore_tree(src / name, target)
    except Exception as err:  # noqa: BLE001 - Orbax's errors (missing files, shapes) as ours
        raise ValueError(f"the pool rows in {name!r} do not fit meta.json's tree "
                         f"({len(tree['pages'])} pages, {len(tree['slots'])} slots): "
                         f"{type(err).__name__}: {str(err)[:300]}") from None
    saved, got = meta["row_checksums"], _row_checksums(rows)
    if not isinstance(saved, dict) or sorted(saved) != sorted(got) or not np.allclose(
            [saved[k] for k in sorted(got)], [got[k] for k in sorted(got)], rtol=1e-5,
            atol=1e-6):
        raise ValueError(f"the pool rows in {name!r} are not the ones meta.json was saved "
                         "with (checksums differ: pools from another save?)")
    return rows


def _row_shapes(pools: PoolState, num_pages: int, num_slots: int) -> dict[str, Any]:
    out = {}
    for f in POOL_FIELDS:
        n = num_pages if f in ("k_pages", "v_pages") else num_slots
        for i, a in enumerate(getattr(pools, f)):
            out[f"{f}_{i}"] = jax.ShapeDtypeStruct((n, *a.shape[1:]), a.dtype,
                                                   sharding=a.sharding)
    return out


def _scatter_impl(pool: jax.Array, ids: jax.Array, rows: jax.Array) -> jax.Array:
    return pool.at[ids].set(rows.astype(pool.dtype))


@functools.cache
def _scatter_fn(sharding: Any):
    return jax.jit(_scatter_impl, donate_argnums=(0,), out_shardings=sharding)


def _scatter(pool: jax.Array, ids: jax.Array, rows: jax.Array) -> jax.Array:
    """``pool`` with ``rows`` written at ``ids`` (pool donated; its sharding kept)."""
    return _scatter_fn(pool.sharding)(pool, ids, rows)
