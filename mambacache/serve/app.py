"""The FastAPI application: ``/v1/completions``, ``/v1/chat/completions`` (streamed as server-sent
events or not), ``/v1/models``, ``/health`` and ``/metrics``.

Handlers run on the event loop and never touch the engine: they validate (``protocol``), turn
text into ids (``tokenizer``), submit to the ``EngineLoop`` and turn its deltas into OpenAI
bodies (``generation``, ``responses``). Every error is OpenAI-shaped; a bad request holds nothing.
"""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from mambacache.engine.sampling.params import SamplingParams
from mambacache.serve import choices, sglang_api, structured, tool_calls
from mambacache.serve.auth import Auth
from mambacache.serve.engine_loop import EngineLoop
from mambacache.serve.generation import ClientGone, Generation
from mambacache.serve.lenient import note_ignored
from mambacache.serve.metrics import ServerMetrics
from mambacache.serve.protocol import (
    SEED_LIMIT,
    ApiError,
    ChatRequest,
    CompletionRequest,
    parse_request,
    single_prompt,
)
from mambacache.serve.responses import ResponseShape, chat_logprobs, completion_logprobs, sse
from mambacache.serve.scored_logprobs import scored_response, scoring_request
from mambacache.serve.scored_logprobs import stream_chunks as scored_stream_chunks
from mambacache.serve.tokenizer import encode_chat

if TYPE_CHECKING:
    from mambacache.config import ServeConfig
    from mambacache.engine.engine import Engine
    from mambacache.serve.tokenizer import Tokenizer

CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that went away before the answer


def http_names(text: str) -> str:
    """An engine message in the API's words (``max_new_tokens`` is ``max_tokens`` here)."""
    return text.replace("max_new_tokens", "max_tokens")


class Server:
    """What the routes share: the engine loop, the tokenizer, the ``[serve]`` section."""

    def __init__(self, engine: Engine | Callable[[], Engine], tokenizer: Tokenizer,
                 serve_cfg: ServeConfig, *, model_name: str, max_running: int | None = None):
        self.cfg = serve_cfg
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.metrics = ServerMetrics()
        self.auth = Auth(serve_cfg.api_key, serve_cfg.isolate_cache_by_key)
        self.loop = EngineLoop(engine, max_waiting=self.cfg.max_waiting, observer=self.metrics,
                               warmup=self.cfg.warmup,
                               warmup_max_seq_len=self.cfg.warmup_max_seq_len or None,
                               warmup_logit_controls=self.cfg.warmup_logit_controls,
                               max_running=max_running)

    @property
    def engine(self) -> Engine:
        """The engine; while it is being built (the weights loading) an HTTP 503 naming the
        start's stage."""
        engine = self.loop.engine
        if engine is None:
            raise ApiError(f"the server is starting ({self.loop.stage}); retry later",
                           status=503, type="server_error", code="server_starting",
                           headers={"Retry-After": "5"})
        return engine

    def piece(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def sampling(self, req: CompletionRequest | ChatRequest, chat: bool) -> SamplingParams:
        tok = self.tokenizer
        max_tokens = getattr(req, "max_completion_tokens", None) or req.max_tokens
        vocab = self.engine.model_cfg.vocab_size
        bad = [t for t in req.stop_token_ids or () if t >= vocab]
        if bad:
            raise ApiError(f"stop_token_ids: {bad[0]} outside the vocabulary [0, {vocab})",
                           param="stop_token_ids")
        stop_ids = set(req.stop_token_ids or ())
        if not req.ignore_eos:
            stop_ids |= set(tok.eos_token_ids) | set(tok.chat_stop_token_ids if chat else ())
        try:
            return SamplingParams(
                max_new_tokens=max_tokens or self.cfg.default_max_tokens,
                temperature=float(req.temperature), top_k=max(req.top_k, 0), top_p=req.top_p,
                seed=req.seed if req.seed is not None else secrets.randbelow(SEED_LIMIT),
                stop_token_ids=tuple(sorted(stop_ids)), ignore_eos=req.ignore_eos,
                presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                repetition_penalty=req.repetition_penalty,
                constraint=structured.for_openai(self, req, chat),
                host_stops=bool(req.stop_strings()))
        except ValueError as err:  # the protocol's bounds are the engine's: not expected
            field = str(err).split(" ", 1)[0]
            raise ApiError(http_names(str(err)), param=http_names(field)) from None

    def prompt_ids(self, req: CompletionRequest | ChatRequest) -> list[int]:
        if isinstance(req, CompletionRequest):
            prompt = single_prompt(req.prompt)
            return self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        messages = [{"role": m.role, "content": m.text()} | ({"name": m.name} if m.name else {})
                    | tool_calls.message_extras(m) for m in req.messages]
        try:
            return encode_chat(self.tokenizer, messages, tools=tool_calls.request_tools(req))
        except Exception as err:  # noqa: BLE001 - a template that refuses the messages
            raise ApiError(f"messages: {err}", param="messages") from None

    async def generate(self, http: Request, chat: bool) -> Response:
        req = parse_request(await http.body(), ChatRequest if chat else CompletionRequest)
        ignored = note_ignored(req)  # unknown fields: logged once per name, listed in a header
        # top logprobs / echo: scored_logprobs.py
        top_n, echo = scoring_request(req, chat, multi=choices.is_multi(req))
        if req.model is not None and req.model != self.model_name:
            raise ApiError(f"model {req.model!r} does not exist; this server serves "
                           f"{self.model_name!r}", param="model", status=404,
                           code="model_not_found")
        if choices.is_multi(req):  # n > 1 or several prompts: choices.py
            return await choices.generate(self, http, req, chat, ignored, top_n, echo)
        params = self.sampling(req, chat)
        prompt_ids = self.prompt_ids(req)
        namespace = self.auth.cache_namespace(http.headers.get("authorization"), req.cache_salt)
        stream = await sglang_api.submit(self, prompt_ids, params,
                                         "messages" if chat else "prompt", namespace)
        shape = ResponseShape(chat=chat, model=self.model_name,
                              return_token_ids=req.return_token_ids)
        gen = Generation(self.loop, stream, self.tokenizer, stops=req.stop_strings(),
                         prompt_ids=prompt_ids,
                         is_disconnected=None if req.stream else http.is_disconnected)
        want_lp = bool(req.logprobs) if chat else req.logprobs is not None
        if top_n or echo:
            body = await scored_response(self, gen, shape, chat, top_n, echo)
            if not req.stream:
                return JSONResponse(body, headers=ignored)
            return self._replay(scored_stream_chunks(body, shape, chat), shape, body, req,
                                ignored)
        if chat and tool_calls.request_tools(req):  # calls out of the whole text
            body = tool_calls.apply(await self._collect(gen, shape, chat, want_lp))
            if not req.stream:
                return JSONResponse(body, headers=ignored)
            return self._replay(tool_calls.stream_chunks(body, shape), shape, body, req, ignored)
        if req.stream:
            return StreamingResponse(self._events(gen, shape, chat, want_lp, req.include_usage()),
                                     media_type="text/event-stream", headers=ignored)
        try:
            return JSONResponse(await self._collect(gen, shape, chat, want_lp), headers=ignored)
        except ClientGone:  # nobody reads the answer; the request was aborted
            return Response(status_code=CLIENT_CLOSED_REQUEST)

    @staticmethod
    def _replay(chunks: Any, shape: ResponseShape, body: dict[str, Any], req: Any,
                headers: dict[str, str]) -> StreamingResponse:
        """A finished answer's ``chunks`` as a stream (usage chunk if asked, ``[DONE]``)."""
        events = [sse(c) for c in chunks]
        if req.include_usage():
            events.append(sse(shape.usage_chunk(body["usage"])))
        return StreamingResponse(iter(events + [sse("[DONE]")]),
                                 media_type="text/event-stream", headers=headers)

    def _logprobs(self, chat: bool, ids: list[int], lps: list[float], offset: int):
        if chat:
            return chat_logprobs(ids, lps, self.piece)
        return completion_logprobs(ids, lps, self.piece, offset)

    async def _collect(self, gen: Generation, shape: ResponseShape, chat: bool, want_lp: bool):
        text, ids, lps, reason = "", [], [], None
        async for p in gen.pieces():
            text, ids, lps, reason = text + p.text, ids + p.ids, lps + p.logprobs, p.finish_reason
        return shape.full(text=text, ids=ids, finish_reason=reason, usage_=gen.usage(),
                          prompt_ids=gen.prompt_ids,
                          logprobs=self._logprobs(chat, ids, lps, 0) if want_lp else None)

    async def _events(self, gen: Generation, shape: ResponseShape, chat: bool, want_lp: bool,
                      include_usage: bool):
        if chat:
            yield sse(shape.chunk(role=True))
        offset = 0
        ids_matter = shape.return_token_ids or want_lp  # else a chunk without text says nothing
        try:
            async for p in gen.pieces():
                if not (p.text or p.finish_reason or (ids_matter and p.ids)):
                    continue
                lp = self._logprobs(chat, p.ids, p.logprobs, offset) if want_lp else None
                offset += len(p.text)
                yield sse(shape.chunk(text=p.text, ids=p.ids, logprobs=lp,
                                      finish_reason=p.finish_reason))
        except ApiError as err:
            yield sse(err.body())
        if include_usage:
            yield sse(shape.usage_chunk(gen.usage()))
        yield sse("[DONE]")


def create_app(engine: Engine | Callable[[], Engine], tokenizer: Tokenizer,
               serve_cfg: ServeConfig, *, model_name: str,
               max_running: int | None = None) -> FastAPI:
    """The app over ``engine`` (``serve_cfg``: the ``[serve]`` section); its lifespan starts the
    engine thread (warm-up first) and stops it. ``engine`` may be a function that builds it
    (``max_running``: its ``scheduler.max_running_requests``): the engine thread calls it
    first, and ``/health`` answers 503 with the stage while the weights load."""
    server = Server(engine, tokenizer, serve_cfg, model_name=model_name,
                    max_running=max_running)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        server.loop.start()
        yield
        server.loop.stop()

    async def authorize(http: Request) -> None:
        if http.url.path != "/health":  # a load balancer's probe needs no key
            server.auth.authorize(http.headers.get("authorization"))

    app = FastAPI(title="mambacache", lifespan=lifespan, dependencies=[Depends(authorize)])
    app.state.server = server
    sglang_api.install(app, server)  # SGLang's /generate, /server_info, ...; HEAD on GETs

    @app.exception_handler(ApiError)
    async def api_error(_: Request, err: ApiError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.post("/v1/completions")
    async def completions(http: Request) -> Response:
        return await server.generate(http, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: Request) -> Response:
        return await server.generate(http, chat=True)

    created = int(time.time())

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        cfg = server.engine.model_cfg
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": created, "owned_by": "mambacache",
            "max_model_len": cfg.max_position_embeddings, "vocab_size": cfg.vocab_size}]}

    @app.get("/health")
    async def health() -> Response:
        if not server.loop.ready.is_set():  # the stage: "compiled 7 of 30 programs (...)"
            return JSONResponse({"status": "loading", "stage": server.loop.stage},
                                status_code=503)
        if server.loop.warmup_error is not None:
            return JSONResponse({"status": "error", "error": server.loop.warmup_error},
                                status_code=500)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        snapshot = await server.loop.metrics()  # never waits behind a step
        return Response(server.metrics.render(snapshot), media_type=CONTENT_TYPE_LATEST)

    return app
