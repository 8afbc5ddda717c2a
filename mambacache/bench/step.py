"""``python -m mambacache.bench.step``: one model step timed at real size against its roofline.

    python -m mambacache.bench.step --preset qwen3_5_35b_a3b [--rows 64 --context 1024
        --prefill 4x512 --kernels pallas,reference --dtype bfloat16 --iters 5] [--out r.json]

Random weights are drawn on the device with ``jax.random`` (one small jitted program per leaf
shape: seconds, nothing crosses from the host); the pools are ``PoolState.create`` zeros and the
batches the engine's own ``build_forward_batch`` (decode: ``rows`` rows, each ``context`` tokens
cached on its own pages and slot; prefill: ``n x L`` sequences from scratch). For each kernel
set it times the jitted ``models.forward`` (pools donated, as the engine runs it) for decode and
prefill, and the first MoE feed-forward alone at the decode and prefill token counts with
every form (``pallas``: the grouped matmul kernel; ``reference``: every expert on every token;
``ragged_dot``: sort + two ``lax.ragged_dot``). Every program is lowered and compiled first, in
``--compile-threads`` threads; then each is timed: the median of ``--iters`` calls after a
warm-up call, each ended by ``block_until_ready``. Each time is printed beside the byte and
FLOP model of ``step_cost.py`` and, on a known device (``pallas_kernels.bench.ROOFLINES``:
H100, H200, TPU v5e, v6e, ...), the floor ``max(bytes / HBM, FLOPs / peak)`` and the fraction
of it reached. On CPU no roofline is reported (and the Pallas kernels run interpreted).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

from mambacache.bench import step_cost
from mambacache.engine.runners.pools import PoolState
from mambacache.engine.step.batch import SeqSpec, build_forward_batch
from models.config import ModelConfig
from models.model import forward
from models.params import param_shapes
from models.presets import get_preset
from pallas_kernels.bench import roofline

MOE_FORMS = ("pallas", "reference", "ragged_dot")
_PLUS_ONE = ("norm", "kv_norm")        # plain norm weights (gated norms): about 1
_CENTRED = ("input_norm", "post_norm", "final_norm", "q_norm", "k_norm", "embed_norm",
            "hidden_norm")


@partial(jax.jit, static_argnames=("shape", "dtype", "kind", "std"))
def _leaf(key: jax.Array, *, shape: tuple[int, ...], dtype: Any, kind: str, std: float):
    """One random leaf on the device (kinds as ``models.params._init_leaf``)."""
    z = jax.random.normal(key, shape, jnp.float32)
    if kind == "A_log":
        out = jnp.log(jax.random.uniform(key, shape, jnp.float32, 1.0, 16.0))
    elif kind == "dt_bias":
        out = 1.0 + 0.2 * z
    elif kind == "one":
        out = 1.0 + 0.1 * z
    else:
        out = std * z
    return out.astype(dtype)


def random_params(cfg: ModelConfig, dtype: Any, seed: int = 0) -> dict[str, Any]:
    """Parameters of ``cfg``'s shapes drawn on the default device (SSM leaves f32 as the model
    keeps them: ``A_log``, ``dt_bias``, ``D``... follow ``dtype`` like ``init_params``)."""
    plain = cfg.model_family.plain_norms
    key = jax.random.key(seed)
    counter = iter(range(1 << 30))

    def build(tree: Any, name: str) -> Any:
        if isinstance(tree, dict):
            return {k: build(v, k) for k, v in tree.items()}
        if not (isinstance(tree, tuple) and all(isinstance(d, int) for d in tree)):
            return tuple(build(v, name) for v in tree)
        if name in _CENTRED and not plain:
            kind, std = "centred", 0.1
        elif name in _PLUS_ONE + _CENTRED:
            kind, std = "one", 0.1
        elif name in ("A_log", "dt_bias"):
            kind, std = name, 1.0
        else:
            kind = "plain"
            std = 1.0 if name == "embed" else 1.0 / (tree[-2] if len(tree) >= 2 else 1) ** 0.5
        return _leaf(jax.random.fold_in(key, next(counter)), shape=tree, dtype=dtype, kind=kind,
                     std=std)

    params = build(param_shapes(cfg), "")
    if cfg.tie_word_embeddings:
        params["lm_head"] = params["embed"].T
    return params


def _median_s(fn: Callable[[], Any], iters: int) -> float:
    """Median wall seconds of ``fn()`` (blocked until ready) after one warm-up call."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _batches(cfg: ModelConfig, rows: int, context: int, prefill: list[int], page_size: int):
    """(pools, decode batch, prefill batch): decode row i on its own pages and slot ``i + 1``;
    prefill sequences from scratch on pages and slots after the decode rows'."""
    per_row = -(-(context + 1) // page_size)
    decode, prefill_specs, page, tok = [], [], 1, 1
    for i in range(rows):
        decode.append(SeqSpec([tok], context, list(range(page, page + per_row)), i + 1, i + 1))
        page += per_row
    for j, n in enumerate(prefill):
        need = -(-n // page_size)
        prefill_specs.append(SeqSpec([tok] * n, 0, list(range(page, page + need)), 0,
                                     rows + j + 1))
        page += need
    return page - 1, rows + len(prefill), (build_forward_batch(decode, page_size) if rows
                                           else None), (
        build_forward_batch(prefill_specs, page_size) if prefill else None)


def compile_all(programs: dict[str, tuple[Callable, tuple]], threads: int) -> dict[str, Any]:
    """``{name: (jitted fn, args)}`` -> ``{name: compiled}``, lowered and compiled in
    ``threads`` threads (XLA and Triton compile outside the GIL: the programs of a real-size
    model take minutes one after another)."""
    def one(item):
        fn, args = item
        return fn.lower(*args).compile()

    with ThreadPoolExecutor(max(1, threads)) as pool:
        done = dict(zip(programs, pool.map(one, programs.values()), strict=True))
    return done


def _timed_step(step, params, pools, batch, iters: int) -> tuple[float, PoolState]:
    """Median seconds of the compiled ``step`` (pools donated, threaded through the calls)."""
    state = {"pools": pools}

    def call():
        state["pools"], logits = step(params, state["pools"], batch)
        return logits

    return _median_s(call, iters), state["pools"]


def moe_program(cfg: ModelConfig, params: dict[str, Any], num_tokens: int,
                form: str) -> tuple[Callable, tuple]:
    """The first MoE feed-forward (the family's ``ffn``) with ``form`` (``MOE_FORMS``) on
    ``num_tokens`` random tokens: ``(jitted fn, args)``."""
    layer = params["layers"][cfg.mlp_types.index("moe")]
    x = jax.random.normal(jax.random.key(7), (num_tokens, cfg.hidden_size),
                          params["embed"].dtype)
    return jax.jit(lambda layer, x: cfg.model_family.ffn(cfg, layer, x, form, None)), (layer, x)


def time_moe(cfg: ModelConfig, params: dict[str, Any], num_tokens: int, form: str,
             iters: int) -> float:
    """Median seconds of ``moe_program``."""
    fn, args = moe_program(cfg, params, num_tokens, form)
    return _median_s(lambda: fn(*args), iters)


def _entry(seconds: float, cost: step_cost.Cost, peak: tuple | None, dtype: str,
           tokens: int) -> dict[str, Any]:
    bandwidth, flops = (peak[0], peak[1].get(dtype)) if peak else (None, None)
    floor = cost.floor_s(bandwidth, flops)
    return {"ms": seconds * 1e3, "tokens_per_s": tokens / seconds, **cost.as_dict(),
            "floor_ms": None if floor is None else floor * 1e3,
            "roofline_fraction": step_cost.fraction(floor, seconds)}


def check_fits(cfg: ModelConfig, itemsize: int, device: Any) -> None:
    """``ValueError`` naming the sizes when the weights alone exceed 90% of ``device``'s memory
    (e.g. Qwen3-Next-80B-A3B in bf16, 160 GB, on one H200); no check where the device does not
    report a limit (CPU)."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    limit = (stats or {}).get("bytes_limit")
    weights = sum(math.prod(s) for _, s in step_cost.param_leaves(cfg)) * itemsize
    if limit and weights > 0.9 * limit:
        raise ValueError(f"the weights ({weights / 1e9:.1f} GB) exceed 90% of the device's "
                         f"{limit / 1e9:.1f} GB")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every timing of the benchmark as one JSON-able dict (``main`` prints it)."""
    cfg = get_preset(args.preset)
    dtype = jnp.dtype(args.dtype)
    itemsize, name = dtype.itemsize, dtype.name
    kind = jax.devices()[0].device_kind
    check_fits(cfg, itemsize, jax.devices()[0])
    peak = None if jax.default_backend() == "cpu" else roofline(kind)
    start = time.perf_counter()
    params = jax.block_until_ready(random_params(cfg, dtype, args.seed))
    out: dict[str, Any] = {"preset": args.preset, "device": kind, "dtype": name,
                           "rows": args.rows, "context": args.context, "prefill": args.prefill,
                           "init_s": time.perf_counter() - start, "steps": {}, "moe": {}}
    lens = [int(n) for n in ([args.prefill.split("x")[1]] * int(args.prefill.split("x")[0])
                             if args.prefill else [])]
    num_pages, num_slots, dec, pre = _batches(cfg, args.rows, args.context, lens,
                                              args.page_size)
    costs = {"decode": step_cost.decode_cost(cfg, args.rows, args.context, itemsize),
             "prefill": step_cost.prefill_cost(cfg, lens, itemsize)}
    phases = [(p, b, t) for p, b, t in (("decode", dec, args.rows), ("prefill", pre, sum(lens)))
              if b is not None]
    pools = {k: PoolState.create(cfg, num_pages, args.page_size, num_slots, dtype)
             for k in args.kernels.split(",")}
    programs = {f"{phase}/{k}": (jax.jit(partial(forward, cfg=cfg, kernels=k,
                                                 decode=phase == "decode"),
                                         donate_argnums=(1,)), (params, pools[k], batch))
                for k in pools for phase, batch, _ in phases}
    moe_tokens = sorted({t for t in (args.rows, sum(lens)) if t}) if "moe" in cfg.mlp_types else []
    for tokens in moe_tokens:
        for form in args.moe_forms.split(","):
            programs[f"moe/{tokens}/{form}"] = moe_program(cfg, params, tokens, form)
    start = time.perf_counter()
    compiled = compile_all(programs, args.compile_threads)
    out["compile_s"] = time.perf_counter() - start
    for k in pools:
        for phase, batch, tokens in phases:
            seconds, pools[k] = _timed_step(compiled[f"{phase}/{k}"], params, pools[k], batch,
                                            args.iters)
            out["steps"][f"{phase}/{k}"] = _entry(seconds, costs[phase], peak, name, tokens)
    for tokens in moe_tokens:
        shapes = param_shapes(cfg)["layers"][cfg.mlp_types.index("moe")]["moe"]
        cost = step_cost.moe_layer_cost(cfg, shapes, tokens, itemsize)
        for form in args.moe_forms.split(","):
            _, fn_args = programs[f"moe/{tokens}/{form}"]
            exe = compiled[f"moe/{tokens}/{form}"]
            seconds = _median_s(lambda exe=exe, a=fn_args: exe(*a), args.iters)
            out["moe"][f"{tokens}/{form}"] = _entry(seconds, cost, peak, name, tokens)
    return out


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def table(result: dict[str, Any]) -> str:
    """The text table: time, the model's bytes and FLOPs, floor and fraction per entry."""
    lines = [f"{result['preset']} on {result['device']} ({result['dtype']}), random weights "
             f"drawn in {result['init_s']:.1f} s, {len(result['steps']) + len(result['moe'])} "
             f"programs compiled in {result['compile_s']:.1f} s",
             f"{'what':<24}{'ms':>10}{'tok/s':>12}{'GB':>9}{'TFLOP':>9}{'floor ms':>10}"
             f"{'of roof':>9}"]
    for group in ("steps", "moe"):
        for key, e in result[group].items():
            label = key if group == "steps" else f"moe {key.replace('/', ' tok/')}"
            lines.append(f"{label:<24}{e['ms']:>10.3f}{e['tokens_per_s']:>12.0f}"
                         f"{e['bytes'] / 1e9:>9.3f}{e['flops'] / 1e12:>9.3f}"
                         f"{_fmt(e['floor_ms'], '.3f'):>10}"
                         f"{_fmt(e['roofline_fraction'], '.0%'):>9}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m mambacache.bench.step", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", required=True, help="models/presets.py name (tiny or real)")
    p.add_argument("--rows", type=int, default=64, help="decode rows (0: no decode)")
    p.add_argument("--context", type=int, default=1024, help="cached tokens per decode row")
    p.add_argument("--prefill", default="4x512", help="N x L prefill sequences ('' : none)")
    p.add_argument("--kernels", default="pallas,reference")
    p.add_argument("--moe-forms", default=",".join(MOE_FORMS))
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compile-threads", type=int, default=8,
                   help="programs lowered and compiled at once")
    p.add_argument("--out", help="write the results as one JSON object")
    args = p.parse_args(argv)
    if args.prefill and (len(args.prefill.split("x")) != 2
                         or not all(s.isdigit() for s in args.prefill.split("x"))):
        p.error(f"--prefill must be NxL (e.g. 4x512), got {args.prefill!r}")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    result = run(args)
    print(table(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
