"""Optional: our whole host path against SGLang's own ``MambaRadixCache`` tree, same trace, one
process (issue 23). Not part of CI; skips with a message when ``sglang`` or ``torch`` is absent.

    python scripts/compare_sglang_tree.py [--requests 2000] [--tail 64] [--repeats 3]

The trace: ``shared_prefix_trace(N, 16, 512, tail, output_len=16)``. (a) ours: the engine's
scheduler + cache on the shadow runner (``mambacache.bench.simulate.simulate``, 200k KV tokens,
256 state slots), reported as ``engine_us_per_request`` (checks excluded) and ``us_per_request``
(median). (b) SGLang's tree alone, per request in the order its scheduler calls it: match_prefix,
inc_lock_ref, evict when a pool is short, insert of prompt + output (what cache_finished_req
inserts), dec_lock_ref. Its allocators are minimal CPU stand-ins written here (a free list of KV
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
        import torch  # noqa: F401
    except ImportError:
        return None, "torch is not installed"
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

    class CpuKVAllocator(TokenToKVPoolAllocator):
        """Free list of KV token indices on CPU (index 0 is the padding slot, never handed out)."""

        def __init__(self, size: int):  # noqa: D107 - no kv cache object behind it
            self.size = size
            self.page_size = 1
            self.device = torch.device("cpu")
            self.free_list = list(range(size, 0, -1))

        def available_size(self):
            return len(self.free_list)

        def alloc(self, need_size: int):
            if need_size > len(self.free_list):
                return None
            out = self.free_list[-need_size:]
            del self.free_list[-need_size:]
            return torch.tensor(out, dtype=torch.int64)

        def free(self, free_index):
            self.free_list.extend(free_index.tolist())

        def free_segment(self, free_index, start_pos=0):
            self.free(free_index)

    class CpuSlotAllocator:
        def __init__(self, size: int):
            self.free_list = list(range(size - 1, -1, -1))

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
                             token_to_kv_pool_allocator=kv, page_size=1)
    return mrc.MambaRadixCache(params), kv, slots


def replay_sglang(mods, trace, num_kv_tokens: int, num_slots: int) -> tuple[list[float], float]:
    """Seconds per request of SGLang's tree alone (see the module docstring for the calls),
    and its hit rate (matched prompt tokens / prompt tokens)."""
    from array import array

    import torch

    mrc, bpc, _, _, RadixKey = mods
    tree, kv, slots = _sglang_tree(mods, num_kv_tokens, num_slots)
    times = []
    hit = total = 0
    for r in trace:
        prompt = array("q", r["prompt"])
        full = array("q", list(r["prompt"]) + list(r["output"]))
        t0 = time.perf_counter()
        m = tree.match_prefix(bpc.MatchPrefixParams(key=RadixKey(prompt)))
        node = m.last_device_node
        tree.inc_lock_ref(node)
        need = len(full) - len(m.device_indices)
        new = kv.alloc(need)
        if new is None:
            tree.evict(bpc.EvictParams(num_tokens=need - kv.available_size()))
            new = kv.alloc(need)
        slot = slots.alloc(1)
        if slot is None:
            tree.evict(bpc.EvictParams(mamba_num=1))
            slot = slots.alloc(1)
        if new is None or slot is None:
            raise RuntimeError("SGLang's tree could not free room for a request")
        value = torch.cat([m.device_indices, new])
        res = tree.insert(bpc.InsertParams(key=RadixKey(full), value=value, mamba_value=slot))
        if res.mamba_exist:
            slots.free(slot)
        tree.dec_lock_ref(node)
        times.append(time.perf_counter() - t0)
        hit += len(m.device_indices)
        total += len(prompt)
    return times, hit / max(total, 1)


def replay_ours(trace, num_kv_tokens: int, num_slots: int, concurrency: int = 1) -> dict:
    from mambacache.bench.simulate import simulate
    from mambacache.config import EngineConfig

    cfg = EngineConfig.load(None, overrides={"cache.num_kv_tokens": num_kv_tokens,
                                             "cache.num_mamba_slots": num_slots})
    return simulate(trace, cfg, concurrency=concurrency)


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
    args = ap.parse_args(argv)
    mods, why = _import_sglang()
    if mods is None:
        print(f"skipped: {why} (optional comparison, not part of CI)")
        return 0
    from mambacache.bench.simulate import shared_prefix_trace

    trace = shared_prefix_trace(args.requests, 16, 512, args.tail, output_len=16, seed=0)
    ours_mean, ours_med, sgl_med, sgl_mean = [], [], [], []
    for i in range(args.repeats):
        res = replay_ours(trace, args.kv_tokens, args.slots, args.concurrency)
        ours_mean.append(res["engine_us_per_request"])
        ours_med.append(res["us_per_request"])
        t, sgl_hit = replay_sglang(mods, trace, args.kv_tokens, args.slots)
        sgl_med.append(statistics.median(t) * 1e6)
        sgl_mean.append(statistics.fmean(t) * 1e6)
        print(f"pair {i}: ours engine_us_per_request {ours_mean[-1]:.1f} (us_per_request median "
              f"{ours_med[-1]:.1f}, hit rate {res['hit_rate']:.3f}); SGLang tree median "
              f"{sgl_med[-1]:.1f} us, mean {sgl_mean[-1]:.1f} us, hit rate {sgl_hit:.3f}",
              flush=True)
    o, s = statistics.median(ours_mean), statistics.median(sgl_med)
    print(f"median over {args.repeats}: ours engine_us_per_request {o:.1f} us, "
          f"us_per_request {statistics.median(ours_med):.1f} us; SGLang MambaRadixCache "
          f"median {s:.1f} us, mean {statistics.median(sgl_mean):.1f} us per request; "
          f"ratio SGLang / ours (engine_us_per_request) {s / o:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
