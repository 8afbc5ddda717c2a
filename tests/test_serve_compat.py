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

from mambacache.serve import lenient, tool_calls
from mambacache.serve.protocol import ChatRequest, CompletionRequest, parse_request
from mambacache.serve.sglang_api import GenerateRequest

# These tests are about the HTTP surface, not start-up: the first requests compile what they
# use (the full warm-up of every step program took > 600 s at load ~25 on the 2-core box).
NO_WARMUP = {"serve.warmup": False}

# What sglang-router 0.3.2 adds to the requests it forwards (issue 31).
ROUTER_FIELDS = {"no_stop_trim": False, "return_hidden_states": False,
                 "skip_special_tokens": True, "continue_final_message": False,
                 "separate_reasoning": True, "stream_reasoning": True}


@pytest.fixture(scope="module")
def srv():
    with running_server(**NO_WARMUP) as handle:
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
                                           "messages.cache_control"]  # tool_call_id is read
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
    resp = httpx.post(f"{srv.url}/v1/chat/completions", timeout=300, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
        "temperature": 0, **ROUTER_FIELDS})
    assert resp.status_code == 200, resp.text
    assert resp.headers[lenient.IGNORED_HEADER] == ", ".join(ROUTER_FIELDS)
    out = client.completions.create(model=MODEL, prompt="hi", max_tokens=3, temperature=0,
                                    stream=True, extra_body=ROUTER_FIELDS)
    assert sum(len(c.choices[0].text) for c in out if c.choices) > 0
    plain = httpx.post(f"{srv.url}/v1/completions", timeout=300,
                       json={"model": MODEL, "prompt": "hi", "max_tokens": 1})
    assert lenient.IGNORED_HEADER not in plain.headers


def test_generate_text_and_ids_match_completions(srv, client):
    prompt = "SGLang's native route"
    ids = srv.tokenizer.encode(prompt)
    ref = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0,
                                    logprobs=0, extra_body={"ignore_eos": True,
                                                            "return_token_ids": True})
    sp = {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}
    by_text = httpx.post(f"{srv.url}/generate", timeout=300, json={
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
    batch = httpx.post(f"{srv.url}/generate", timeout=300, json={
        "input_ids": [ids, ids[:4]], "sampling_params": sp}).json()
    assert isinstance(batch, list) and batch[0]["output_ids"] == by_text["output_ids"]
    assert batch[1]["meta_info"]["prompt_tokens"] == 4
    assert batch[0]["meta_info"]["id"] != batch[1]["meta_info"]["id"]


def test_generate_streams_cumulative_text(srv):
    body = {"text": "stream me", "stream": True,
            "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}
    whole = httpx.post(f"{srv.url}/generate", timeout=300,
                       json=body | {"stream": False}).json()
    events = []
    with httpx.stream("POST", f"{srv.url}/generate", json=body, timeout=300) as resp:
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
    full = httpx.post(f"{srv.url}/generate", timeout=300, json={
        "text": "stop here", "sampling_params": {"max_new_tokens": 30, "temperature": 0,
                                                 "ignore_eos": True}}).json()
    stop = full["text"][4:7]
    cut = httpx.post(f"{srv.url}/generate", timeout=300, json={
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


def test_top_logprobs_and_echo_prompt_logprobs(srv, client):
    """Top alternatives per token; echo's prompt logprobs equal the sampler's logprobs of the
    same tokens and do not change when the prompt is served from the cache (issue 31 item 2)."""
    prompt = srv.tokenizer.encode("Score these tokens, cached or not.")
    greedy = {"temperature": 0, "extra_body": {"ignore_eos": True, "return_token_ids": True}}
    gen = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, logprobs=3,
                                    **greedy)
    lp = gen.choices[0].logprobs
    out_ids = gen.choices[0].token_ids
    # a dict by token text: the byte tokenizer's undecodable ids share a text, so <= 3 keys
    assert len(lp.top_logprobs) == 4 and all(1 <= len(t) <= 3 for t in lp.top_logprobs)
    for value, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert value >= max(top.values()) - 1e-4  # greedy: the top-1 (keys may collide)
    assert gen.usage.prompt_tokens_details.scored_tokens == len(prompt) + 4
    sampler = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, logprobs=0,
                                        **greedy).choices[0].logprobs.token_logprobs
    assert lp.token_logprobs == pytest.approx(sampler, abs=1e-4)

    def echo(ids):
        return client.completions.create(model=MODEL, prompt=ids, max_tokens=1, echo=True,
                                         logprobs=1, **greedy)

    full = prompt + out_ids
    e = echo(full)  # the generation cached prompt + output: a hit
    token_lps = e.choices[0].logprobs.token_logprobs
    assert len(token_lps) == len(full) + 1 and token_lps[0] is None
    assert e.choices[0].logprobs.top_logprobs[0] is None
    assert e.choices[0].text.startswith(srv.tokenizer.decode(full))
    assert token_lps[len(prompt):len(full)] == pytest.approx(sampler, abs=1e-4)
    fresh = srv.tokenizer.encode("A fresh prompt that nobody has sent before.")
    cold, warm = echo(fresh), echo(fresh)  # the second is served from the cache
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert warm.usage.prompt_tokens_details.cached_tokens == len(fresh) - 1
    a, b = (x.choices[0].logprobs.token_logprobs for x in (cold, warm))
    assert a[0] is None and b[0] is None
    assert a[1:] == pytest.approx(b[1:], abs=1e-4)

    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "top"}], max_tokens=3, logprobs=True,
        top_logprobs=5, **greedy)
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 5 for c in content)
    assert all(c.top_logprobs[0].token == c.token for c in content)
    with pytest.raises(openai.BadRequestError, match="stream"):
        client.completions.create(model=MODEL, prompt="x", logprobs=2, stream=True, n=2)
    # streamed: one chunk per token, the same text and logprobs as the whole answer
    streamed = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "top"}], max_tokens=3, logprobs=True,
        top_logprobs=5, stream=True, stream_options={"include_usage": True}, **greedy))
    got = [c for ch in streamed if ch.choices and ch.choices[0].logprobs
           for c in ch.choices[0].logprobs.content]
    assert [(c.token, c.logprob) for c in got] == [(c.token, c.logprob) for c in content]
    assert [len(c.top_logprobs) for c in got] == [5, 5, 5]
    assert "".join(ch.choices[0].delta.content or "" for ch in streamed if ch.choices) == \
        chat.choices[0].message.content
    assert streamed[-1].usage.completion_tokens == 3
    plain = list(client.chat.completions.create(  # sampler logprobs only, streamed
        model=MODEL, messages=[{"role": "user", "content": "top"}], max_tokens=3,
        logprobs=True, stream=True, **greedy))
    plain_lps = [c.logprob for ch in plain if ch.choices and ch.choices[0].logprobs
                 for c in ch.choices[0].logprobs.content]
    assert plain_lps == pytest.approx([c.logprob for c in content], abs=1e-4)
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=4,
                                            logprobs=3, stream=True, **greedy))
    tops = [t for ch in chunks if ch.choices and ch.choices[0].logprobs
            for t in ch.choices[0].logprobs.top_logprobs]
    assert tops == lp.top_logprobs
    srv.wait_idle()
    srv.on_engine(lambda e: e.check_integrity())


def test_n_choices_share_the_prompt_with_per_choice_seeds(srv, client):
    prompt = srv.tokenizer.encode("Four samples of one prompt, computed once. " * 3)
    kw = dict(model=MODEL, max_tokens=5, temperature=1.0,
              extra_body={"ignore_eos": True, "return_token_ids": True})
    srv.wait_idle()
    before = srv.on_engine(lambda e: e.metrics()["computed_prefill_tokens"])
    out = client.completions.create(prompt=prompt, n=4, seed=7, **kw)
    computed = srv.on_engine(lambda e: e.metrics()["computed_prefill_tokens"]) - before
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    ids = [c.token_ids for c in out.choices]
    assert len({tuple(i) for i in ids}) > 1  # per-choice seeds: the samples differ
    assert computed <= len(prompt) + 3, computed  # the prompt once; a sample recomputes <= 1
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(prompt), 20)
    again = client.completions.create(prompt=prompt, n=4, seed=7, **kw)
    assert [c.token_ids for c in again.choices] == ids
    third = client.completions.create(prompt=prompt, seed=9, **kw)  # choice 2's seed: 7 + 2
    assert third.choices[0].token_ids == ids[2]

    batch = client.completions.create(prompt=[prompt, prompt[:20]], n=2, seed=7, **kw)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert [c.token_ids for c in batch.choices[:2]] == ids[:2]
    assert batch.usage.prompt_tokens == len(prompt) + 20

    chunks = list(client.chat.completions.create(
        messages=[{"role": "user", "content": "n streams"}], n=2, seed=3, stream=True,
        stream_options={"include_usage": True}, **kw))
    streamed = {0: [], 1: []}
    for c in chunks:
        for choice in c.choices:
            streamed[choice.index] += getattr(choice, "token_ids", None) or []
    whole = client.chat.completions.create(
        messages=[{"role": "user", "content": "n streams"}], n=2, seed=3, **kw)
    assert [streamed[0], streamed[1]] == [c.token_ids for c in whole.choices]
    assert chunks[-1].usage.completion_tokens == 10
    srv.wait_idle()
    srv.on_engine(lambda e: e.check_integrity())


def test_tool_call_text_parsed_in_both_formats():
    text = ('Let me check.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call>\n<tool_call>\n<function=add>\n<parameter=a>\n2\n</parameter>\n'
            '<parameter=note>\ntwo words\n</parameter>\n</function>\n</tool_call>')
    content, calls = tool_calls.parse_tool_calls(text)
    assert content.strip() == "Let me check."
    assert [c["function"]["name"] for c in calls] == ["weather", "add"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert json.loads(calls[1]["function"]["arguments"]) == {"a": 2, "note": "two words"}
    assert calls[0]["id"] != calls[1]["id"] and calls[0]["type"] == "function"
    bad = "<tool_call>not a call</tool_call> rest"
    assert tool_calls.parse_tool_calls(bad) == (bad, [])  # kept, never dropped
    assert tool_calls.parse_tool_calls("  \n") == (None, [])


def test_tool_call_round_trips_through_the_openai_client(srv, client, monkeypatch):
    """The server parses a Hermes-format call out of the answer (the random tiny model cannot be
    asked for one: its text is replaced here) and takes the call and its result back."""
    tools = [{"type": "function", "function": {
        "name": "weather", "parameters": {"type": "object",
                                          "properties": {"city": {"type": "string"}}}}}]
    real = srv.server._collect

    async def answer_with_a_call(gen, shape, chat, want_lp):
        body = await real(gen, shape, chat, want_lp)
        body["choices"][0]["message"]["content"] = (
            '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>')
        return body

    monkeypatch.setattr(srv.server, "_collect", answer_with_a_call)
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, tools=tools,
                                         max_tokens=3)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    assert call.function.name == "weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    monkeypatch.undo()
    follow = messages + [choice.message.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=follow, tools=tools, max_tokens=3)
    assert raw.http_response.status_code == 200
    assert lenient.IGNORED_HEADER not in raw.headers  # tools and tool_calls are read
    assert raw.parse().choices[0].message.tool_calls is None  # plain text: no call
    srv.wait_idle()


# ---- penalties, structured output, forced tool calls, /generate n (issue 31) ---------------
BOUNDED = {"type": "object", "additionalProperties": False,
           "required": ["color", "ok", "size"],
           "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"},
                          "size": {"enum": [1, 2, 3]}}}


def _valid(text: str) -> bool:
    """``text`` is JSON of the ``BOUNDED`` schema (checked by hand: no jsonschema in the venv)."""
    obj = json.loads(text)
    return (set(obj) == {"color", "ok", "size"} and obj["color"] in ("red", "green", "blue")
            and isinstance(obj["ok"], bool) and obj["size"] in (1, 2, 3))


def test_penalties_are_accepted_everywhere_and_bounded(srv, client):
    kw = dict(model=MODEL, max_tokens=4, temperature=0.0, presence_penalty=1.5,
              frequency_penalty=-0.5, extra_body={"repetition_penalty": 1.3, "ignore_eos": True})
    assert client.completions.create(prompt="penalised", **kw).usage.completion_tokens == 4
    chat = client.chat.completions.create(messages=[{"role": "user", "content": "hi"}], **kw)
    assert chat.choices[0].finish_reason == "length"
    sp = {"max_new_tokens": 4, "temperature": 0, "presence_penalty": 1.5,
          "repetition_penalty": 1.3, "ignore_eos": True}
    r = httpx.post(f"{srv.url}/generate", json={"text": "penalised", "sampling_params": sp},
                   timeout=60)
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 4
    for url, body, param, words in [
            ("/v1/completions", {"prompt": "x", "presence_penalty": 2.5}, "presence_penalty",
             ["2"]),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                      "frequency_penalty": -3}, "frequency_penalty", ["-2"]),
            ("/v1/completions", {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty",
             ["0"]),
            ("/generate", {"text": "x", "sampling_params": {"repetition_penalty": 2.5}},
             "sampling_params.repetition_penalty", ["2"])]:
        r = httpx.post(srv.url + url, json=body, timeout=30)
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == param, (url, r.text)
        assert all(w in err["message"] for w in words), err["message"]


def test_json_schema_output_validates_every_time_streamed_or_not(srv, client):
    fmt = {"type": "json_schema", "json_schema": {"name": "pick", "schema": BOUNDED}}
    messages = [{"role": "user", "content": "Pick a colour."}]
    for seed in range(4):
        out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=60,
                                             temperature=1.0, seed=seed, response_format=fmt)
        assert out.choices[0].finish_reason == "stop" and _valid(out.choices[0].message.content)
        chunks = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=60,
                                                temperature=1.0, seed=seed, response_format=fmt,
                                                stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == out.choices[0].message.content and _valid(text)
    r = httpx.post(f"{srv.url}/generate", timeout=60, json={
        "text": "json:", "sampling_params": {"json_schema": json.dumps(BOUNDED),
                                             "max_new_tokens": 60, "sampling_seed": 5}})
    assert _valid(r.json()["text"]), r.text
    r = httpx.post(f"{srv.url}/v1/chat/completions", timeout=30, json={
        "messages": messages, "response_format": {"type": "json_schema",
                                                  "json_schema": {"schema": {"type": 3}}}})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("response_format")


def test_forced_tool_call_round_trips_streamed_and_not(srv, client):
    """``tool_choice`` "required" / named: the random model's answer is a valid call (its
    arguments follow the function's schema); streamed, the calls come as OpenAI's deltas."""
    tools = [{"type": "function", "function": {"name": "paint", "parameters": BOUNDED}},
             {"type": "function", "function": {"name": "noop", "parameters": {
                 "type": "object", "properties": {}, "additionalProperties": False}}}]
    messages = [{"role": "user", "content": "Paint something."}]
    named = {"type": "function", "function": {"name": "paint"}}
    out = client.chat.completions.create(model=MODEL, messages=messages, tools=tools,
                                         tool_choice=named, max_tokens=120, temperature=1.0,
                                         seed=1)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    call = choice.message.tool_calls[0]
    assert call.function.name == "paint" and _valid(call.function.arguments)
    stream = client.chat.completions.create(model=MODEL, messages=messages, tools=tools,
                                            tool_choice="required", max_tokens=120,
                                            temperature=1.0, seed=2, stream=True)
    calls: dict[int, dict] = {}
    finish = None
    for c in stream:
        for ch in c.choices:
            finish = ch.finish_reason or finish
            for d in ch.delta.tool_calls or ():
                got = calls.setdefault(d.index, {"id": d.id, "name": "", "arguments": ""})
                got["name"] += (d.function.name or "") if d.function else ""
                got["arguments"] += (d.function.arguments or "") if d.function else ""
    assert finish == "tool_calls" and len(calls) == 1 and calls[0]["id"]
    assert calls[0]["name"] in ("paint", "noop")
    args = json.loads(calls[0]["arguments"])
    assert _valid(calls[0]["arguments"]) if calls[0]["name"] == "paint" else args == {}
    follow = messages + [choice.message.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": call.id, "content": "done"}]
    again = client.chat.completions.create(model=MODEL, messages=follow, tools=tools,
                                           max_tokens=3)
    assert again.choices[0].message.tool_calls is None  # auto: free text, no call
    srv.wait_idle()


def test_generate_n_four_choices_compute_the_prompt_once(srv):
    prompt = srv.tokenizer.encode("Four samples through /generate, computed once. " * 3)
    body = {"input_ids": prompt, "sampling_params": {
        "n": 4, "sampling_seed": 11, "temperature": 1.0, "max_new_tokens": 5, "ignore_eos": True}}
    srv.wait_idle()
    before = srv.on_engine(lambda e: e.metrics()["computed_prefill_tokens"])
    out = httpx.post(f"{srv.url}/generate", json=body, timeout=300).json()
    computed = srv.on_engine(lambda e: e.metrics()["computed_prefill_tokens"]) - before
    assert isinstance(out, list) and len(out) == 4
    ids = [tuple(o["output_ids"]) for o in out]
    assert len(set(ids)) > 1 and all(len(i) == 5 for i in ids)  # per-choice seeds
    assert computed <= len(prompt) + 3, computed  # the prompt once; a sample recomputes <= 1
    assert sum(o["meta_info"]["cached_tokens"] for o in out) >= 3 * (len(prompt) - 16)
    again = httpx.post(f"{srv.url}/generate", json=body, timeout=300).json()
    assert [tuple(o["output_ids"]) for o in again] == ids
    srv.wait_idle()
    srv.on_engine(lambda e: e.check_integrity())
