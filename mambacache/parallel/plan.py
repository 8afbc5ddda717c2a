"""The plan: will this model, at this dtype and tensor parallelism, fit this topology with a cache?

    python -m mambacache.plan --config C [--set k=v ...] --topology v6e:2x4 [--out plan.json]
                              [--context-len N]

For a TPU slice (``v5e:2x4``, ``v6e:2x2``, ``v5p:2x2x1``, ...) the engine's own step programs
(``sizing.largest_step_shapes``: the widest prefill bucket and the decode bucket) are compiled
with abstract, sharded params and pools on libtpu's compile-only devices (no chip); every
number is then the compiler's, per device. For ``h200:N`` (no compiler on this host) weights and
pools are exact arithmetic and the step's temporaries an estimate (``temp_source``); ``local``
is this machine's devices (real compile, the allocator's memory limit: the device check).
The cache gets ``cache.memory_bytes``, or ``cache.memory_fraction`` (0.9 when the config sets
no budget) of what is left after the weights and the step, and ``cache/budget.py`` turns it
into pool sizes (KV and states share the bytes). A plan whose weights and step exceed the HBM,
or whose budget cannot hold one ``context_len`` request plus ``max_running_requests`` running
slots, does not fit: ``fits`` false, the reason with its numbers, the longest context that
would fit (``longest_context``: set it as ``model.context_length``), exit status 1. The context
is ``--context-len``, else ``model.context_length``, else the model's.

Roofline: from ``cost_analysis()`` of the compiled programs (FLOPs and bytes accessed per device)
and the chip's peak FLOPs / HBM bandwidth of the dtype: a compiler estimate, not a measurement;
Pallas kernels count only where they declare a cost estimate.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from mambacache.config import EngineConfig
from mambacache.parallel.topology import Topology, local_topology, parse_topology

GB = 10**9


def load_model_config(cfg: EngineConfig) -> Any:
    """The ``ModelConfig`` of ``model.path`` (a Hugging Face ``config.json`` or an Orbax
    ``model.json``) or ``model.preset``; no weight is read."""
    from models.config import ModelConfig
    from models.presets import get_preset

    if cfg.model.path is None:
        return get_preset(cfg.model.preset)
    root = Path(cfg.model.path)
    if (root / "model.json").is_file():
        return ModelConfig(**json.loads((root / "model.json").read_text())["model"])
    if not (root / "config.json").is_file():
        raise ValueError(f"model.path {str(root)!r} holds neither config.json nor model.json")
    return ModelConfig.from_hf_config(json.loads((root / "config.json").read_text()))


def _mesh_for(topo: Topology, tp: int):
    import numpy as np
    from jax.sharding import Mesh

    from mambacache.parallel.mesh import TP
    from mambacache.parallel.topology import compile_devices

    if topo.name == "local":
        from mambacache.parallel.mesh import make_mesh

        return make_mesh(tp)
    if topo.compiled:
        devices = compile_devices(topo.name)
    else:  # arithmetic: abstract shardings need a mesh of some tp devices; forced CPU ones do
        import jax

        devices = jax.devices("cpu")
        if len(devices) < tp:
            raise ValueError(f"{topo.name} by arithmetic needs {tp} CPU devices for the "
                             f"shardings, have {len(devices)}: set XLA_FLAGS="
                             f"--xla_force_host_platform_device_count={tp}")
    return Mesh(np.asarray(devices[:tp]), (TP,))


def plan(cfg: EngineConfig, topology: str, *, context_len: int | None = None) -> dict[str, Any]:
    """The plan for ``cfg`` on ``topology`` as one JSON-able dict (keys in the module doc and
    ``docs/parallel.md``). ``ValueError`` for a config the topology cannot even shard."""
    from mambacache.engine.runners.loading import model_dtype
    from mambacache.parallel import sizing
    from mambacache.parallel.mesh import (
        param_shardings,
        replicate_kv_heads,
        validate_tensor_parallel,
    )

    topo = local_topology() if topology == "local" else parse_topology(topology)
    tp = cfg.parallel.tensor_parallel
    model_cfg = cfg.model.capped(load_model_config(cfg))  # model.context_length
    context = int(context_len or model_cfg.max_position_embeddings)
    model_cfg = dataclasses.replace(model_cfg, max_position_embeddings=context)
    run_cfg = replicate_kv_heads(model_cfg, tp)
    validate_tensor_parallel(run_cfg, tp, topo.num_devices)
    mesh = _mesh_for(topo, tp)
    dtype, page_size = model_dtype(cfg), cfg.cache.page_size
    params = sizing.abstract_params(run_cfg, dtype)
    weight_bytes = sizing.laid_out_bytes(params, param_shardings(params, mesh))
    slot_bytes, page_bytes = sizing.unit_bytes(run_cfg, mesh, page_size, dtype)
    shapes = sizing.largest_step_shapes(cfg, run_cfg)
    if weight_bytes >= topo.chip.hbm_bytes:  # no compile can change the verdict
        steps, source = _step_estimates(run_cfg, shapes, tp), "estimate (not compiled)"
    elif topo.compiled:
        steps, source = _compiled_or_refused(run_cfg, cfg, topo, shapes, params, mesh, dtype)
    else:
        steps, source = _step_estimates(run_cfg, shapes, tp), "estimate"
    step_bytes = max(s["temp_bytes"] + s["code_bytes"] for s in steps.values())
    head = f"{cfg.model.path or cfg.model.preset} in {cfg.model.dtype} at TP {tp} on {topology}"
    budget, slots, tokens, reason = _pools(cfg, head, topo.chip.hbm_bytes, weight_bytes,
                                           step_bytes, slot_bytes, page_bytes, context)
    longest = context
    if source.startswith("refused"):
        reason, longest = f"{head} does not fit: the compiler {source}", 0
    elif reason:
        longest = longest_context(cfg, head, topo.chip.hbm_bytes, weight_bytes, step_bytes,
                                  slot_bytes, page_bytes, context)
    out = dict(
        model=cfg.model.path or cfg.model.preset, family=model_cfg.family, topology=topology,
        chip=topo.chip.name, devices=topo.num_devices, tensor_parallel=tp, dtype=cfg.model.dtype,
        compiled=source == "compiler", temp_source=source,
        kv_heads_per_device=1 if model_cfg.kv_lora_rank else run_cfg.num_key_value_heads // tp,
        hbm_bytes=topo.chip.hbm_bytes, weight_bytes=weight_bytes, step_bytes=step_bytes,
        temp_bytes=max(s["temp_bytes"] for s in steps.values()),
        memory_fraction=sizing.memory_fraction(cfg), cache_budget_bytes=budget,
        state_slot_bytes=slot_bytes, kv_page_bytes=page_bytes,
        kv_token_bytes=page_bytes / page_size, num_mamba_slots=slots, num_kv_tokens=tokens,
        context_len=context, longest_context=longest,
        max_running_requests=cfg.scheduler.max_running_requests,
        page_size=page_size, programs=steps, roofline=roofline(steps, topo, cfg.model.dtype))
    return out | {"fits": not reason, "reason": reason}


def _pools(cfg: EngineConfig, head: str, hbm: int, weights: int, step: int, slot_bytes: int,
           page_bytes: int, context: int) -> tuple[int, int, int, str]:
    """``(budget, num_mamba_slots, num_kv_tokens, reason)`` per device, as the engine sizes
    its pools on a device (``engine.pools.size_pools(..., physical=True)``: the budget split
    between the two pool arrays) with this device's laid-out bytes of a slot and a token;
    ``reason`` empty when it fits, else what does not, with the numbers (GB = 1e9 bytes). The
    budget is ``cache.memory_bytes`` or ``cache.memory_fraction`` of what is left (negative:
    short by that much)."""
    from mambacache.cache.budget import budget_from_fraction
    from mambacache.engine.runners.pools import size_pools
    from mambacache.parallel.sizing import memory_fraction

    left = hbm - weights - step
    if left <= 0:
        return left, 0, 0, (f"{head} does not fit: weights {weights / GB:.2f} GB + step "
                            f"{step / GB:.2f} GB per device exceed the {hbm / GB:.2f} GB of "
                            f"HBM by {-left / GB:.2f} GB")
    budget = cfg.cache.memory_bytes or budget_from_fraction(hbm, weights, step,
                                                            memory_fraction(cfg))
    ps = cfg.cache.page_size
    units = {"cache.state_bytes": slot_bytes, "cache.kv_bytes_per_token": -(-page_bytes // ps)}
    if not cfg.cache.has_budget:  # the plan's default fraction, pools derived
        units |= {"cache.memory_fraction": memory_fraction(cfg), "cache.num_kv_tokens": 0,
                  "cache.num_mamba_slots": 0}
    try:
        sized = size_pools(cfg.replace(**units), None, memory_bytes=budget, physical=True,
                           context_len=context)[0].cache
    except ValueError as e:
        return budget, 0, 0, f"{head}: {e}"
    need = dict(slots=cfg.scheduler.max_running_requests, tokens=context)
    if sized.num_mamba_slots < need["slots"] or sized.num_kv_tokens < need["tokens"]:
        return budget, 0, 0, (f"{head}: the cache budget {budget / GB:.4f} GB gives "
                              f"{sized.num_mamba_slots} state slots of {slot_bytes / 1e6:.2f} MB "
                              f"and {sized.num_kv_tokens} KV tokens; it needs "
                              f"max_running_requests = {need['slots']} slots and one context of "
                              f"{need['tokens']} tokens")
    pools = (sized.num_mamba_slots + 1) * slot_bytes + (sized.num_pages + 1) * page_bytes
    if budget > left or pools > left:
        return budget, 0, 0, (f"{head}: the cache pools {pools / GB:.2f} GB (budget "
                              f"{budget / GB:.2f} GB) exceed the {left / GB:.2f} GB left after "
                              f"weights and step")
    return budget, sized.num_mamba_slots, sized.num_kv_tokens, ""


def longest_context(cfg: EngineConfig, head: str, hbm: int, weights: int, step: int,
                    slot_bytes: int, page_bytes: int, context: int) -> int:
    """The longest context (a multiple of ``cache.page_size``, below ``context``) whose one
    request plus ``max_running_requests`` running slots the budget holds (``_pools``), 0 when
    none does. The step's temporaries stay those compiled for ``context`` (its page tables
    are the widest), so the answer errs short."""
    ps = cfg.cache.page_size

    def fits(pages: int) -> bool:
        return not _pools(cfg, head, hbm, weights, step, slot_bytes, page_bytes, pages * ps)[3]

    low, high = 0, max(-(-context // ps) - 1, 0)  # low fits (or is 0), high is the search top
    if not fits(1):
        return 0
    low = 1
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low * ps


def _compiled_or_refused(model_cfg, cfg, topo, shapes, params, mesh, dtype
                         ) -> tuple[dict[str, dict], str]:
    """``(steps, "compiler")``, or the estimates and ``"refused: <its message>"`` when the
    compiler rejects a program for its memory (weights + pools + temporaries over the HBM)."""
    import jax

    from mambacache.parallel.sizing import out_of_memory

    try:
        return _step_costs(model_cfg, cfg, topo, shapes, params, mesh, dtype), "compiler"
    except jax.errors.JaxRuntimeError as e:
        if not out_of_memory(e):
            raise
        text = " ".join(str(e).split())
        return (_step_estimates(model_cfg, shapes, cfg.parallel.tensor_parallel),
                "refused: " + text[text.find("Ran out"):][:200])


def _step_costs(model_cfg, cfg, topo, shapes, params, mesh, dtype) -> dict[str, dict]:
    """Compile each step program (``sizing.step_memories``); a TPU topology compiles the
    ``tpu`` family's Mosaic kernels, ``local`` whatever the backend runs."""
    from mambacache.parallel import sizing

    if topo.chip.compiler == "tpu":
        os.environ.setdefault("PALLAS_FAMILY", "tpu")
        os.environ.setdefault("PALLAS_INTERPRET", "0")
    kernels = cfg.model.kernels
    if topo.chip.compiler == "tpu" and kernels == "auto":
        kernels = "pallas"
    mems = sizing.step_memories(model_cfg, cfg, shapes, params=params, mesh=mesh, dtype=dtype,
                                kernels=kernels)
    return {name: dataclasses.asdict(m) | {"shapes": dataclasses.asdict(shapes[name])}
            for name, m in mems.items()}


def _step_estimates(model_cfg, shapes, tp: int) -> dict[str, dict]:
    """No compiler (GPU topologies): the largest step's temporaries by arithmetic, fp32
    activations of ~8 hidden-wide and 3 widest-projection-wide buffers per token, the MoE's
    top-k expansion and the logits (an estimate: ``temp_source`` says so)."""
    c = model_cfg
    widest = max(c.linear_conv_dim + c.linear_value_dim, 2 * c.intermediate_size,
                 c.num_attention_heads * c.head_dim * 3) // tp
    moe = c.num_experts_per_tok * 2 * c.moe_intermediate_size if c.num_experts else 0
    out = {}
    for name, sh in shapes.items():
        per_token = 4 * (8 * c.hidden_size + 3 * widest + moe)
        logits = 3 * 4 * sh.num_logits * c.vocab_size
        out[name] = dict(temp_bytes=sh.num_tokens * per_token + logits, code_bytes=0,
                         flops=0.0, bytes_accessed=0.0, optimal_seconds=0.0,
                         shapes=dataclasses.asdict(sh))
    return out


def roofline(steps: dict[str, dict], topo: Topology, dtype: str) -> dict[str, Any]:
    """Per program: ``max(flops / peak, bytes / bandwidth)`` seconds on one device of the
    chip (a compiler estimate), decode steps per second and prefill tokens per second."""
    chip, out = topo.chip, {"source": "compiler cost_analysis (estimate, not measured)"}
    if not chip.hbm_bytes_per_s or not chip.peak_flops_per_s(dtype):
        return out | {"source": f"no peak figures for {chip.name!r}"}
    for name, s in steps.items():
        if not s["flops"] and not s["bytes_accessed"]:
            continue
        t = max(s["flops"] / chip.peak_flops_per_s(dtype), s["bytes_accessed"]
                / chip.hbm_bytes_per_s)
        tokens = s["shapes"]["num_tokens"]
        out[name] = dict(seconds=t, flops_seconds=s["flops"] / chip.peak_flops_per_s(dtype),
                         hbm_seconds=s["bytes_accessed"] / chip.hbm_bytes_per_s,
                         tokens_per_s=tokens / t if t > 0 else 0.0)
    return out


def format_table(p: dict[str, Any]) -> str:
    """The plan as a few aligned lines (per device; GB = 1e9 bytes)."""
    rows = [
        ("model", f"{p['model']} ({p['family']}), {p['dtype']}, TP {p['tensor_parallel']}"),
        ("topology", f"{p['topology']}: {p['devices']} x {p['chip']}"),
        ("HBM / device", f"{p['hbm_bytes'] / GB:.2f} GB"),
        ("weights", f"{p['weight_bytes'] / GB:.2f} GB"),
        ("step (temp+code)", f"{p['step_bytes'] / GB:.3f} GB (source: {p['temp_source']})"),
        ("cache budget", f"{p['cache_budget_bytes'] / GB:.2f} GB "
                         f"(memory_fraction {p['memory_fraction']})"),
        ("state slot", f"{p['state_slot_bytes'] / 1e6:.2f} MB"),
        ("KV token", f"{p['kv_token_bytes'] / 1e3:.2f} KB"),
        ("num_mamba_slots", f"{p['num_mamba_slots']:,}"),
        ("num_kv_tokens", f"{p['num_kv_tokens']:,}"),
    ]
    for name, r in p["roofline"].items():
        if name in ("prefill", "decode"):
            rows.append((f"{name} (estimate)", f"{r['seconds'] * 1e3:.2f} ms/step, "
                                               f"{r['tokens_per_s']:,.0f} tokens/s"))
    rows.append(("fits", "yes" if p["fits"] else f"NO: {p['reason']}"))
    if not p["fits"]:
        longest = p.get("longest_context", 0)
        rows.append(("longest context", f"{longest:,} tokens fit (--set model.context_length="
                                        f"{longest})" if longest else "none fits"))
    return "\n".join(f"{k:18s} {v}" for k, v in rows)


def _force_cpu_devices(topology: str) -> None:
    """An arithmetic topology (``h200:8``) shards on forced CPU devices, one per chip: set
    before JAX starts its CPU backend (the entry point's first JAX use)."""
    try:
        topo = parse_topology(topology)
    except ValueError:
        return  # plan() reports it
    flags = os.environ.get("XLA_FLAGS", "")
    if not topo.compiled and "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = (f"{flags} --xla_force_host_platform_device_count="
                                   f"{topo.num_devices}").strip()


def main(argv: list[str] | None = None) -> int:
    import argparse

    from mambacache.config import parse_set_args

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", help="engine TOML (default: the embedded tiny config)")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    ap.add_argument("--topology", required=True, help="v5e:2x4, v6e:2x2, v5p:2x2x1, h200:8, ...")
    ap.add_argument("--context-len", type=int, help="longest sequence (default: the model's)")
    ap.add_argument("--out", help="write the plan here as one JSON object")
    opts = ap.parse_args(argv)
    _force_cpu_devices(opts.topology)
    try:
        cfg = EngineConfig.load(opts.config, parse_set_args(opts.set))
        if opts.topology == "local":  # a compile-only client cannot load a cached program
            from mambacache.engine.runners.compile_cache import use_compile_cache

            use_compile_cache(cfg.compile)  # a second plan of the same config compiles nothing
        result = plan(cfg, opts.topology, context_len=opts.context_len)
    except ValueError as e:
        print(f"error: {e}")
        return 1
    print(format_table(result))
    if opts.out:
        Path(opts.out).write_text(json.dumps(result, indent=1))
    return 0 if result["fits"] else 1
