"""The server as routers and clients other than ``openai`` use it (issue 31): unknown fields
ignored (logged once, listed in a header), SGLang's native ``/generate`` and info routes, ``HEAD``
on ``GET`` routes. One real server for the module (``serve_helpers``)."""

from __future__ import annotations

import json
import logging

import httpx
import openai
import pytest
from serve_helpers import MODEL, running_server

from mambacache.serve import lenient
from mambacache.serve.protocol import ChatRequest, CompletionRequest, parse_request
from mambacache.serve.sglang_api import GenerateRequest

# What sglang-router 0.3.2 adds to the requests it forwards (issue 31).
ROUTER_FIELDS = {"no_stop_trim": False, "return_hidden_states": False,
                 "skip_special_tokens": True, "continue_final_message": False,
                 "separate_reasoning": True, "stream_reasoning": True}


@pytest.fixture(scope="module")
def srv():
    with running_server() as handle:
        handle.openai = openai.OpenAI(base_url=f"{handle.url}/v1", api_key="none",
                                      max_retries=0)
        with handle.openai:
            yield handle


@pytest.fixture
def client(srv):
    return srv.openai


def test_unknown_fields_are_named_nested_and_once(caplog):
    body = {"messages": [{"role": "tool", "content": "4", "tool_call_id": "c1"},
                         {"role": "user", "content": "x", "cache_control": {}}],
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            **ROUTER_FIELDS}
    req = parse_request(json.dumps(body).encode(), ChatRequest)
    assert lenient.ignored_fields(req) == [*ROUTER_FIELDS, "stream_options.continuous_usage_stats",
                                           "messages.tool_call_id", "messages.cache_control"]
    lenient.IGNORED_LOGGED.difference_update(lenient.ignored_fields(req))
    with caplog.at_level(logging.WARNING, logger=lenient.__name__):
        first = lenient.note_ignored(req)
        again = lenient.note_ignored(req)
    assert first == again == {lenient.IGNORED_HEADER: ", ".join(lenient.ignored_fields(req))}
    assert len(caplog.records) == 1 and "no_stop_trim" in caplog.records[0].getMessage()
    plain = parse_request(b'{"prompt": "x"}', CompletionRequest)
    assert lenient.note_ignored(plain) == {}
    evil = parse_request(json.dumps({"prompt": "x", "a\r\nSet-Cookie: x": 1}).encode(),
                         CompletionRequest)
    assert lenient.note_ignored(evil)[lenient.IGNORED_HEADER] == "a??Set-Cookie: x"


def test_known_field_with_a_bad_value_is_still_a_400(srv):
    body = {"model": MODEL, "prompt": "x", "temperature": -1, "colour": "red"}
    resp = httpx.post(f"{srv.url}/v1/completions", json=body)
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "temperature"
    resp = httpx.post(f"{srv.url}/generate",
                      json={"text": "x", "sampling_params": {"top_p": 0, "unknown": 1}})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "sampling_params.top_p"


def test_router_fields_are_ignored_and_listed(srv, client):
    resp = httpx.post(f"{srv.url}/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
        "temperature": 0, **ROUTER_FIELDS})
    assert resp.status_code == 200, resp.text
    assert resp.headers[lenient.IGNORED_HEADER] == ", ".join(ROUTER_FIELDS)
    out = client.completions.create(model=MODEL, prompt="hi", max_tokens=3, temperature=0,
                                    stream=True, extra_body=ROUTER_FIELDS)
    assert sum(len(c.choices[0].text) for c in out if c.choices) > 0
    plain = httpx.post(f"{srv.url}/v1/completions", timeout=60,
                       json={"model": MODEL, "prompt": "hi", "max_tokens": 1})
    assert lenient.IGNORED_HEADER not in plain.headers


def test_generate_text_and_ids_match_completions(srv, client):
    prompt = "SGLang's native route"
    ids = srv.tokenizer.encode(prompt)
    ref = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0,
                                    logprobs=0, extra_body={"ignore_eos": True,
                                                            "return_token_ids": True})
    sp = {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}
    by_text = httpx.post(f"{srv.url}/generate", timeout=60, json={
        "text": prompt, "sampling_params": sp, "return_logprob": True}).json()
    assert by_text["output_ids"] == ref.choices[0].token_ids
    assert by_text["text"] == ref.choices[0].text
    meta = by_text["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 5}
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (len(ids), 5)
    assert meta["cached_tokens"] == len(ids) - 1  # the completion above cached the prompt
    lps = [lp for lp, _, _ in meta["output_token_logprobs"]]
    assert lps == pytest.approx(ref.choices[0].logprobs.token_logprobs, abs=1e-4)
    assert [t for _, t, _ in meta["output_token_logprobs"]] == by_text["output_ids"]
    batch = httpx.post(f"{srv.url}/generate", timeout=60, json={
        "input_ids": [ids, ids[:4]], "sampling_params": sp}).json()
    assert isinstance(batch, list) and batch[0]["output_ids"] == by_text["output_ids"]
    assert batch[1]["meta_info"]["prompt_tokens"] == 4
    assert batch[0]["meta_info"]["id"] != batch[1]["meta_info"]["id"]


def test_generate_streams_cumulative_text(srv):
    body = {"text": "stream me", "stream": True,
            "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}
    whole = httpx.post(f"{srv.url}/generate", timeout=60,
                       json=body | {"stream": False}).json()
    events = []
    with httpx.stream("POST", f"{srv.url}/generate", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: "):])
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    counts = [c["meta_info"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 6
    assert chunks[-1]["text"] == whole["text"]
    assert chunks[-1]["output_ids"] == whole["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])


def test_generate_stop_string_and_defaults(srv):
    full = httpx.post(f"{srv.url}/generate", timeout=60, json={
        "text": "stop here", "sampling_params": {"max_new_tokens": 30, "temperature": 0,
                                                 "ignore_eos": True}}).json()
    stop = full["text"][4:7]
    cut = httpx.post(f"{srv.url}/generate", timeout=60, json={
        "text": "stop here", "sampling_params": {"max_new_tokens": 30, "temperature": 0,
                                                 "ignore_eos": True, "stop": [stop]}}).json()
    assert cut["text"] == full["text"][:full["text"].find(stop)]
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    req = GenerateRequest.model_validate({"text": "x"})
    assert req.sampling_params.max_new_tokens == 128 and req.sampling_params.top_k == -1
    for body, param in [({"sampling_params": {}}, "text"),
                        ({"text": "x", "input_ids": [1]}, "text"),
                        ({"input_ids": []}, "input_ids")]:
        resp = httpx.post(f"{srv.url}/generate", json=body)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text
    srv.wait_idle()
    srv.on_engine(lambda e: e.check_integrity())


def test_info_routes_and_head(srv, client):
    for path in ("/server_info", "/get_server_info"):
        info = httpx.get(srv.url + path).json()
        assert info["model_path"] == MODEL and info["dp_size"] == 1
        assert info["max_running_requests"] == srv.engine.cfg.scheduler.max_running_requests
    for path in ("/model_info", "/get_model_info"):
        assert httpx.get(srv.url + path).json()["is_generation"] is True
    assert httpx.get(f"{srv.url}/version").json()["version"]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")
    assert httpx.get(f"{srv.url}/get_load").json()[0]["num_reqs"] >= 0
    for path in ("/health", "/v1/models", "/server_info", "/metrics", "/version"):
        get, head = httpx.get(srv.url + path), httpx.head(srv.url + path)
        assert head.status_code == get.status_code == 200, path
        assert head.content == b"" and head.headers["content-type"] == \
            get.headers["content-type"], path
    assert httpx.head(f"{srv.url}/generate").status_code == 405
