"""[compile.separate_sampler] The sampler as its own program, compiled once per logits-row count.

A fused step program (``step_program._step``) compiles the sampler (a sort of every logits row
over the vocabulary, the categorical draw) into every step shape, though the shapes share a few
logits-row counts: on TPU that sampler was ~23 s of each real-size program's compile CPU
(docs/bench.md, 2026-12-04, issue 38). Split, a plain step (no speculative decoding) is two
async dispatches with no host wait between them: ``step_program.jitted_step_logits`` (params,
pools donated, the carry read, the batch, the previous-token rows) -> (pools, logits float32
``[L, V]``), then ``jitted_sampler`` (logits, ``SamplingBatch``, the carry donated) -> (carry,
tokens int32 ``[L]``, logprobs float32 ``[L]``): the same arithmetic and outputs as the fused
step. ``SplitStep`` calls and lowers both like one jitted step (``ModelRunner`` holds it where it
held the fused program), so the warm-up, the ahead-of-time and while-loading compiles compile
both; the sampler's jit cache holds one executable per row count (and controls variant).

``separate_sampler_on``: the ``compile.separate_sampler`` key's rule; ``"auto"`` is on for TPU
only (where the saving was measured; CPU and GPU keep the fused program until a device measures
the extra dispatch).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax

from mambacache.engine.runners.step_program import (
    jitted_sharded_step,
    jitted_step,
    jitted_step_logits,
    write_future,
)
from mambacache.engine.sampling.sampler import SamplingBatch, sample
from pallas_kernels import ops

MODES = ("auto", "on", "off")


def separate_sampler_on(mode: str, platform: str) -> bool:
    """Whether ``compile.separate_sampler`` = ``mode`` splits the sampler off on ``platform``
    (``"tpu"``, ``"gpu"``, ``"cpu"``...): ``"on"``, ``"auto"`` on TPU only, never ``"off"``."""
    if mode not in MODES:
        raise ValueError(f"compile.separate_sampler must be 'auto', 'on' or 'off', got {mode!r}")
    return mode == "on" or (mode == "auto" and platform == "tpu")


def _sample_into(logits: jax.Array, sb: SamplingBatch, future: jax.Array, *,
                 fixed_order: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
    """logits float32 ``[L, V]``, ``future`` int32 ``[F]`` (donated) -> (``future`` with rows
    ``[:min(L, F)]`` the tokens, tokens int32 ``[L]``, logprobs float32 ``[L]``), as ``_step``."""
    tokens, logprobs = sample(logits, sb, fixed_order=fixed_order)
    return write_future(future, tokens), tokens, logprobs


@functools.cache
def jitted_sampler(fixed_order: bool, out_sh: Any = None):
    """The jitted sampler program (``future``, argument 2, donated); one executable per logits
    row count. ``out_sh``: the outputs' sharding under tensor parallelism (replicated)."""
    fn = functools.partial(_sample_into, fixed_order=fixed_order)
    if out_sh is None:
        return jax.jit(fn, donate_argnums=(2,))
    return jax.jit(fn, donate_argnums=(2,), out_shardings=(out_sh, out_sh, out_sh))


@dataclasses.dataclass(frozen=True)
class SplitLowered:
    """Both lowered programs; ``compile()`` compiles both (JAX keeps each executable)."""

    forward: Any
    sampler: Any

    def compile(self) -> tuple[Any, Any]:
        return self.forward.compile(), self.sampler.compile()


@dataclasses.dataclass(frozen=True)
class SplitStep:
    """A plain step as two programs, called like the fused ``_step``: ``(params, pools, future,
    batch, sb, prev_index) -> (pools, future, tokens, logprobs)``. Equal when both programs are
    (``loading_compiles.LoadingCompiles.matches`` compares runners' callables)."""

    forward: Any  # step_program.jitted_step_logits
    sampler: Any  # jitted_sampler
    logits_sharding: Any = None  # [parallel] the forward's logits out sharding

    def __call__(self, params: Any, pools: Any, future: jax.Array, batch: Any,
                 sb: SamplingBatch, prev_index: Any) -> tuple[Any, jax.Array, jax.Array,
                                                              jax.Array]:
        pools, logits = self.forward(params, pools, future, batch, prev_index)
        future, tokens, logprobs = self.sampler(logits, sb, future)
        return pools, future, tokens, logprobs

    def lower(self, params: Any, pools: Any, future: Any, batch: Any, sb: Any,
              prev_index: Any) -> SplitLowered:
        """Both programs lowered from abstract (or concrete) arguments; the sampler's logits
        are the forward's output as a call would hand them over (committed where the state
        is)."""
        fwd = self.forward.lower(params, pools, future, batch, prev_index)
        info = fwd.out_info[1]
        logits = jax.ShapeDtypeStruct(info.shape, info.dtype,
                                      sharding=self._sharding((params, pools)))
        return SplitLowered(fwd, self.sampler.lower(logits, sb, future))

    def _sharding(self, state: Any) -> Any:
        if self.logits_sharding is not None:
            return self.logits_sharding
        for x in jax.tree.leaves(state):  # one device: committed where the state is
            sharding = getattr(x, "sharding", None)
            if sharding is not None and getattr(x, "committed", True):
                return sharding if len(sharding.device_set) == 1 else None
        return None


def step_callables(cfg: Any, kernels: str, *, num_drafts: int = 0, spec_k: int = 0,
                   num_alts: int = 0, separate: bool = False, pool_sh: Any = None,
                   out_sh: Any = None, mesh: Any = None) -> dict[bool, Any]:
    """The runner's step callables by ``decode``: ``SplitStep``s where ``separate`` and the
    step is plain (no speculative decoding), else the fused jitted step (sharded with
    ``mesh``)."""
    fixed_order = getattr(cfg, "deterministic", False)
    if separate and not num_drafts and not spec_k:
        if mesh is None:
            pool_sh = out_sh = None
        sampler = jitted_sampler(fixed_order, out_sh)
        return {d: SplitStep(jitted_step_logits(cfg, kernels, d, ops.kernel_family(), pool_sh,
                                                out_sh, mesh), sampler, out_sh)
                for d in (False, True)}
    if mesh is None:
        return {d: jitted_step(cfg, kernels, d, num_drafts, spec_k, num_alts)
                for d in (False, True)}
    return {d: jitted_sharded_step(cfg, kernels, d, pool_sh, out_sh, mesh, num_drafts, spec_k,
                                   num_alts) for d in (False, True)}
