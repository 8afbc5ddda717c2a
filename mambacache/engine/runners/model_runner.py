"""The model runner: pad a step to shape buckets, run the jitted step (``step_program.py``) with
the pools donated, read its tokens back.

The host hands over ``SeqSpec``s (token ids, page ids, slots, snapshots); the runner packs them
into a ``ForwardBatch`` whose shapes come from ``engine/step/buckets.py``: a configuration compiles
a finite, known set of programs (``Buckets.program_set``), which ``warm`` compiles up front on
dummy rows that write only the dump page 0 and the dropped slot 0 (after ``compile_ahead``
compiled it from abstract shapes, in the warm-up's thread pool). Every XLA compile made while
running a step is counted where JAX makes it (``engine/runners/compiles.py``):
``programs_compiled``. Its pools' operations between steps (copies, host-tier transfers, resize,
reset) are the mixin ``RunnerPools`` (``runner_pools.py``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mambacache.engine.runners.compiles import CompileCounter
from mambacache.engine.runners.multi_step import MultiStepRows, jitted_multi_step
from mambacache.engine.runners.pools import PoolState
from mambacache.engine.runners.runner_pools import RunnerPools
from mambacache.engine.runners.sampler_program import step_callables
from mambacache.engine.sampling.logit_controls import controls_for, pack_controls
from mambacache.engine.sampling.sampler import SamplingBatch
from mambacache.engine.speculative import chain as spec_chain
from mambacache.engine.speculative import chain_step
from mambacache.engine.speculative.drafters import mtp_inputs
from mambacache.engine.step.batch import build_forward_batch
from mambacache.engine.step.buckets import (
    MIN_PAGE_BUCKET,
    MIN_SEQ_BUCKET,
    MIN_SNAPSHOT_BUCKET,
    MIN_TOKEN_BUCKET,
    Buckets,
    StepShape,
    bucket,
)
from mambacache.engine.step.plan import ScheduledSeq, SeqSpec, is_decode_step, logit_rows

__all__ = ["MIN_PAGE_BUCKET", "MIN_SEQ_BUCKET", "MIN_SNAPSHOT_BUCKET", "MIN_TOKEN_BUCKET",
           "ModelRunner", "bucket"]

#: the longest sequence a runner built without a model config pads extend steps for (tests)
DEFAULT_MAX_SEQ_LEN = 4096


class ModelRunner(RunnerPools):
    """Owns the params and the device pools; runs one step at a time.

    ``run`` returns device arrays (tokens, logprobs); reading them is the only sync point.
    """

    def __init__(self, model_cfg: Any, params: Any, pools: PoolState, *, kernels: str,
                 page_size: int, max_seqs: int, num_drafts: int = 0, spec_k: int = 0,
                 num_alts: int = 0, buckets: Buckets | None = None, min_rows: int = 0,
                 separate_sampler: bool = False):
        self.model_cfg = model_cfg
        self.params = params
        self.pools = pools
        self.page_size = page_size
        # [deterministic] ``min_rows``: every program has at least that many rows (buckets.py)
        self.max_seqs = bucket(max_seqs, max(min_rows, 1))
        self.kernels = kernels
        # the shape rules; ``Engine.warmup`` narrows max_seq_len / max_step_tokens to a workload
        self.buckets = buckets or Buckets(
            page_size, self.max_seqs,
            getattr(model_cfg, "max_position_embeddings", DEFAULT_MAX_SEQ_LEN),
            max_step_tokens=self.max_seqs, min_rows=min_rows)
        # every XLA compile made inside ``run`` / ``copy_slots`` / ``warm``
        # (engine/runners/compiles.py)
        self.compiles = CompileCounter()
        self.warm_compiles = CompileCounter()
        # [overlap] the last step's sampled tokens, on the device; threaded like the pools
        # [speculative] spec_k > 0: the carry of the step's outcome (``spec_chain``), which
        # chained rows (a request's row built before its previous one is read) start from
        self.spec_k = spec_k
        width = num_drafts + num_alts  # [mtp] drafts per row, then the alternatives
        self.future: Any = (chain_step.empty_carry(self.max_seqs, spec_k, width) if spec_k
                            else jnp.zeros(self.max_seqs, jnp.int32))
        # [speculative] MTP drafts per sequence made by each step (0: no MTP head runs)
        self.num_drafts = num_drafts
        self.num_alts = num_alts  # [speculative tree] the head's alternatives to its first draft
        self.last_drafts: jax.Array | None = None  # int32 [num_seqs, num_drafts], last step's
        # [compile.separate_sampler] plain steps as two programs (engine/runners/sampler_program)
        self.separate_sampler = separate_sampler
        self._fns = step_callables(model_cfg, kernels, num_drafts=num_drafts, spec_k=spec_k,
                                   num_alts=num_alts, separate=separate_sampler)
        # [multi-step decode] K-iteration decode programs (not under tensor parallelism, nor
        # with speculative decoding's carry: the engine runs K = 1 there)
        self.multi_step_ok = not spec_k
        self.program_keys: set[tuple] = set()  # the step shapes requests ran (StepShape.key)
        self.host_pools: Any = None  # [host tier] engine/host_pools.HostPools, on first use
        # Start each step's copy back at dispatch, except on CPU: there the arrays already
        # are host memory, and the copy's completion stalled the XLA thread while the host
        # thread ran Python (multi_turn, 1 XLA thread: overlap 0.96x sync with it, 1.13x
        # without; likely the callback waits for the GIL) [overlap]
        leaves = jax.tree_util.tree_leaves(pools)  # (abstract pools: engine/loading_compiles)
        platform = (next(iter(leaves[0].devices())).platform
                    if leaves and hasattr(leaves[0], "devices") else jax.default_backend())
        self.copy_back = platform != "cpu"

    def place(self, params: Any, pools: PoolState) -> None:
        """Run from now on with ``params`` and ``pools`` (same layout: placed on a mesh by
        ``parallel.mesh.shard_engine``, or restored rows from ``Engine.replace_pools``)."""
        if self.host_pools is not None:  # [host tier] queued demotions read the old pools
            self.host_pools.flush(self.pools)
        self.params, self.pools = params, pools

    def use_buckets(self, buckets: Buckets) -> None:
        """Pad steps to ``buckets``' shapes from now on (``Engine.warmup`` narrows them)."""
        self.buckets = buckets

    # [parallel] tensor parallel: set by ``mambacache.parallel.mesh.shard_engine``
    def use_shardings(self, mesh: Any, pool_sh: Any) -> None:
        """Compile the step for ``mesh``, pools placed with ``pool_sh`` (params: as placed)."""
        from mambacache.parallel.mesh import replicated

        self._fns = step_callables(self.model_cfg, self.kernels, num_drafts=self.num_drafts,
                                   spec_k=self.spec_k, num_alts=self.num_alts,
                                   separate=self.separate_sampler, pool_sh=pool_sh,
                                   out_sh=replicated(mesh), mesh=mesh)
        self.future = jax.device_put(self.future, replicated(mesh))
        self.multi_step_ok = False

    @property
    def step_programs(self) -> dict[bool, Any]:
        """The jitted step callables by ``decode`` (shared by runners over the same model: what
        one compiled, another with equal callables runs without compiling)."""
        return self._fns

    @property
    def programs_compiled(self) -> int:
        """XLA compiles made while running steps (JAX's events; 0 once warm)."""
        return self.compiles.compiles

    @property
    def compile_s(self) -> float:
        """Seconds of tracing, lowering and compiling while running steps."""
        return self.compiles.seconds

    def programs_per_width(self) -> dict[int, int]:
        """``{step width (sequences): step shapes run at that width}``."""
        out: dict[int, int] = {}
        for key in self.program_keys:
            width = dict(key[1:])["num_seqs"]
            out[width] = out.get(width, 0) + 1
        return dict(sorted(out.items()))

    def shape_for(self, scheduled: Sequence[ScheduledSeq]) -> StepShape:
        """The bucket ``scheduled`` runs at (``engine/step/buckets.py``)."""
        seqs = [s.spec for s in scheduled]
        return self.buckets.shape(seqs, is_decode_step(seqs), len(logit_rows(scheduled)[0]))

    def shapes_for(self, seqs: Sequence[SeqSpec]) -> dict[str, int]:
        """The padded sizes of ``seqs`` (one logits row each)."""
        return self.buckets.shape(seqs, is_decode_step(seqs), len(seqs)).sizes()

    def run(self, scheduled: Sequence[ScheduledSeq]) -> tuple[jax.Array, jax.Array]:
        """One step over ``scheduled``: sampled tokens and logprobs, one per logits row
        (``step.plan.logit_rows``: one per row, every position of a verify row), still on the
        device (reading them is the sync point).

        A batch where every sequence extends by one token and takes no snapshot runs the decode
        program (``T == B``).
        """
        seqs = [s.spec for s in scheduled]
        params, steps = logit_rows(scheduled)
        shape = self.buckets.shape(seqs, is_decode_step(seqs), len(params))
        # numpy in: the jitted call transfers the arrays in C++ (a jnp.asarray per field cost
        # about a third of the host's time per step, on the overlapped loop's critical path)
        batch = build_forward_batch(seqs, self.page_size, all_pages=self.num_drafts > 0,
                                    as_numpy=True, **shape.sizes())
        controls = controls_for(scheduled, shape.num_logits, self.model_cfg.vocab_size)
        sb = SamplingBatch.from_params(list(params), list(steps), shape.num_logits, controls)
        self.program_keys.add(shape.key)
        prev = future_index(seqs, shape.num_tokens)
        extra = ()
        if self.spec_k:  # [speculative] chained rows; the MTP head drafts for the next step
            extra = (self._spec_inputs(scheduled, shape),)
        with self.compiles.track():
            if self.host_pools is not None:  # [host tier] demotions read before the step writes
                self.host_pools.flush(self.pools)
            out = self._fns[shape.decode](self.params, self.pools, self.future, batch, sb, prev,
                                          *extra)
        self.pools, self.future, tokens, logprobs = out[:4]
        self.last_drafts = out[4] if self.num_drafts else None
        for x in out[2:] if self.copy_back else ():  # the read finds them on the host
            x.copy_to_host_async()
        return tokens, logprobs

    def run_multi(self, scheduled: Sequence[ScheduledSeq],
                  iterations: int) -> tuple[jax.Array, jax.Array]:
        """[multi-step decode] ``iterations`` decode iterations of ``scheduled`` (decode rows,
        row i running ``scheduled[i].steps``: ``engine/runners/multi_step.py``) in one dispatch;
        tokens and logprobs ``[iterations, L]``, still on the device."""
        seqs = [s.spec for s in scheduled]
        params = [s.req.params for s in scheduled]  # every row samples, its first output index:
        steps = [s.req.num_outputs for s in scheduled]  # iteration j's key is steps + j
        shape = self.buckets.multi_shape([s.end for s in scheduled], iterations)
        # every page a row holds (up to P): its later iterations write past the first's
        batch = build_forward_batch(seqs, self.page_size, all_pages=True, as_numpy=True,
                                    **shape.sizes())
        sb = SamplingBatch.from_params(params, steps, shape.num_logits)
        rows = MultiStepRows.build(scheduled, shape.num_seqs,
                                   getattr(self.model_cfg, "eos_token_id", None))
        self.program_keys.add(shape.key)
        prev = future_index(seqs, shape.num_tokens)
        with self.compiles.track():
            if self.host_pools is not None:  # [host tier] demotions read before the step writes
                self.host_pools.flush(self.pools)
            out = self._multi_fn(iterations)(self.params, self.pools, self.future, batch, sb,
                                             prev, rows)
        self.pools, self.future, tokens, logprobs = out
        for x in (tokens, logprobs) if self.copy_back else ():
            x.copy_to_host_async()
        return tokens, logprobs

    def _multi_fn(self, iterations: int) -> Any:
        return jitted_multi_step(self.model_cfg, self.kernels, iterations, self.page_size)

    def _spec_inputs(self, scheduled: Sequence[ScheduledSeq],
                     shape: StepShape) -> dict[str, np.ndarray]:
        return {**mtp_inputs(scheduled, shape.num_tokens, shape.num_seqs),
                **spec_chain.chain_inputs([s.chain for s in scheduled], shape.num_seqs,
                                          self.spec_k)}

    def warm(self, shape: StepShape, logit_controls: bool = False) -> None:
        """Compile (and run once) the step program of ``shape`` on dummy rows: each reads and
        writes only the dump page 0 and slot 0 (the zero state, whose writes are dropped), so
        no cached page or state changes. Call it only while no step is in flight (the
        ``future`` row 0 it overwrites is read by no later step). ``logit_controls``: the
        variant whose sampler applies penalties and masks (``MIN_IDS`` wide, changing nothing
        here); single-step shapes only (a multi-step dispatch runs no controlled row)."""
        fn, args = self._warm_call(shape, logit_controls)
        with self.warm_compiles.track():
            out = fn(self.params, self.pools, self.future, *args)
            self.pools, self.future = out[:2]
            jax.block_until_ready(out[2])

    def compile_ahead(self, shape: StepShape, logit_controls: bool = False) -> float:
        """Lower and compile ``warm(shape, logit_controls)``'s program from abstract shapes
        (params, pools and the carry as ``ShapeDtypeStruct``s with their shardings; nothing is
        allocated or run); JAX keeps the executable, so ``warm`` then only runs it. Safe to call
        from several threads at once (``engine/runners/warmup.py``'s pool). Returns the seconds it
        took (tracing, lowering and the XLA compile, or the load from the persistent cache)."""
        fn, args = self._warm_call(shape, logit_controls)
        state = jax.tree.map(abstract, (self.params, self.pools, self.future))
        t0 = time.perf_counter()
        with self.warm_compiles.track():
            fn.lower(*state, *args).compile()
        return time.perf_counter() - t0

    def _warm_call(self, shape: StepShape, logit_controls: bool) -> tuple[Any, tuple]:
        """``(program, host arguments after params, pools and the carry)`` of ``warm``'s dummy
        step at ``shape``: every row reads and writes only the dump page 0 and slot 0."""
        n = shape.num_seqs if shape.decode else 1
        seqs = [SeqSpec(tokens=[0], prefix_len=0, page_ids=[0], read_slot=0, write_slot=0)
                for _ in range(n)]
        batch = build_forward_batch(seqs, self.page_size, all_pages=self.num_drafts > 0,
                                    as_numpy=True, **shape.sizes())
        controls = pack_controls([], shape.num_logits, self.model_cfg.vocab_size) \
            if logit_controls else None
        sb = SamplingBatch.from_params([], [], shape.num_logits, controls)
        prev = np.full(shape.num_tokens, -1, np.int32)
        if shape.iterations > 1:  # [multi-step decode] every row limit 0: frozen throughout
            rows = MultiStepRows.build([], shape.num_seqs, None)
            return self._multi_fn(shape.iterations), (batch, sb, prev, rows)
        extra = (self._spec_inputs([], shape),) if self.spec_k else ()
        return self._fns[shape.decode], (batch, sb, prev, *extra)


def abstract(x: jax.Array) -> jax.ShapeDtypeStruct:
    """``x``'s shape and dtype, and its sharding when it is committed to it (placed on a mesh
    or a device): an uncommitted array's program is the one JAX compiles for it when called."""
    committed = getattr(x, "committed", getattr(x, "_committed", True))
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding if committed else None)


def future_index(seqs: Sequence[SeqSpec], num_tokens: int) -> np.ndarray:
    """int32 ``[num_tokens]`` (packed like ``build_forward_batch``): ``s.prev_index`` at the last
    extend token of each sequence that has one, -1 elsewhere (the token is known) [overlap]."""
    out = np.full(num_tokens, -1, np.int32)
    n = len(seqs)
    ends = np.cumsum(np.fromiter((len(s.tokens) for s in seqs), np.int64, n)) - 1
    prev = np.fromiter((s.prev_index for s in seqs), np.int64, n)
    has = prev >= 0
    out[ends[has]] = prev[has]
    return out
