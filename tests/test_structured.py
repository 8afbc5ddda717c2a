"""Grammars of ``serve/structured.py`` on both tokenizers (the built-in byte-level one and a
``tokenizer.json`` through ``tokenizers``), without a model: a random walk over the tokens each
mask allows always ends, and its text is what the schema asks for."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from mambacache.serve import structured
from mambacache.serve.protocol import ApiError
from mambacache.serve.tokenizer import ByteTokenizer, HFTokenizer, write_byte_tokenizer_json

VOCAB = 512
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["mode", "on"],
          "properties": {"mode": {"enum": ["fast", "slow"]}, "on": {"type": "boolean"}}}


@pytest.fixture(scope="module", params=["byte", "hf"])
def server(request, tmp_path_factory):
    if request.param == "byte":
        tok = ByteTokenizer(VOCAB)
    else:
        directory = tmp_path_factory.mktemp("tok")
        write_byte_tokenizer_json(directory)
        tok = HFTokenizer(directory)
    return SimpleNamespace(tokenizer=tok, engine=SimpleNamespace(
        model_cfg=SimpleNamespace(vocab_size=VOCAB)))


def walk(server, grammar, seed: int, limit: int = 200) -> tuple[str, bool]:
    """Random allowed tokens until the matcher is done; (text, done)."""
    matcher = structured.constraint(server, grammar, "test").matcher()
    rng = np.random.default_rng(seed)
    mask, ids = np.zeros(-(-VOCAB // 32), np.int32), []
    vocab = np.arange(VOCAB)
    while not matcher.done and len(ids) < limit:
        matcher.fill_bitmask(mask)
        allowed = np.flatnonzero((mask[vocab // 32] >> (vocab % 32)) & 1)
        ids.append(int(rng.choice(allowed)))
        assert matcher.accept(ids[-1])
    return server.tokenizer.decode(ids), matcher.done


def test_json_schema_walks_end_in_valid_json(server):
    grammar = structured.response_format_grammar(
        {"type": "json_schema", "json_schema": {"schema": SCHEMA}})
    for seed in range(5):
        text, done = walk(server, grammar, seed)
        obj = json.loads(text)
        assert done and " " not in text and obj["mode"] in ("fast", "slow"), text
        assert isinstance(obj["on"], bool) and set(obj) == {"mode", "on"}


def test_forced_tool_call_walks_parse_as_calls(server):
    from mambacache.serve.tool_calls import parse_tool_calls

    tools = [{"type": "function", "function": {"name": "set", "parameters": SCHEMA}}]
    grammar = structured.tool_choice_grammar(tools, "required")
    text, done = walk(server, grammar, 0)
    content, calls = parse_tool_calls(text)
    assert done and content is None and calls[0]["function"]["name"] == "set", text
    assert json.loads(calls[0]["function"]["arguments"])["mode"] in ("fast", "slow")
    with pytest.raises(ApiError, match="no tool named 'other'"):
        structured.tool_choice_grammar(tools, {"type": "function",
                                               "function": {"name": "other"}})
    assert structured.tool_choice_grammar(tools, "auto") is None
