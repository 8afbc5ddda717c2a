"""Optional: our whole host path against SGLang's own ``MambaRadixCache`` tree, same trace, one
process (issue 23). Not part of CI; skips with a message when ``sglang`` or ``torch`` is absent.

    python scripts/compare_sglang_tree.py [--requests 2000] [--tail 64] [--repeats 3] \
        [--decode-steps 1 8]

The trace: ``shared_prefix_trace(N, 16, 512, tail, output_len=16)``. (a) ours: the engine's
scheduler + cache on the shadow runner (``mambacache.bench.simulate.simulate``, 200k KV tokens, 256
state slots), reported as ``engine_us_per_request`` (checks excluded) and ``us_per_request``
(median); ``--decode-steps``: ours at each ``scheduler.decode_steps`` in every round (multi-step
decode). (b) SGLang's tree alone, driven as its scheduler drives it with the mamba extra buffer
(``replay_sglang``: the prefill tracks the state at the match's branching point, so a second request
of a prefix stores the 512-token state and later ones hit it, as ours do), per request in
its scheduler's order: match_prefix, inc_lock_ref, evict when a pool is short, then
cache_finished_req's work: free the KV past the tracked length, insert up to it with the tracked
state, dec_lock_ref. Its allocators are minimal CPU stand-ins written here (a free list of KV
indices, a free list of state slots) of the same sizes; nothing inside sglang is replaced.

Environment (CPU torch; sglang's own wheel pulls CUDA-only pieces): sglang 0.5.20 is the last
release with ``mem_cache/mamba_radix_cache.py`` (0.5.21 replaced it with the unified tree);
``pip install --no-deps sglang==0.5.20`` plus the small deps its mem_cache import chain asks for.
The PyPI ``torchvision`` is a CUDA build that cannot load beside CPU torch, and sglang's utility
module imports it at import time for JPEG / image helpers the tree never calls: when it does not
import, this script puts an inert ``torchvision`` module in front of the import system (any call
into it raises) before importing sglang.
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import statistics
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere


def inert_torchvision() -> None:
    """An importable ``torchvision`` whose every function raises (see the module docstring)."""
    try:
        import torchvision.io  # noqa: F401
        return
    except Exception:
        for k in [k for k in sys.modules if k == "torchvision" or k.startswith("torchvision.")]:
            del sys.modules[k]
    try:  # transformers must keep seeing no torchvision (it caches the answer)
        from transformers.utils import import_utils
        import_utils.is_torchvision_available()
    except Exception:
        pass

    class _Inert(types.ModuleType):
        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)

            def _missing(*a, **k):
                raise RuntimeError(f"torchvision is not usable here: {self.__name__}.{name}")
            return _missing

    class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, name, path, target=None):
            if name == "torchvision" or name.startswith("torchvision."):
                return importlib.machinery.ModuleSpec(name, self, is_package=True)
            return None

        def create_module(self, spec):
            m = _Inert(spec.name)
            m.__path__ = []
            return m

        def exec_module(self, module):
            pass

    sys.meta_path.insert(0, _Finder())


def _import_sglang():
    try:
        import torch
    except ImportError:
        return None, "torch is not installed"
    # the tree's tensors are tiny: one thread. Idle OpenMP workers otherwise spin after each
    # torch call and take the cores from the measured thread (ours' wall time grew 20x)
    torch.set_num_threads(1)
    inert_torchvision()
    try:
        from sglang.srt.mem_cache import base_prefix_cache as bpc
        from sglang.srt.mem_cache import mamba_radix_cache as mrc
        from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.radix_cache import RadixKey
    except ImportError as e:
        return None, f"sglang's MambaRadixCache cannot be imported ({e})"
    return (mrc, bpc, CacheInitParams, TokenToKVPoolAllocator, RadixKey), None


def _sglang_tree(mods, num_kv_tokens: int, num_slots: int):
    import torch

    mrc, bpc, CacheInitParams, TokenToKVPoolAllocator, RadixKey = mods

    class FreeList:
        """A stack of free ids (``free_list``) as SGLang's allocators answer: ``alloc`` takes the
        top ``n`` as an int64 tensor or None when short, ``free`` pushes a tensor's ids back."""

        free_list: list[int]

        def available_size(self):
            return len(self.free_list)

        def alloc(self, n: int):
            if n > len(self.free_list):
                return None
            out = self.free_list[-n:]
            del self.free_list[-n:]
            return torch.tensor(out, dtype=torch.int64)

        def free(self, idx):
            self.free_list.extend(idx.tolist())

    class CpuKVAllocator(FreeList, TokenToKVPoolAllocator):
        """Free list of KV token indices on CPU (index 0 is the padding slot, never handed out)."""

        def __init__(self, size: int):  # noqa: D107 - no kv cache object behind it
            self.size = size
            self.page_size = 1
            self.device = torch.device("cpu")
            self.free_list = list(range(size, 0, -1))

        def free_segment(self, free_index, start_pos=0):
            self.free(free_index)

    class CpuSlotAllocator(FreeList):
        def __init__(self, size: int):
            self.free_list = list(range(size - 1, -1, -1))

    class CpuReqToTokenPool:
        def __init__(self, slots):
            self.mamba_allocator = slots
            self.mamba_pool = None

    # the tree reads the process-wide server args for its caching granularity; as SGLang's own
    # tree tests do, publish plain ServerArgs with the granularity pre-seeded (no model config)
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    server_args = ServerArgs(model_path="dummy")
    server_args._mamba_cache_chunk_size = 64
    set_global_server_args_for_scheduler(server_args)
    kv = CpuKVAllocator(num_kv_tokens)
    slots = CpuSlotAllocator(num_slots)
    params = CacheInitParams(disable=False, req_to_token_pool=CpuReqToTokenPool(slots),
                             token_to_kv_pool_allocator=kv, page_size=1,
                             enable_mamba_extra_buffer=True)
    return mrc.MambaRadixCache(params), kv, slots


def replay_sglang(mods, trace, num_kv_tokens: int, num_slots: int,
                  track_interval: int = 256) -> tuple[list[float], list[float], float]:
    """Seconds per request of SGLang's tree alone (wall, and the thread's CPU time), driven as
    its scheduler drives it with the mamba extra buffer (``--mamba-scheduler-strategy
    extra_buffer``), and its hit rate (matched prompt tokens / prompt tokens).

    Per request, in its scheduler's order: ``match_prefix`` (which returns the branching point,
    ``mamba_branching_seqlen``: the last chunk-aligned position of the match without a state),
    ``inc_lock_ref``, KV for the uncached tokens and two state slots (running + the ping-pong
    track slot; ``evict`` when a pool is short), then what ``cache_finished_req`` does with the
    extra buffer: the tracked length is the branching point when the prefill's extend covers it,
    else the extend's last chunk-aligned position (``schedule_batch``'s track entry), moved on by
    decode steps landing on ``track_interval``; KV past it is freed, the tokens up to it are
    inserted with the track slot as their state, the running slot is freed (and the track slot
    too if the tree had that state), ``dec_lock_ref``."""
    from array import array

    import torch

    mrc, bpc, _, _, RadixKey = mods
    tree, kv, slots = _sglang_tree(mods, num_kv_tokens, num_slots)
    grid = tree.mamba_cache_chunk_size
    times, cpu = [], []
    hit = total = 0
    for r in trace:
        prompt = array("q", r["prompt"])
        full = array("q", list(r["prompt"]) + list(r["output"]))
        n_prompt, n_fed = len(prompt), len(full) - 1  # the last output token is never fed
        t0, c0 = time.perf_counter(), time.thread_time()
        m = tree.match_prefix(bpc.MatchPrefixParams(key=RadixKey(prompt)))
        node = m.last_device_node
        tree.inc_lock_ref(node)
        cached = len(m.device_indices)
        need = len(full) - cached
        new = kv.alloc(need)
        if new is None:
            tree.evict(bpc.EvictParams(num_tokens=need - kv.available_size()))
            new = kv.alloc(need)
        pair = slots.alloc(2)
        if pair is None:
            tree.evict(bpc.EvictParams(mamba_num=2 - slots.available_size()))
            pair = slots.alloc(2)
        if new is None or pair is None:
            raise RuntimeError("SGLang's tree could not free room for a request")
        track = cached + (n_prompt - cached) // grid * grid
        b = m.mamba_branching_seqlen
        if b is not None and cached < b < n_prompt and (b - cached) % grid == 0:
            track = b
        if n_fed // track_interval * track_interval > n_prompt:  # a decode step's track
            track = n_fed // track_interval * track_interval
        value = torch.cat([m.device_indices, new])
        if track < len(full):
            kv.free(value[max(track, cached):])
        res = tree.insert(bpc.InsertParams(key=RadixKey(full[:track]), value=value[:track],
                                           mamba_value=pair[1:], prev_prefix_len=cached))
        slots.free(pair if res.mamba_exist else pair[:1])
        tree.dec_lock_ref(node)
        times.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
        hit += cached
        total += n_prompt
    return times, cpu, hit / max(total, 1)


def replay_ours(trace, num_kv_tokens: int, num_slots: int, concurrency: int = 1,
                decode_steps: int = 1) -> dict:
    """``simulate``'s result plus ``engine_cpu_us_per_request``: the thread's CPU time in
    ``Engine.step`` less the shadow runner's ``run`` (on a loaded machine wall time mostly
    measures the other processes), per request. ``decode_steps`` > 1:
    ``scheduler.decode_steps`` (multi-step decode). Public API only: runs against older trees
    (with ``decode_steps`` 1)."""
    from mambacache.bench.simulate import simulate
    from mambacache.config import EngineConfig
    from mambacache.engine.engine import Engine
    from mambacache.engine.shadow.runner import ShadowRunner

    cpu = {"step": 0.0, "run": 0.0}

    def timed(fn, key):
        def wrapper(*a, **k):
            c0 = time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                cpu[key] += time.thread_time() - c0
        return wrapper

    sets = {"cache.num_kv_tokens": num_kv_tokens, "cache.num_mamba_slots": num_slots}
    if decode_steps > 1:
        sets["scheduler.decode_steps"] = decode_steps
    cfg = EngineConfig.load(None, overrides=sets)
    step, run = Engine.step, ShadowRunner.run
    run_multi = getattr(ShadowRunner, "run_multi", None)
    Engine.step, ShadowRunner.run = timed(step, "step"), timed(run, "run")
    if run_multi is not None:
        ShadowRunner.run_multi = timed(run_multi, "run")
    try:
        res = simulate(trace, cfg, concurrency=concurrency)
    finally:
        Engine.step, ShadowRunner.run = step, run
        if run_multi is not None:
            ShadowRunner.run_multi = run_multi
    res["engine_cpu_us_per_request"] = (cpu["step"] - cpu["run"]) / res["num_requests"] * 1e6
    return res


def _ours_in(tree: str, args) -> dict:
    """``replay_ours`` with the ``mambacache`` of another checkout (a subprocess)."""
    import json
    import subprocess

    cmd = [sys.executable, __file__, "--ours-only", "--ours-tree", tree, "--requests",
           str(args.requests), "--tail", str(args.tail), "--kv-tokens", str(args.kv_tokens),
           "--slots", str(args.slots), "--concurrency", str(args.concurrency)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def _row(name: str, vals: list[tuple[float, float]]) -> str:
    wall, cpu = statistics.median(v[0] for v in vals), statistics.median(v[1] for v in vals)
    return f"{name}: wall {wall:.1f} us, CPU {cpu:.1f} us per request (median of {len(vals)})"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--tail", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="alternating (ours, SGLang) pairs")
    ap.add_argument("--kv-tokens", type=int, default=200_000)
    ap.add_argument("--slots", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=1,
                    help="our scheduler.max_running_requests (simulate's default 1)")
    ap.add_argument("--decode-steps", type=int, nargs="+", default=[1],
                    help="ours at each scheduler.decode_steps K (multi-step decode) per round")
    ap.add_argument("--track-interval", type=int, default=256,
                    help="SGLang's --mamba-track-interval (decode-tracked states)")
    ap.add_argument("--baseline-tree", default=None,
                    help="also run ours from this checkout (e.g. a `git worktree` of an older "
                         "commit), in each round beside the current tree")
    ap.add_argument("--ours-tree", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--ours-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.ours_tree:
        sys.path.insert(0, args.ours_tree)
    from mambacache.bench.simulate import shared_prefix_trace

    trace = shared_prefix_trace(args.requests, 16, 512, args.tail, output_len=16, seed=0)
    if args.ours_only:
        import json

        res = replay_ours(trace, args.kv_tokens, args.slots, args.concurrency)
        print(json.dumps({k: res[k] for k in ("engine_us_per_request", "us_per_request",
                                              "engine_cpu_us_per_request", "hit_rate")}))
        return 0
    mods, why = _import_sglang()
    if mods is None:
        print(f"skipped: {why} (optional comparison, not part of CI)")
        return 0
    ks = args.decode_steps
    ours_k: dict[int, list] = {k: [] for k in ks}
    base, sgl, sgl_med = [], [], []
    for i in range(args.repeats):
        line = f"round {i}:"
        for k in ks:
            res = replay_ours(trace, args.kv_tokens, args.slots, args.concurrency, k)
            ours_k[k].append((res["engine_us_per_request"], res["engine_cpu_us_per_request"]))
            line += (f" ours (K {k}) engine_us_per_request {ours_k[k][-1][0]:.1f} (CPU "
                     f"{ours_k[k][-1][1]:.1f}, hit rate {res['hit_rate']:.3f}, steps "
                     f"{res['steps']});")
        if args.baseline_tree:
            b = _ours_in(args.baseline_tree, args)
            base.append((b["engine_us_per_request"], b["engine_cpu_us_per_request"]))
            line += f" baseline {base[-1][0]:.1f} (CPU {base[-1][1]:.1f});"
        t, c, sgl_hit = replay_sglang(mods, trace, args.kv_tokens, args.slots,
                                     args.track_interval)
        sgl.append((statistics.fmean(t) * 1e6, statistics.fmean(c) * 1e6))
        sgl_med.append(statistics.median(t) * 1e6)
        print(f"{line} SGLang tree mean {sgl[-1][0]:.1f} (CPU {sgl[-1][1]:.1f}), median "
              f"{sgl_med[-1]:.1f} us, hit rate {sgl_hit:.3f}", flush=True)
    for k in ks:
        print(_row(f"ours engine_us_per_request, decode_steps {k}", ours_k[k]))
    if base:
        print(_row("baseline engine_us_per_request", base))
    print(_row("SGLang MambaRadixCache (mean per request)", sgl)
          + f"; its per-request median {statistics.median(sgl_med):.1f} us")
    s = statistics.median(v[1] for v in sgl)
    for k in ks:
        o = statistics.median(v[1] for v in ours_k[k])
        w = statistics.median(v[0] for v in sgl) / statistics.median(v[0] for v in ours_k[k])
        print(f"ratio SGLang / ours (decode_steps {k}), CPU per request: {s / o:.2f}x (wall "
              f"{w:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
