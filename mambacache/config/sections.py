"""Engine configuration: composed frozen dataclasses, loaded from TOML with dotted-key overrides.

Each TOML section maps one-to-one onto a dataclass below (``[model]`` -> ``ModelSection``, ...).
``[cache]`` -> ``CacheConfig`` lives in ``config/cache.py``. Every dataclass validates itself in
``__post_init__``; TOML is parsed only at entry points (``EngineConfig.load``), never below them.
"""

from __future__ import annotations

import copy
import dataclasses
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mambacache.config.cache import CacheConfig
from mambacache.config.checks import positive as _positive
from mambacache.config.checks import require as _require

DTYPES = ("float32", "bfloat16")
KERNELS = ("auto", "pallas", "reference")
SPEC_METHODS = ("none", "ngram", "mtp")
MAX_DRAFT_TOKENS = 16
#: most branches of a speculative draft tree (``speculative.topk``)
MAX_DRAFT_BRANCHES = 8
#: the most decode iterations one dispatch runs (``scheduler.decode_steps``)
MAX_DECODE_STEPS = 64
#: the most threads the warm-up compiles in (``compile.threads``)
MAX_COMPILE_THREADS = 64


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
    step then computes at least ``DETERMINISTIC_MIN_ROWS`` rows; its cost:
    ``docs/benchmarks.md``. With the Pallas kernels (``"pallas"``, or ``"auto"`` on GPU /
    TPU) prefills run on a chunk grid (``engine.prefill_grid``: hits at grid multiples, no
    speculative decoding, a chunked prefill of at least the grid).

    ``context_length`` (SGLang's ``--context-length``, vLLM's ``--max-model-len``; 0 = the
    model's ``max_position_embeddings``): the longest request (prompt + ``max_new_tokens``) the
    engine takes (longer: a ``ValueError`` / HTTP 400 naming both numbers), the longest sequence
    the warm-up compiles for and the one request the cache budget must hold
    (``python -m mambacache.plan``). At most the model's own.
    """

    path: str | None = None
    preset: str = "tiny_qwen3_next"
    seed: int = 0
    dtype: str = "float32"
    kernels: str = "auto"
    init_branch_scale: float = 1.0
    deterministic: bool = False
    context_length: int = 0

    def __post_init__(self):
        _require(type(self.context_length) is int and self.context_length >= 0,
                 f"model.context_length must be an int >= 0, got {self.context_length!r}")
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

    def capped(self, model_cfg: Any) -> Any:
        """``model_cfg`` (any dataclass or object with ``max_position_embeddings``) with its
        context capped at ``context_length``; itself when 0 or equal. ``ValueError`` when the
        cap exceeds the model's context."""
        context = int(model_cfg.max_position_embeddings)
        if not self.context_length or self.context_length == context:
            return model_cfg
        _require(self.context_length <= context,
                 f"model.context_length ({self.context_length}) exceeds the model's context "
                 f"length {context} (max_position_embeddings)")
        if dataclasses.is_dataclass(model_cfg):
            return dataclasses.replace(model_cfg, max_position_embeddings=self.context_length)
        capped = copy.copy(model_cfg)  # the shadow runner's plain config object
        capped.max_position_embeddings = self.context_length
        return capped


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching: how many requests run at once and how prefill is chunked.

    ``overlap``: step N+1 is scheduled and dispatched before step N's sampled tokens are read
    (they reach step N+1 on the device); ``False`` reads each step's tokens before the next.

    ``decode_steps`` (K >= 1): a step whose rows all decode, with nothing waiting that could be
    admitted, runs K decode iterations in one dispatch and the host reads K tokens per row
    (``engine/runners/multi_step.py``: stops frozen on the device; outputs those of K = 1). 1: one
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
    """Speculative decoding (``mambacache/engine/speculative/verify.py``): ``method`` ``"none"``
    (the default; changes nothing), ``"ngram"`` (prompt lookup) or ``"mtp"``; ``num_draft_tokens``
    (k) drafts verified per step; ``ngram_min`` / ``ngram_max``: suffix lengths prompt lookup
    tries, longest first. Verify steps write the state after each of the k + 1 positions to
    scratch slots outside the cache's (``max_running_requests * (k + 1)`` of them).
    ``adaptive``: a request's next verify proposes at most ``a + 1`` drafts after one that
    accepted ``a`` (k at most), so drafts that keep missing cost one extra token, not k.
    ``topk`` (1..``MAX_DRAFT_BRANCHES``): branches of a draft tree, each with its own first
    draft token and at most k drafts (its depth); 1 is the chain. A tree verifies up to
    ``topk * (k + 1)`` tokens per request per step, one row per branch (any
    ``cache.page_size``: a branch's first page gets a copy of the tokens before it)."""

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
    before ``/health`` says ok; ``warmup_logit_controls``: their penalty / grammar variants too
    (one more program per single-step shape; off, the first such request compiles them).
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
    warmup_logit_controls: bool = False
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
        for name in ("warmup", "warmup_logit_controls", "isolate_cache_by_key"):
            value = getattr(self, name)
            _require(isinstance(value, bool), f"serve.{name} must be a bool, got {value!r}")


@dataclasses.dataclass(frozen=True)
class CompileConfig:
    """How the step programs compile (``engine/runners/warmup.py``,
    ``engine/runners/compile_cache.py``).

    ``cache_dir``: JAX's persistent compile cache, on by default: ``"auto"`` (the user's cache
    directory, ``$XDG_CACHE_HOME/mambacache/jax`` or ``~/.cache/mambacache/jax``, unless
    ``$MAMBACACHE_COMPILE_CACHE_DIR`` names another; empty there: off), a directory, or ``""``
    / ``"off"``. ``ahead_of_time``: the warm-up lowers every program from abstract shapes and
    compiles them in ``threads`` threads (0: the CPU count, at most ``MAX_COMPILE_THREADS``),
    then runs each once; ``False``: it runs each program in turn (compiling on the way).
    ``while_loading``: those ahead-of-time compiles start before the weights load
    (``engine/runners/loading_compiles.py``): ``"auto"`` when the caller warms up next
    (``Engine(..., warmup_max_seq_len=N)``: the server, ``scripts/bench_warmup.py``), ``"on"``
    always, ``"off"``. ``separate_sampler``: a plain step (no speculative decoding, one decode
    iteration) runs its sampler as its own program, compiled once per logits-row count instead
    of inside every step program (``engine/runners/sampler_program.py``): ``"auto"`` on TPU
    only, ``"on"``, ``"off"``."""

    cache_dir: str = "auto"
    ahead_of_time: bool = True
    threads: int = 0
    while_loading: str = "auto"
    separate_sampler: str = "auto"

    def __post_init__(self):
        _require(isinstance(self.cache_dir, str),
                 f"compile.cache_dir must be a string, got {self.cache_dir!r}")
        _require(isinstance(self.ahead_of_time, bool),
                 f"compile.ahead_of_time must be a bool, got {self.ahead_of_time!r}")
        _require(type(self.threads) is int and 0 <= self.threads <= MAX_COMPILE_THREADS,
                 f"compile.threads must be an int in [0, {MAX_COMPILE_THREADS}], got "
                 f"{self.threads!r}")
        _require(self.while_loading in ("auto", "on", "off"),
                 f"compile.while_loading must be 'auto', 'on' or 'off', got "
                 f"{self.while_loading!r}")
        _require(self.separate_sampler in ("auto", "on", "off"),
                 f"compile.separate_sampler must be 'auto', 'on' or 'off', got "
                 f"{self.separate_sampler!r}")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Everything an ``Engine`` needs. The defaults are the embedded tiny model."""

    model: ModelSection = dataclasses.field(default_factory=ModelSection)
    cache: CacheConfig = dataclasses.field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = dataclasses.field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    serve: ServeConfig = dataclasses.field(default_factory=ServeConfig)
    compile: CompileConfig = dataclasses.field(default_factory=CompileConfig)
    speculative: SpeculativeConfig = dataclasses.field(default_factory=SpeculativeConfig)

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
        """A copy with dotted-key overrides, e.g. ``cfg.replace(**{"cache.enable": False})``
        (pool sizes left to their defaults stay so: ``CacheConfig.given``)."""
        data = dataclasses.asdict(self) | {"cache": self.cache.given()}
        return EngineConfig.from_dict(apply_overrides(data, overrides))


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
