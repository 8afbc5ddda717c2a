"""The OpenAI-compatible server end to end: a real uvicorn server on a free port (one for the
module), the real ``openai`` client, streamed and not; 64 concurrent streams against
``Engine.generate``; disconnects; bad input; ``/metrics``."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time

import httpx
import numpy as np
import openai
import pytest
from engine_helpers import make_engine
from prometheus_client.parser import text_string_to_metric_families
from serve_helpers import MODEL, SERVER, running_server

import mambacache as mc

GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True, "return_token_ids": True}}


@pytest.fixture(scope="module")
def srv():
    with running_server() as handle:
        yield handle


@pytest.fixture(scope="module")
def client(srv):
    with openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0) as c:
        yield c


def reference(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy tokens from a fresh engine with the cache off."""
    engine = make_engine(**SERVER, **{"cache.enable": False})
    outs = engine.generate(prompts, mc.SamplingParams(max_new_tokens=max_tokens, temperature=0.0))
    return [o.output_token_ids for o in outs]


def test_completion_and_chat(srv, client):
    prompt = "The cache keeps state snapshots."
    ids = srv.tokenizer.encode(prompt)
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, **GREEDY)
    choice = first.choices[0]
    assert choice.token_ids == reference([ids], 6)[0]
    assert choice.text == srv.tokenizer.decode(choice.token_ids)
    assert choice.finish_reason == "length"
    assert (first.usage.prompt_tokens, first.usage.completion_tokens) == (len(ids), 6)
    again = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, **GREEDY)
    assert again.choices[0].token_ids == choice.token_ids  # token ids as the prompt
    assert again.usage.prompt_tokens_details.cached_tokens == len(ids) - 1

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, **GREEDY)
    chat_ids = srv.tokenizer.encode("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
                                    "Hi<|im_end|>\n<|im_start|>assistant\n")
    assert chat.usage.prompt_tokens == len(chat_ids)
    assert chat.choices[0].token_ids == reference([chat_ids], 5)[0]
    assert chat.choices[0].message.content == srv.tokenizer.decode(chat.choices[0].token_ids)
    assert chat.choices[0].message.role == "assistant"


def test_streamed_equals_unstreamed(srv, client):
    prompt = "Snapshots at page boundaries: é, 世界, 🙂."
    kw = dict(model=MODEL, max_tokens=12, temperature=0.0, extra_body={"ignore_eos": True})
    whole = client.completions.create(prompt=prompt, logprobs=0, **kw)
    chunks = list(client.completions.create(prompt=prompt, stream=True, logprobs=0,
                                            stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    lps = [lp for c in chunks if c.choices and c.choices[0].logprobs
           for lp in c.choices[0].logprobs.token_logprobs]
    np.testing.assert_allclose(lps, whole.choices[0].logprobs.token_logprobs, atol=1e-4)
    assert chunks[-1].usage.completion_tokens == 12 and not chunks[-1].choices

    messages = [{"role": "user", "content": prompt}]
    whole = client.chat.completions.create(messages=messages, **kw)
    chunks = list(client.chat.completions.create(messages=messages, stream=True, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == \
        whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_64_concurrent_streams_match_generate(srv):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, int(rng.integers(4, 40))).tolist() for _ in range(64)]
    max_tokens = 8

    async def one(client, prompt):
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                                 stream=True, **GREEDY)
        ids, text = [], ""
        async for chunk in stream:
            ids += chunk.choices[0].token_ids
            text += chunk.choices[0].text
        return ids, text

    async def main():
        async with openai.AsyncOpenAI(base_url=f"{srv.url}/v1", api_key="none",
                                      max_retries=0) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    results = asyncio.run(main())
    expected = reference(prompts, max_tokens)
    for (ids, text), want in zip(results, expected, strict=True):
        assert ids == want
        assert text == srv.tokenizer.decode(want)
    srv.wait_idle()
    srv.on_engine(lambda e: e.check_integrity())


def _aborts(srv) -> float:
    text = httpx.get(f"{srv.url}/metrics").text
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    return sum(s.value for s in fams["mambacache_requests"].samples
               if s.name.endswith("_total") and s.labels.get("finish_reason") == "abort")


class _Errors(logging.Handler):
    def __init__(self):
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_disconnect_frees_the_request(srv):
    body = {"model": MODEL, "prompt": "a long one", "max_tokens": 3000, "ignore_eos": True}
    aborts = _aborts(srv)
    errors = _Errors()  # a client that goes away is no server error: no ASGI traceback
    logging.getLogger("uvicorn.error").addHandler(errors)
    with httpx.Client(base_url=srv.url) as http:
        with http.stream("POST", "/v1/completions", json=body | {"stream": True}) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
        # not streamed: the client gives up waiting
        with pytest.raises(httpx.ReadTimeout):
            http.post("/v1/completions", json=body, timeout=1.0)
    srv.wait_idle()
    logging.getLogger("uvicorn.error").removeHandler(errors)
    assert [r.getMessage() for r in errors.records] == []
    srv.on_engine(lambda e: e.check_integrity())
    assert _aborts(srv) == aborts + 2
    assert srv.on_engine(lambda e: e.cache.stats()["token_usage"]) < 0.5  # the 3000 were freed


BAD = [  # (body, param, words the message must contain)
    (b"{not json", None, ["malformed JSON"]),
    (b"[1, 2]", None, ["JSON object"]),
    ({"prompt": "x", "temperature": -1}, "temperature", ["greater than or equal to 0"]),
    ({"prompt": "x", "temperature": 3}, "temperature", ["less than or equal to 2"]),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens", ["greater than or equal to 1"]),
    ({"prompt": "x", "max_tokens": "8"}, "max_tokens", ["integer"]),
    ({"prompt": "x", "top_p": 0}, "top_p", ["greater than 0"]),
    ({"prompt": "x", "n": 17}, "n", ["less than or equal to 16"]),
    ({"prompt": "x", "logprobs": 21}, "logprobs", ["less than or equal to 20"]),
    ({"prompt": "x", "seed": 2**31}, "seed", ["less than 2147483648"]),
    ({"prompt": ""}, "prompt", ["empty"]),
    ({"prompt": ["a", ""]}, "prompt", ["prompt[1]", "empty"]),
    ({"prompt": [1, 600]}, "prompt", ["600", "[0, 512)"]),
    ({"prompt": "y" * 5000}, "prompt", ["5000", "context length 4096"]),
    ({"prompt": "x", "max_tokens": 5000}, "prompt", ["max_tokens (5000)", "4096"]),
    ({"prompt": "z" * 3990, "max_tokens": 50}, "prompt", ["4040", "KV pool of 4000 tokens"]),
    # issue 24: every sampling field bounded, named by its HTTP name, no internals dumped
    ({"prompt": "x", "top_k": 2**40}, "top_k", ["less than or equal to 1048576"]),
    ({"prompt": "x", "max_tokens": 10**9}, "max_tokens", ["less than or equal to 1048576"]),
    ({"prompt": "x", "max_tokens": 1e9}, "max_tokens", ["integer"]),
    ({"prompt": "x", "temperature": "0.5"}, "temperature", ["number"]),
    ({"prompt": "x", "stop_token_ids": [3.7]}, "stop_token_ids[0]", ["integer"]),
    ({"prompt": "x", "stop_token_ids": [600]}, "stop_token_ids", ["600", "[0, 512)"]),
    ({"prompt": "x", "stop": ["s"] * 1000}, "stop", ["1000 stop strings", "limit is 16"]),
]
BAD_CHAT = [
    ({"messages": []}, "messages", ["at least 1"]),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", ["'user'"]),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", ["string"]),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 21}, "top_logprobs",
     ["less than or equal to 20"]),
]


@pytest.mark.parametrize("path, body, param, words",
                         [("completions", *b) for b in BAD] + [("chat/completions", *b)
                                                               for b in BAD_CHAT])
def test_bad_input_is_a_400(srv, path, body, param, words):
    content = body if isinstance(body, bytes) else json.dumps({"model": MODEL, **body}).encode()
    resp = httpx.post(f"{srv.url}/v1/{path}", content=content,
                      headers={"content-type": "application/json"})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    for word in words:
        assert word in err["message"], err
    assert "SamplingParams" not in err["message"] and "max_new_tokens" not in err["message"], err


def test_one_unbounded_top_k_among_six_fails_alone(srv):
    """Six requests sent together, one with top_k 2^40 (it overflowed int32 when its step was
    packed, and the failed step failed all six): five complete, that one is a 400."""
    bodies = [{"model": MODEL, "prompt": f"tenant {i}", "max_tokens": 4, "temperature": 0.7,
               "seed": i, "top_k": 2**40 if i == 3 else 5} for i in range(6)]

    async def main():
        async with httpx.AsyncClient(base_url=srv.url, timeout=120) as http:
            return await asyncio.gather(*(http.post("/v1/completions", json=b) for b in bodies))

    codes = [r.status_code for r in asyncio.run(main())]
    assert codes == [200, 200, 200, 400, 200, 200], codes
    srv.wait_idle()
    srv.on_engine(lambda e: e.check_integrity())


def test_server_goes_on_after_bad_input(srv, client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", temperature=7)
    assert info.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-9", prompt="x")
    out = client.completions.create(model=MODEL, prompt="still here", max_tokens=2, **GREEDY)
    assert len(out.choices[0].token_ids) == 2
    srv.wait_idle()
    srv.on_engine(lambda e: e.check_integrity())


def test_full_queue_is_a_503_with_retry_hint(srv):
    loop = srv.server.loop
    capacity, loop.capacity = loop.capacity, 0
    try:
        resp = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "x", "max_tokens": 1})
    finally:
        loop.capacity = capacity
    assert resp.status_code == 503
    assert resp.headers["retry-after"] == "1"
    assert "serve.max_waiting" in resp.json()["error"]["message"]
    assert loop.in_flight == 0


def test_stop_strings_cut_the_text(srv, client):
    kw = dict(model=MODEL, prompt="stop me", max_tokens=40, **GREEDY)
    full = client.completions.create(**kw).choices[0]
    stop = full.text[5:8]
    assert len(stop) == 3  # the tiny model's bytes decode to some text
    cut = client.completions.create(**kw, stop=[stop]).choices[0]
    assert cut.text == full.text[:full.text.find(stop)]
    assert cut.finish_reason == "stop"
    streamed = client.completions.create(**kw, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == cut.text
    srv.wait_idle()


def test_models_health_and_metrics(srv, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{srv.url}/health").json() == {"status": "ok"}
    client.completions.create(model=MODEL, prompt="metrics", max_tokens=3, **GREEDY)
    fams = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{srv.url}/metrics")
                                                             .text)}
    for name in ("mambacache_cache_hit_rate", "mambacache_cached_prompt_tokens",
                 "mambacache_computed_prefill_tokens", "mambacache_kv_pool_usage",
                 "mambacache_state_pool_usage", "mambacache_running_requests",
                 "mambacache_waiting_requests"):
        assert name in fams, sorted(fams)
    ttft = {s.name: s.value for s in fams["mambacache_time_to_first_token_seconds"].samples}
    assert ttft["mambacache_time_to_first_token_seconds_count"] >= 1
    itl = {s.name: s.value for s in fams["mambacache_inter_token_latency_seconds"].samples}
    assert itl["mambacache_inter_token_latency_seconds_count"] >= 2
    prompt = fams["mambacache_prompt_tokens"].samples[0].value
    assert prompt >= len("metrics")


SLOW_STEP_S = 6.0


def test_metrics_health_and_aborts_never_wait_behind_a_step(srv, monkeypatch):
    """A step that takes SLOW_STEP_S (a long prefill, a compile): /metrics and /health answer
    within 2 s while it runs, and a client that goes away gives its capacity back at once."""
    srv.wait_idle()
    real_run, started = srv.engine.runner.run, threading.Event()

    def slow_run(*args, **kwargs):
        started.set()
        time.sleep(SLOW_STEP_S)
        return real_run(*args, **kwargs)

    srv.on_engine(lambda e: monkeypatch.setattr(e.runner, "run", slow_run))
    try:
        body = {"model": MODEL, "prompt": "slow", "max_tokens": 2, "stream": True}
        with httpx.Client(base_url=srv.url, timeout=60) as http:
            with http.stream("POST", "/v1/completions", json=body) as resp:
                assert resp.status_code == 200
                assert started.wait(30)
                t0 = time.monotonic()
                fams = {f.name for f in text_string_to_metric_families(http.get("/metrics").text)}
                assert "mambacache_kv_pool_usage" in fams
                assert http.get("/health").status_code == 200
                assert time.monotonic() - t0 < 2.0
                assert srv.server.loop.in_flight == 1
            # the client went away mid-step: its place is free before the step ends
            while srv.server.loop.in_flight and time.monotonic() - t0 < 2.0:
                time.sleep(0.02)
            assert srv.server.loop.in_flight == 0
            assert time.monotonic() - t0 < SLOW_STEP_S - 2.0
    finally:
        srv.on_engine(lambda e: monkeypatch.setattr(e.runner, "run", real_run))
    srv.wait_idle()
    srv.on_engine(lambda e: e.check_integrity())


def test_failed_step_is_a_500_and_the_server_goes_on(srv, client, monkeypatch):
    real_run, calls = srv.engine.runner.run, []

    def failing_run(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected step failure")
        return real_run(*args, **kwargs)

    srv.wait_idle()
    srv.on_engine(lambda e: monkeypatch.setattr(e.runner, "run", failing_run))
    with pytest.raises(openai.InternalServerError, match="injected step failure"):
        client.completions.create(model=MODEL, prompt="fail", max_tokens=3, **GREEDY)
    chunks = list(client.completions.create(model=MODEL, prompt="then stream", max_tokens=3,
                                            stream=True, **GREEDY))
    assert sum(len(c.choices[0].token_ids) for c in chunks) == 3
    srv.wait_idle()
    srv.on_engine(lambda e: e.check_integrity())
