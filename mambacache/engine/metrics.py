"""Engine counters and the ``Engine.metrics()`` dictionary."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mambacache.engine.engine import Engine


@dataclasses.dataclass
class EngineMetrics:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    computed_prefill_tokens: int = 0
    finished_requests: int = 0
    num_steps: int = 0
    failed_steps: int = 0
    host_s: float = 0.0
    wall_s: float = 0.0
    peak_token_usage: float = 0.0
    peak_mamba_usage: float = 0.0
    pure_decode_steps: int = 0  # steps whose every row is a decode token
    decode_program_steps: int = 0  # of those, steps that ran the decode program

    busy_s: float = 0.0  # wall time with a step in flight (dispatched, results not read)
    active_s: float = 0.0  # wall time of steps and of the gaps between them while busy
    overlap_steps: int = 0  # [overlap] steps dispatched while the step before was in flight
    host_bound_steps: int = 0  # of those, the one before was done when scheduling ended
    _last_end: float | None = None
    _in_flight: int = 0
    _busy_after: bool = False
    _flight_t: float = 0.0

    def on_step(self, engine: Engine, scheduled: list, *, host_s: float, wall_s: float,
                busy_s: float = 0.0, t_start: float | None = None) -> None:
        self.busy_s += busy_s
        gap = t_start - self._last_end if t_start is not None and self._last_end else 0.0
        self.active_s += wall_s + (gap if self._busy_after else 0.0)
        self._last_end = (t_start or 0.0) + wall_s
        # the gap before the next step is busy if work was left at the end of this one
        self._busy_after = engine.has_unfinished() or self._in_flight > 0
        self.host_s += host_s
        self.wall_s += wall_s
        if not scheduled:  # [overlap] a call that only read the step in flight
            return
        self.num_steps += 1
        program = True  # is_decode_step of the rows' specs, in the same loop
        for s in scheduled:  # a loop, not all(generator): per row of every step
            if s.end - s.start != s.steps or s.start < s.req.prompt_len:
                break
            if program:
                spec = s.spec
                program = len(spec.tokens) == 1 and not spec.snapshots
        else:
            self.pure_decode_steps += 1
            self.decode_program_steps += program
        # protected share of each pool (cache.stats()'s usage, without a dict)
        tokens, states = engine.cache.usage()
        if tokens > self.peak_token_usage:
            self.peak_token_usage = tokens
        if states > self.peak_mamba_usage:
            self.peak_mamba_usage = states

    def on_flight(self, t: float, delta: int, *, host_bound: bool | None = None) -> None:
        """[overlap] A step was dispatched (``delta`` +1) or read / dropped (-1) at ``t``:
        ``busy_s`` grows by the time at least one step was in flight. ``host_bound``: the step
        before (in flight) was already done on the device when this one's scheduling ended,
        before its batch was built (a lower bound on the device waiting; None: unknown)."""
        if self._in_flight > 0:
            self.busy_s += t - self._flight_t
        if host_bound is not None:
            self.overlap_steps += 1
            self.host_bound_steps += bool(host_bound)
        self._in_flight += delta
        self._flight_t = t

    def on_finish(self, req: Any) -> None:
        self.finished_requests += 1
        self.prompt_tokens += req.prompt_len
        self.cached_tokens += req.cached_tokens

    def as_dict(self, engine: Engine) -> dict[str, Any]:
        stats = engine.cache.stats()
        out = {k: v for k, v in dataclasses.asdict(self).items() if not k.startswith("_")}
        out.update(
            hit_rate=self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
            token_usage=stats["token_usage"], mamba_usage=stats["mamba_usage"],
            host_share=self.host_s / self.wall_s if self.wall_s else 0.0,
            decode_program_share=(self.decode_program_steps / self.pure_decode_steps
                                  if self.pure_decode_steps else None),
            programs_compiled=engine.runner.programs_compiled,  # XLA compiles in steps
            compile_s=getattr(engine.runner, "compile_s", 0.0),  # engine/runners/compiles.py
            step_programs=len(getattr(engine.runner, "program_keys", ())),  # shapes run
            programs_per_width=engine.runner.programs_per_width(),
            device_idle_share=1.0 - self.busy_s / self.active_s if self.active_s else None,
            host_bound_share=(self.host_bound_steps / self.overlap_steps
                              if self.overlap_steps else None),
            preemptions=engine.scheduler.num_preemptions,
            snapshots_kept=stats.get("snapshots_kept", 0),
            snapshots_skipped=stats.get("snapshots_skipped", 0),
            snapshots_evicted=stats.get("snapshots_evicted", 0),
            running_requests=len(engine.scheduler.running),
            waiting_requests=len(engine.scheduler.waiting), **kv_bytes_per_token(engine),
            **engine.cache.budget_stats())  # [issue 25] the byte budget, bytes held, peaks
        pools = getattr(engine.runner, "pools", None)
        if pools is not None:  # [issue 25] the pools' bytes per device, reserved rows included
            nbytes = pools.device_nbytes()
            out.update(pool_kv_bytes=nbytes["full"], pool_state_bytes=nbytes["mamba"],
                       pool_bytes=nbytes["full"] + nbytes["mamba"])
        tier = engine.cache.host_tier
        if tier is not None:  # [host tier] hits, bytes moved, load wait, host pool usage
            out.update(tier.stats())
            out["host_usage"] = out["host_bytes_held"] / out["host_memory_bytes"]
        return out


def kv_bytes_per_token(engine: Engine) -> dict[str, int]:
    """Bytes of KV pool one cached token takes over all attention layers (MLA: its latent row)
    and what per-head K and V would take (equal unless the model has MLA layers)."""
    cfg = engine.model_cfg
    if not hasattr(cfg, "kv_values_per_token"):  # a runner without a model (shadow runner)
        return {}
    itemsize = {"float32": 4, "bfloat16": 2}.get(engine.cfg.model.dtype, 4)
    return {"kv_bytes_per_token": cfg.kv_values_per_token * itemsize,
            "kv_bytes_per_token_expanded": cfg.kv_values_per_token_expanded * itemsize}
