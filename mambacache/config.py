"""Engine configuration: composed frozen dataclasses, loaded from TOML with dotted-key overrides.

Each TOML section maps one-to-one onto a dataclass below (``[model]`` -> ``ModelSection``, ...).
Every dataclass validates itself in ``__post_init__``; TOML is parsed only at entry points
(``EngineConfig.load``), never below them.
"""

from __future__ import annotations

import dataclasses
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

DTYPES = ("float32", "bfloat16")
KERNELS = ("auto", "pallas", "reference")
EVICTIONS = ("auto", "lru", "flop_aware")
SPEC_METHODS = ("none", "ngram", "mtp")
MAX_DRAFT_TOKENS = 16
#: most branches of a speculative draft tree (``speculative.topk``)
MAX_DRAFT_BRANCHES = 8
#: the most decode iterations one dispatch runs (``scheduler.decode_steps``)
MAX_DECODE_STEPS = 64


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _positive(name: str, value: int) -> None:
    _require(isinstance(value, int) and value > 0, f"{name} must be a positive int, got {value!r}")


@dataclasses.dataclass(frozen=True)
class ModelSection:
    """Which model to serve: a Hugging Face directory (``path``) or a seeded random ``preset``.

    ``init_branch_scale`` (random init only): every matrix inside the layers is multiplied by
    it, so below 1 the residual branches shrink against the embedding and the next token depends
    mostly on the last one: greedy output falls into cycles, like a real model repeating a
    document (the ``spec_ngram`` benchmark; same shapes and compute as the preset).

    ``deterministic`` (off by default): a request's tokens and logprobs are a function of its
    own tokens alone, bit for bit, whatever shares its steps, the chunked prefill size, the page
    size, speculative decoding or a cache hit (``docs/engine.md``, "Deterministic mode"). Every
    step then computes at least ``DETERMINISTIC_MIN_ROWS`` rows; its cost is in the README. With
    the Pallas kernels (``"pallas"``, or ``"auto"`` on GPU / TPU) prefills run on a chunk grid
    (``engine.prefill_grid``: hits at grid multiples, no speculative decoding, a chunked
    prefill of at least the grid).
    """

    path: str | None = None
    preset: str = "tiny_qwen3_next"
    seed: int = 0
    dtype: str = "float32"
    kernels: str = "auto"
    init_branch_scale: float = 1.0
    deterministic: bool = False

    def __post_init__(self):
        _require(self.dtype in DTYPES, f"model.dtype must be one of {DTYPES}, got {self.dtype!r}")
        _require(
            self.kernels in KERNELS, f"model.kernels must be one of {KERNELS}, got {self.kernels!r}"
        )
        _require(isinstance(self.seed, int), f"model.seed must be an int, got {self.seed!r}")
        _require(isinstance(self.init_branch_scale, int | float) and self.init_branch_scale > 0,
                 f"model.init_branch_scale must be > 0, got {self.init_branch_scale!r}")
        _require(self.init_branch_scale == 1.0 or self.path in (None, ""),
                 f"model.init_branch_scale ({self.init_branch_scale}) applies to a random init "
                 f"only, but model.path is {self.path!r}")
        _require(isinstance(self.deterministic, bool),
                 f"model.deterministic must be a bool, got {self.deterministic!r}")
        if self.path == "":
            object.__setattr__(self, "path", None)


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """The prefix cache and the pools it manages.

    ``num_kv_tokens`` is the KV pool size in tokens (rounded down to whole pages; page 0 is
    reserved). ``num_mamba_slots`` counts usable recurrent-state slots (slot 0, the zero state, is
    extra). ``checkpoint_interval`` = 0 disables periodic snapshots (256 by default: they are
    speculative, so chat does not pay for them). ``speculative_states``: plan
    the ``prompt_len - 1`` snapshot and the checkpoints as speculative states (kept while slots are
    free or until a hit promotes them; see ``cache/snapshot_plan.py``); false keeps states only at
    branch points and request ends.

    One byte budget (``cache/budget.py``): ``memory_bytes`` (per device; 0 = none) or
    ``memory_fraction`` (share of what the device has left after the weights and the step's
    peak; 0 = none). With a budget, KV pages and states draw on the same bytes and the pool
    sizes are derived from the model's ``state_bytes`` and ``kv_bytes_per_token`` (0 = from the
    model; set them to replay another model's mapping); ``num_kv_tokens`` / ``num_mamba_slots``
    left at 0 are derived, set they cap their pool. Without a budget they default to 16384 / 64.
    ``eviction`` ``"auto"``: ``lru`` for fixed pools, tuned ``flop_aware`` with a byte budget
    (KV and states ranked together by FLOPs saved per byte: on agent traces 4-9 points above
    ``lru`` over one pool, equal on chat; ``docs/radix_cache.md``).
    ``host_memory_bytes`` (0 = off): the host tier (``cache/host_tier.py``), one byte budget in
    host memory for KV pages and states that device eviction demotes into and a match promotes
    back from.
    ``rebalance`` (needs a byte budget): the device split between KV pages and state slots
    moves with the workload between a few quantised splits (``cache/rebalance.py``,
    ``engine/rebalance.py``); ``device_splits`` (derived by ``engine.pools.size_pools``, set
    to pin them): those splits as ``(pages, slots)`` pairs, ``num_kv_tokens`` /
    ``num_mamba_slots`` the one the pools start at. Off: the split is fixed at start.
    """

    enable: bool = True
    page_size: int = 1
    num_kv_tokens: int = 0
    num_mamba_slots: int = 0
    checkpoint_interval: int = 256
    eviction: str = "auto"
    speculative_states: bool = True
    memory_bytes: int = 0
    memory_fraction: float = 0.0
    state_bytes: int = 0
    kv_bytes_per_token: int = 0
    host_memory_bytes: int = 0
    running_share: float = 0.5
    rebalance: bool = False
    device_splits: tuple = ()

    def __post_init__(self):
        _positive("cache.page_size", self.page_size)
        _require(isinstance(self.running_share, int | float) and 0 < self.running_share <= 1,
                 f"cache.running_share must be in (0, 1], got {self.running_share!r}")
        _require(isinstance(self.rebalance, bool),
                 f"cache.rebalance must be a bool, got {self.rebalance!r}")
        _require(not self.rebalance or self.has_budget,
                 "cache.rebalance needs a byte budget (cache.memory_bytes or "
                 "cache.memory_fraction)")
        splits = tuple(tuple(int(x) for x in pair) for pair in self.device_splits)
        _require(all(len(p) == 2 and min(p) >= 1 for p in splits),
                 f"cache.device_splits must be (pages, slots) pairs >= 1, got "
                 f"{self.device_splits!r}")
        object.__setattr__(self, "device_splits", splits)
        _require(isinstance(self.speculative_states, bool),
                 f"cache.speculative_states must be a bool, got {self.speculative_states!r}")
        for name in ("memory_bytes", "state_bytes", "kv_bytes_per_token", "host_memory_bytes"):
            value = getattr(self, name)
            _require(isinstance(value, int) and not isinstance(value, bool) and value >= 0,
                     f"cache.{name} must be an int >= 0, got {value!r}")
        _require(isinstance(self.memory_fraction, int | float)
                 and 0 <= self.memory_fraction <= 1,
                 f"cache.memory_fraction must be in [0, 1], got {self.memory_fraction!r}")
        _require(not (self.memory_bytes and self.memory_fraction),
                 f"set one of cache.memory_bytes ({self.memory_bytes}) and "
                 f"cache.memory_fraction ({self.memory_fraction}), not both")
        if not self.has_budget:  # no budget: the fixed pools' defaults
            if self.num_kv_tokens == 0:
                object.__setattr__(self, "num_kv_tokens", 16384)
            if self.num_mamba_slots == 0:
                object.__setattr__(self, "num_mamba_slots", 64)
        _require(isinstance(self.num_mamba_slots, int) and self.num_mamba_slots >= 0,
                 f"cache.num_mamba_slots must be an int >= 0, got {self.num_mamba_slots!r}")
        _require(
            isinstance(self.num_kv_tokens, int)
            and (self.num_kv_tokens >= self.page_size or self.num_kv_tokens == 0),
            f"cache.num_kv_tokens must be >= cache.page_size ({self.page_size}), "
            f"got {self.num_kv_tokens!r}",
        )
        _require(
            isinstance(self.checkpoint_interval, int) and self.checkpoint_interval >= 0,
            f"cache.checkpoint_interval must be >= 0, got {self.checkpoint_interval!r}",
        )
        _require(
            self.eviction in EVICTIONS,
            f"cache.eviction must be one of {EVICTIONS}, got {self.eviction!r}",
        )

    @property
    def num_pages(self) -> int:
        """Usable KV pages (page 0 is reserved on top of these)."""
        return self.num_kv_tokens // self.page_size

    @property
    def has_budget(self) -> bool:
        """A byte budget is set (``memory_bytes`` or ``memory_fraction``)."""
        return bool(self.memory_bytes or self.memory_fraction)

    @property
    def max_pages(self) -> int:
        """Page ids the cache hands out at most: the largest of ``device_splits``' pages."""
        return max([self.num_pages] + [p for p, _ in self.device_splits])

    @property
    def max_slots(self) -> int:
        """Slot ids the cache hands out at most: the largest of ``device_splits``' slots."""
        return max([self.num_mamba_slots] + [s for _, s in self.device_splits])

    @property
    def num_kv_tokens_set(self) -> bool:
        return self.num_kv_tokens > 0

    @property
    def num_mamba_slots_set(self) -> bool:
        return self.num_mamba_slots > 0


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching: how many requests run at once and how prefill is chunked.

    ``overlap``: step N+1 is scheduled and dispatched before step N's sampled tokens are read
    (they reach step N+1 on the device); ``False`` reads each step's tokens before the next.

    ``decode_steps`` (K >= 1): a step whose rows all decode, with nothing waiting that could be
    admitted, runs K decode iterations in one dispatch and the host reads K tokens per row
    (``engine/multi_step.py``: stops frozen on the device; outputs those of K = 1). 1: one
    token per step.
    """

    max_running_requests: int = 16
    chunked_prefill_size: int = 256
    check_integrity_every_step: bool = False
    overlap: bool = True
    decode_steps: int = 1

    def __post_init__(self):
        _positive("scheduler.max_running_requests", self.max_running_requests)
        _positive("scheduler.chunked_prefill_size", self.chunked_prefill_size)
        _require(type(self.decode_steps) is int and 1 <= self.decode_steps <= MAX_DECODE_STEPS,
                 f"scheduler.decode_steps must be an int in [1, {MAX_DECODE_STEPS}], got "
                 f"{self.decode_steps!r}")
        _require(isinstance(self.overlap, bool),
                 f"scheduler.overlap must be a bool, got {self.overlap!r}")


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """Device mesh: ``tensor_parallel`` devices share heads, channels and experts."""

    tensor_parallel: int = 1

    def __post_init__(self):
        _positive("parallel.tensor_parallel", self.tensor_parallel)


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (``mambacache/engine/speculative.py``): ``method`` ``"none"`` (the
    default; changes nothing), ``"ngram"`` (prompt lookup) or ``"mtp"``; ``num_draft_tokens``
    (k) drafts verified per step; ``ngram_min`` / ``ngram_max``: suffix lengths prompt lookup
    tries, longest first. Verify steps write the state after each of the k + 1 positions to
    scratch slots outside the cache's (``max_running_requests * (k + 1)`` of them).
    ``adaptive``: a request's next verify proposes at most ``a + 1`` drafts after one that
    accepted ``a`` (k at most), so drafts that keep missing cost one extra token, not k.
    ``topk`` (1..``MAX_DRAFT_BRANCHES``): branches of a draft tree, each with its own first
    draft token and at most k drafts (its depth); 1 is the chain. A tree verifies up to
    ``topk * (k + 1)`` tokens per request per step, one row per branch, and needs
    ``cache.page_size`` 1 (``EngineConfig`` checks)."""

    method: str = "none"
    num_draft_tokens: int = 4
    ngram_min: int = 1
    ngram_max: int = 3
    adaptive: bool = True
    topk: int = 1

    def __post_init__(self):
        _require(self.method in SPEC_METHODS,
                 f"speculative.method must be one of {SPEC_METHODS}, got {self.method!r}")
        _positive("speculative.num_draft_tokens", self.num_draft_tokens)
        _require(self.num_draft_tokens <= MAX_DRAFT_TOKENS,
                 f"speculative.num_draft_tokens ({self.num_draft_tokens}) exceeds "
                 f"{MAX_DRAFT_TOKENS}")
        _positive("speculative.ngram_min", self.ngram_min)
        _positive("speculative.ngram_max", self.ngram_max)
        _require(isinstance(self.adaptive, bool),
                 f"speculative.adaptive must be a bool, got {self.adaptive!r}")
        _require(self.ngram_min <= self.ngram_max,
                 f"speculative.ngram_min ({self.ngram_min}) exceeds speculative.ngram_max "
                 f"({self.ngram_max})")
        _positive("speculative.topk", self.topk)
        _require(self.topk <= MAX_DRAFT_BRANCHES,
                 f"speculative.topk ({self.topk}) exceeds {MAX_DRAFT_BRANCHES}")

    @property
    def enabled(self) -> bool:
        return self.method != "none"


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """The HTTP server (``python -m mambacache.serve``); the engine itself ignores this section.

    ``max_waiting``: requests accepted beyond ``scheduler.max_running_requests``; more are refused
    with HTTP 503 and ``Retry-After: retry_after_s``. ``tokenizer``: ``"auto"`` (``model.path``'s
    tokenizer.json; the built-in byte-level one for a preset), ``"byte"``, or a directory.
    ``model_name``: ``""`` = the model directory's or the preset's name. ``default_max_tokens``:
    for requests that give none. ``warmup``: compile the step programs of the configuration
    (``Engine.warmup``, sequences up to ``warmup_max_seq_len`` tokens, 0 = the model's context)
    before ``/health`` says ok.
    ``api_key``: ``""`` = none; else the bearer key(s), comma-separated, every route but
    ``/health`` needs (401 without). ``isolate_cache_by_key``: each bearer key's requests match
    only prefixes sent with the same key (``cache_salt`` per request splits further).
    """

    host: str = "127.0.0.1"
    port: int = 8000
    model_name: str = ""
    tokenizer: str = "auto"
    max_waiting: int = 1024
    retry_after_s: int = 1
    default_max_tokens: int = 16
    warmup: bool = True
    warmup_max_seq_len: int = 0
    api_key: str = ""
    isolate_cache_by_key: bool = False

    def __post_init__(self):
        for name in ("host", "model_name", "tokenizer", "api_key"):
            value = getattr(self, name)
            _require(isinstance(value, str), f"serve.{name} must be a string, got {value!r}")
        _require(isinstance(self.port, int) and 0 < self.port < 65536,
                 f"serve.port must be in [1, 65535], got {self.port!r}")
        for name in ("max_waiting", "retry_after_s", "warmup_max_seq_len"):
            value = getattr(self, name)
            _require(isinstance(value, int) and not isinstance(value, bool) and value >= 0,
                     f"serve.{name} must be an int >= 0, got {value!r}")
        _positive("serve.default_max_tokens", self.default_max_tokens)
        for name in ("warmup", "isolate_cache_by_key"):
            value = getattr(self, name)
            _require(isinstance(value, bool), f"serve.{name} must be a bool, got {value!r}")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Everything an ``Engine`` needs. The defaults are the embedded tiny model."""

    model: ModelSection = dataclasses.field(default_factory=ModelSection)
    cache: CacheConfig = dataclasses.field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = dataclasses.field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    serve: ServeConfig = dataclasses.field(default_factory=ServeConfig)
    speculative: SpeculativeConfig = dataclasses.field(default_factory=SpeculativeConfig)

    def __post_init__(self):
        spec = self.speculative
        # a tree's accepted branch hands its pages to the request token by token (SGLang has
        # the same limit for top-k > 1 on hybrids)
        _require(not spec.enabled or spec.topk == 1 or self.cache.page_size == 1,
                 f"speculative.topk ({spec.topk}) > 1 needs cache.page_size 1, got "
                 f"{self.cache.page_size}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EngineConfig:
        """Build from nested sections; unknown sections or keys are a ``ValueError``."""
        return build_sections(cls, data)

    @classmethod
    def load(
        cls, path: str | Path | None = None, overrides: Mapping[str, Any] | None = None
    ) -> EngineConfig:
        """Load a TOML file (or the defaults when ``path`` is None), then apply dotted overrides.

        Sections of the file that belong to other entry points (e.g. ``[workload]``) are ignored.
        """
        data = read_toml(path) if path is not None else {}
        names = {f.name for f in dataclasses.fields(cls)}
        data = {k: v for k, v in data.items() if k in names}
        return cls.from_dict(apply_overrides(data, overrides or {}))

    def replace(self, **overrides: Any) -> EngineConfig:
        """A copy with dotted-key overrides, e.g. ``cfg.replace(**{"cache.enable": False})``."""
        return EngineConfig.from_dict(apply_overrides(dataclasses.asdict(self), overrides))


def read_toml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"config file {str(path)!r} does not exist")
    with path.open("rb") as f:
        return tomllib.load(f)


def build_sections(cls: type, data: Mapping[str, Any]) -> Any:
    """Instantiate dataclass ``cls`` from a nested mapping, sub-dataclasses included."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(
            f"unknown config key(s) {unknown} for {cls.__name__}; known: {sorted(fields)}")
    kwargs = {}
    for name, value in data.items():
        sub = fields[name].default_factory  # type: ignore[misc]
        if dataclasses.is_dataclass(sub):
            if not isinstance(value, Mapping):
                raise ValueError(f"config section {name!r} must be a table, got {value!r}")
            value = build_sections(sub, value)
        kwargs[name] = value
    return cls(**kwargs)


def apply_overrides(data: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Return a deep copy of ``data`` with ``{"section.key": value}`` overrides applied."""
    out = {k: dict(v) if isinstance(v, Mapping) else v for k, v in data.items()}
    for dotted, value in overrides.items():
        section, _, key = dotted.partition(".")
        if not key:
            raise ValueError(f"override {dotted!r} must be 'section.key'")
        out.setdefault(section, {})
        if not isinstance(out[section], dict):
            raise ValueError(f"override {dotted!r}: {section!r} is not a section")
        out[section][key] = value
    return out


def parse_set_args(items: list[str]) -> dict[str, Any]:
    """Parse ``--set section.key=value`` strings; values are TOML literals, else plain strings."""
    overrides: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set expects section.key=value, got {item!r}")
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw
        overrides[key.strip()] = value
    return overrides
