"""Serve requests from your own JAX loop: the radix cache, the pools and the jitted step by hand.

No ``Engine``: this shows where every index of a ``ForwardBatch`` comes from. One request at a
time, greedy, page_size 1. Run: ``python examples/manual_loop.py``.
"""

from __future__ import annotations

import functools

import jax
import numpy as np

from mambacache.cache.radix import make_cache
from mambacache.cache.snapshot_plan import assign_snapshot_slots, plan_snapshots
from mambacache.engine.runners.pools import PoolState
from mambacache.engine.step.batch import SeqSpec, build_forward_batch
from models.model import forward
from models.params import init_params
from models.presets import get_preset

PAGE_SIZE, NUM_PAGES, NUM_SLOTS = 1, 1024, 16


class ManualServer:
    def __init__(self):
        self.cfg = get_preset("tiny_qwen3_next")
        self.params = init_params(self.cfg, seed=0)
        # Host: the tree and its allocators (numpy ids). Device: the pools (one array per layer).
        self.cache = make_cache(enable=True, num_pages=NUM_PAGES, num_slots=NUM_SLOTS,
                                page_size=PAGE_SIZE)
        self.pools = PoolState.create(self.cfg, NUM_PAGES, PAGE_SIZE, NUM_SLOTS)
        self.step = jax.jit(functools.partial(forward, cfg=self.cfg, kernels="reference"),
                            donate_argnums=(1,))  # the pools are updated in place

    def generate(self, prompt: list[int], max_new_tokens: int) -> tuple[list[int], int]:
        """Greedy tokens for ``prompt`` and how many prompt tokens the cache served."""
        # 1. Match: cached_len tokens have KV in m.page_ids and their state in m.read_slot.
        m = self.cache.match_prefix(prompt)
        self.cache.lock(m.node)  # nothing on that path can be evicted while we run
        # 2. One running slot for this request, slots for the planned snapshots, KV pages for
        #    every token we will feed (the last sampled token is never fed).
        running = int(self.cache.alloc_slots(1)[0])
        positions = plan_snapshots(len(prompt), m.cached_len, m.branch_len, PAGE_SIZE)
        snaps = assign_snapshot_slots(self.cache, positions, m.branch_len, len(prompt), PAGE_SIZE)
        num_fed = len(prompt) + max_new_tokens - 1
        pages = np.concatenate([m.page_ids, self.cache.alloc_pages(num_fed - m.cached_len)])
        tokens, out = list(prompt), []
        start, read = m.cached_len, (m.read_slot or 0)  # slot 0 is the zero state
        while True:
            # 3. One step: the first reads the cached state, every step writes the running slot;
            #    snapshots are (offset in this extend, destination slot).
            spec = SeqSpec(tokens=tokens[start:], prefix_len=start, page_ids=pages,
                           read_slot=read, write_slot=running,
                           snapshots=[(p - start, s) for p, s in snaps.items()
                                      if start < p <= len(tokens)])
            self.pools, logits = self.step(self.params, self.pools,
                                           build_forward_batch([spec], PAGE_SIZE))
            out.append(int(np.argmax(logits[0])))
            if len(out) == max_new_tokens:
                break
            start, read = len(tokens), running
            tokens.append(out[-1])
        # 4. Finish: the tree takes the fed tokens' pages, the snapshots and the running slot
        #    (the state after all fed tokens); then release the lock.
        self.cache.insert(tokens, pages, snapshots={**snaps, len(tokens): running})
        self.cache.unlock(m.node)
        return out, m.cached_len


def main() -> None:
    server = ManualServer()
    rng = np.random.default_rng(0)
    system = rng.integers(0, server.cfg.vocab_size, 48).tolist()
    for i in range(3):
        prompt = system + rng.integers(0, server.cfg.vocab_size, 5).tolist()
        out, cached = server.generate(prompt, max_new_tokens=4)
        print(f"request {i}: cached {cached} of {len(prompt)} prompt tokens -> {out}")
    server.cache.check_integrity()


if __name__ == "__main__":
    main()
