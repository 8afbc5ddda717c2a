"""SGLang's native HTTP surface, for its router, gateway and tools: ``POST /generate``,
``GET /server_info`` / ``/model_info`` (and the ``get_`` aliases), ``/get_load``,
``/health_generate``, ``/version``, ``/v1/models/{id}``, and ``HEAD`` on every ``GET`` route.

``/generate`` takes ``text`` or ``input_ids`` (one prompt, or a batch: a list gives a list),
``sampling_params`` in SGLang's names (``max_new_tokens`` default 128, ``top_k`` -1 = no limit,
``stop``, ``stop_token_ids``, ``ignore_eos``, ``sampling_seed``, ``n`` (a list of n answers;
the prompt computed once), the three penalties, ``json_schema`` / ``regex``), ``stream`` and
``return_logprob``. Its answer is SGLang's: ``text``, ``output_ids`` and ``meta_info``
(``id``, ``prompt_tokens``, ``cached_tokens``, ``completion_tokens``, ``finish_reason`` as
``{"type": "length", "length": n}`` / ``{"type": "stop", "matched": ...}`` / ``{"type":
"abort"}``, ``e2e_latency``, ``output_token_logprobs`` as ``[logprob, id, None]``). Streamed,
each event carries the text and ids *so far* (SGLang's default; its ``bench_serving`` counts
tokens from ``completion_tokens``), then ``[DONE]``.

Requests go through the same ``EngineLoop`` and ``Generation`` as the OpenAI routes, with the
same bounds (``protocol``) and the same lenient handling of unknown fields (``lenient``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
import time
from collections.abc import AsyncIterator
from importlib import metadata
from typing import Annotated, Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BeforeValidator, Field

from mambacache.engine.sampling.params import (
    MAX_STOP_TOKEN_IDS,
    PENALTY_LIMIT,
    REPETITION_PENALTY_LIMIT,
    SEED_LIMIT,
    TEMPERATURE_LIMIT,
    TOP_K_LIMIT,
    SamplingParams,
)
from mambacache.serve import structured
from mambacache.serve.engine_loop import Overloaded
from mambacache.serve.generation import Generation
from mambacache.serve.lenient import note_ignored
from mambacache.serve.protocol import (
    N_LIMIT,
    ApiError,
    MaxTokens,
    SamplingFields,
    StrictModel,
    TokenId,
    parse_request,
)
from mambacache.serve.responses import sse

SGLANG_DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default when sampling_params has none


def version() -> str:
    try:
        return metadata.version("mambacache")
    except metadata.PackageNotFoundError:
        return "0+unknown"


class SglSampling(StrictModel):
    """``sampling_params`` of ``/generate`` (SGLang's names; unknown keys ignored)."""

    max_new_tokens: MaxTokens = SGLANG_DEFAULT_MAX_NEW_TOKENS
    temperature: float = Field(default=1.0, ge=0.0, le=TEMPERATURE_LIMIT)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1, le=TOP_K_LIMIT)
    stop: Annotated[str | list[str] | None,
                    BeforeValidator(SamplingFields.at_most_max_stop_strings)] = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    ignore_eos: bool = False
    n: int = Field(default=1, ge=1, le=N_LIMIT)
    sampling_seed: int | None = Field(default=None, ge=0, lt=SEED_LIMIT)
    presence_penalty: float = Field(default=0.0, ge=-PENALTY_LIMIT, le=PENALTY_LIMIT)
    frequency_penalty: float = Field(default=0.0, ge=-PENALTY_LIMIT, le=PENALTY_LIMIT)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=REPETITION_PENALTY_LIMIT)
    json_schema: str | None = None  # structured.py
    regex: str | None = None

    stop_strings = SamplingFields.stop_strings  # the OpenAI routes' reading of ``stop``


class GenerateRequest(StrictModel):
    """``POST /generate``: ``text`` or ``input_ids``, one prompt or a batch."""

    text: str | list[str] | None = None
    input_ids: list[TokenId] | list[list[TokenId]] | None = None
    sampling_params: SglSampling = Field(default_factory=SglSampling)
    stream: bool = False
    return_logprob: bool = False
    rid: str | None = None
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)

    def prompts(self, tokenizer: Any) -> tuple[list[list[int]], bool]:
        """Token ids of each prompt, and whether the request was a batch."""
        if (self.text is None) == (self.input_ids is None):
            raise ApiError("exactly one of text and input_ids must be given", param="text")
        if self.text is not None:
            batch = isinstance(self.text, list)
            texts = self.text if batch else [self.text]
            prompts = [tokenizer.encode(t) for t in texts]
        else:
            batch = bool(self.input_ids) and isinstance(self.input_ids[0], list)
            prompts = [list(p) for p in self.input_ids] if batch else [list(self.input_ids)]
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ApiError("prompt: must not be empty", param="input_ids"
                           if self.text is None else "text")
        return prompts, batch


def sampling_params(server: Any, sp: SglSampling) -> SamplingParams:
    """The engine's ``SamplingParams`` (stop ids: the request's plus EOS unless ``ignore_eos``)."""
    vocab = server.engine.model_cfg.vocab_size
    bad = [t for t in sp.stop_token_ids or () if t >= vocab]
    if bad:
        raise ApiError(f"sampling_params.stop_token_ids: {bad[0]} outside the vocabulary "
                       f"[0, {vocab})", param="sampling_params.stop_token_ids")
    stop_ids = set(sp.stop_token_ids or ())
    if not sp.ignore_eos:
        stop_ids |= set(server.tokenizer.eos_token_ids)
    seed = sp.sampling_seed if sp.sampling_seed is not None else secrets.randbelow(SEED_LIMIT)
    return SamplingParams(max_new_tokens=sp.max_new_tokens, temperature=sp.temperature,
                          top_k=max(sp.top_k, 0), top_p=sp.top_p, seed=seed,
                          stop_token_ids=tuple(sorted(stop_ids)), ignore_eos=sp.ignore_eos,
                          presence_penalty=sp.presence_penalty,
                          frequency_penalty=sp.frequency_penalty,
                          repetition_penalty=sp.repetition_penalty,
                          constraint=structured.for_sglang(server, sp),
                          host_stops=bool(sp.stop_strings()))


async def submit(server: Any, prompt: list[int], params: SamplingParams, param: str,
                 namespace: str | None = None) -> Any:
    """Queue one prompt on the engine loop (``namespace``: its cache namespace, the tenant /
    ``cache_salt`` key): 503 when full, 400 naming ``param`` when refused."""
    try:
        return await server.loop.submit(prompt, params, namespace)
    except Overloaded as err:
        server.metrics.rejected.labels("overloaded").inc()
        raise ApiError(f"{err}; retry after {server.cfg.retry_after_s} s", status=503,
                       type="server_overloaded",
                       headers={"Retry-After": str(server.cfg.retry_after_s)}) from None
    except ValueError as err:
        server.metrics.rejected.labels("invalid").inc()
        raise ApiError(f"{param}: {str(err).replace('max_new_tokens', 'max_tokens')}",
                       param=param) from None


class SglResult:
    """One prompt's answer in SGLang's shape, accumulated from ``Generation`` pieces."""

    def __init__(self, gen: Generation, rid: str, return_logprob: bool):
        self.gen, self.rid, self.return_logprob = gen, rid, return_logprob
        self.text, self.ids, self.logprobs = "", [], []
        self.reason: str | None = None
        self.start_s = time.perf_counter()

    def add(self, piece: Any) -> None:
        self.text += piece.text
        self.ids += piece.ids
        self.logprobs += piece.logprobs
        self.reason = piece.finish_reason

    def finish_reason(self) -> dict[str, Any] | None:
        if self.reason is None:
            return None
        if self.reason == "length":
            return {"type": "length", "length": len(self.ids)}
        if self.reason == "stop":
            stopped = self.gen.stops.stopped
            return {"type": "stop", "matched": stopped if stopped is not None
                    else (self.ids[-1] if self.ids else None)}
        return {"type": self.reason}

    def body(self) -> dict[str, Any]:
        usage = self.gen.usage()
        meta: dict[str, Any] = {
            "id": self.rid, "finish_reason": self.finish_reason(),
            "prompt_tokens": usage["prompt_tokens"],
            "completion_tokens": usage["completion_tokens"],
            "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
            "e2e_latency": time.perf_counter() - self.start_s}
        if self.return_logprob:
            meta["output_token_logprobs"] = [[lp, t, None]
                                             for lp, t in zip(self.logprobs, self.ids,
                                                              strict=True)]
        return {"text": self.text, "output_ids": list(self.ids), "meta_info": meta}


async def _start(server: Any, http: Request, req: GenerateRequest
                 ) -> tuple[list[SglResult], bool]:
    """Submit every prompt's ``n`` samples (sample ``j``: seed + j) together, before the engine
    thread's next step, so a prompt is computed once and its samples fork from its state
    (``choices.py`` does the same for the OpenAI routes). ``n`` > 1 answers a list, as a batch
    does: prompt ``i``'s sample ``j`` at ``i * n + j``."""
    prompts, batch = req.prompts(server.tokenizer)
    params = sampling_params(server, req.sampling_params)
    n = req.sampling_params.n
    base = req.rid or secrets.token_hex(12)
    auth = getattr(server, "auth", None)  # tenants and cache_salt keep prefixes apart
    namespace = None if auth is None else auth.cache_namespace(
        http.headers.get("authorization"), req.cache_salt)
    param = "input_ids" if req.text is None else "text"
    jobs = [(prompt, dataclasses.replace(params, seed=(params.seed + j) % SEED_LIMIT))
            for prompt in prompts for j in range(n)]
    got = await asyncio.gather(*(submit(server, p, sp, param, namespace) for p, sp in jobs),
                               return_exceptions=True)
    failed = [g for g in got if isinstance(g, BaseException)]
    if failed:
        for g in got:  # nothing of a refused batch is left running
            if not isinstance(g, BaseException):
                server.loop.abort(g)
        raise failed[0]
    results = []
    for k, ((prompt, _), stream) in enumerate(zip(jobs, got, strict=True)):
        gen = Generation(server.loop, stream, server.tokenizer,
                         stops=req.sampling_params.stop_strings(), prompt_ids=prompt,
                         is_disconnected=None if req.stream else http.is_disconnected)
        rid = base if len(jobs) == 1 else f"{base}-{k}"
        results.append(SglResult(gen, rid, req.return_logprob))
    return results, batch or n > 1


async def _collect(result: SglResult) -> dict[str, Any]:
    async for piece in result.gen.pieces():
        result.add(piece)
    return result.body()


async def _events(results: list[SglResult]) -> AsyncIterator[str]:
    """Each prompt's events in turn (a batch streams one prompt after the other, ``index``)."""
    for index, result in enumerate(results):
        try:
            async for piece in result.gen.pieces():
                result.add(piece)
                if piece.text or piece.ids or piece.finish_reason:
                    yield sse(result.body() | {"index": index})
        except ApiError as err:
            yield sse(err.body())
    yield sse("[DONE]")


async def generate(server: Any, http: Request) -> Response:
    """``POST /generate``."""
    req = parse_request(await http.body(), GenerateRequest)
    headers = note_ignored(req)
    results, batch = await _start(server, http, req)
    if req.stream:
        return StreamingResponse(_events(results), media_type="text/event-stream",
                                 headers=headers)
    try:
        bodies = await asyncio.gather(*(_collect(r) for r in results))
    except BaseException:
        for r in results:  # one prompt of a batch failed: stop the others
            if not r.gen.finished:
                server.loop.abort(r.gen.stream)
        raise
    return JSONResponse(bodies if batch else bodies[0], headers=headers)


def server_info(server: Any) -> dict[str, Any]:
    """SGLang's ``/server_info`` keys that routers and tools read, from this engine's config."""
    cfg = server.engine.cfg
    return {
        "model_path": server.model_name, "served_model_name": server.model_name,
        "tokenizer_path": server.model_name, "version": version(),
        "tp_size": cfg.parallel.tensor_parallel, "dp_size": 1, "pp_size": 1,
        "page_size": cfg.cache.page_size,
        "context_length": server.engine.model_cfg.max_position_embeddings,
        "max_running_requests": cfg.scheduler.max_running_requests,
        "chunked_prefill_size": cfg.scheduler.chunked_prefill_size,
        "disable_radix_cache": not cfg.cache.enable, "disaggregation_mode": "null",
        "internal_states": [{"#running-req": server.loop.live_requests(),
                             "in_flight": server.loop.in_flight}],
        "engine": "mambacache"}


def model_info(server: Any) -> dict[str, Any]:
    return {"model_path": server.model_name, "tokenizer_path": server.model_name,
            "served_model_name": server.model_name, "is_generation": True,
            "preferred_sampling_params": None, "weight_version": "default",
            "has_image_understanding": False, "has_audio_understanding": False,
            "model_type": "mambacache", "architectures": None}


def make_router(server: Any) -> APIRouter:
    """SGLang's routes over ``server`` (``app.Server``)."""
    router = APIRouter()
    info = {"/server_info": server_info, "/get_server_info": server_info,
            "/model_info": model_info, "/get_model_info": model_info}
    for path, fn in info.items():
        router.add_api_route(path, lambda fn=fn: fn(server), methods=["GET"])

    @router.post("/generate")
    async def generate_route(http: Request) -> Response:
        return await generate(server, http)

    @router.get("/version")
    async def version_route() -> dict[str, str]:
        return {"version": version()}

    @router.get("/get_load")
    async def get_load() -> list[dict[str, int]]:
        return [{"dp_rank": 0, "num_reqs": server.loop.in_flight,
                 "num_waiting_reqs": max(0, server.loop.in_flight
                                         - server.loop.live_requests()),
                 "num_tokens": 0}]

    @router.get("/health_generate")
    async def health_generate() -> Response:
        if not server.loop.ready.is_set():
            return JSONResponse({"status": "loading"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @router.get("/v1/models/{model_id:path}")
    async def one_model(model_id: str) -> dict[str, Any]:
        if model_id != server.model_name:
            raise ApiError(f"model {model_id!r} does not exist; this server serves "
                           f"{server.model_name!r}", param="model", status=404,
                           code="model_not_found")
        cfg = server.engine.model_cfg
        return {"id": server.model_name, "object": "model", "created": server.created,
                "owned_by": "mambacache", "max_model_len": cfg.max_position_embeddings,
                "vocab_size": cfg.vocab_size}

    return router


def head_as_get(app: Any) -> Any:
    """ASGI middleware: ``HEAD`` is served as ``GET`` (the server drops the body; the headers,
    ``content-length`` included, are the ``GET``'s)."""

    async def middleware(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "HEAD":
            scope = dict(scope, method="GET")  # a copy: uvicorn keeps seeing HEAD
        await app(scope, receive, send)

    return middleware


def install(app: FastAPI, server: Any) -> None:
    """Add SGLang's routes and ``HEAD`` support to ``app`` (called by ``app.create_app``)."""
    server.created = int(time.time())
    app.include_router(make_router(server))
    app.add_middleware(_HeadAsGet)


class _HeadAsGet:
    """``head_as_get`` in the class form ``add_middleware`` takes."""

    def __init__(self, app: Any):
        self.call = head_as_get(app)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        await self.call(scope, receive, send)
