"""ShareGPT chat: tolerant parsing of a cut file, ChatML tokens whose turns extend each other,
interleaved traces, the ``sharegpt`` workload kind, and the packaged data + tokenizer."""

from __future__ import annotations

import json

import pytest

from mambacache.bench.sharegpt import (
    chat_trace,
    iter_conversations,
    load_tokenized,
    main,
    tokenize_conversation,
)
from mambacache.bench.workloads import workload_from_dict


def _conv(i: int, turns: int) -> dict:
    msgs = []
    for k in range(turns):
        msgs += [{"from": "human", "value": f"question {i}.{k} " * (k + 1)},
                 {"from": "gpt", "value": f"answer {i}.{k} " * (k + 2)}]
    return {"id": str(i), "conversations": msgs}


def _encode(text: str) -> list[int]:
    return [ord(c) for c in text]  # one token a character: enough to check the layout


@pytest.fixture(scope="module")
def cut_file(tmp_path_factory):
    """Four conversations, the fourth cut in the middle (as the packaged file is)."""
    convs = [_conv(0, 3), {"id": "x", "conversations": [{"from": "gpt", "value": "hi"},
                                                        {"from": "human", "value": "q"},
                                                        {"from": "gpt", "value": "a"},
                                                        {"from": "gpt", "value": "oops"}]},
             _conv(2, 1), _conv(3, 2)]
    text = json.dumps(convs, indent=2)
    path = tmp_path_factory.mktemp("sg") / "cut.json"
    path.write_text(text[:text.rindex("answer 3.1")])
    return path


def test_cut_file_yields_whole_conversations_only(cut_file):
    convs = list(iter_conversations(cut_file))
    assert [len(c) for c in convs] == [3, 1, 1]  # conversation 3 is cut; x stops at the break
    assert convs[1] == [("q", "a")]  # leading gpt message dropped, pattern break ends it
    assert [len(c) for c in iter_conversations(cut_file, min_turns=2)] == [3]


def test_each_turn_extends_the_previous_prompt_and_reply(cut_file):
    conv = next(iter_conversations(cut_file))
    turns = tokenize_conversation(conv, _encode, max_context=10_000)
    assert len(turns) == 3
    text = "".join(chr(t) for part, out in turns for t in part + out)
    assert text.startswith("<|im_start|>user\nquestion 0.0 <|im_end|>\n<|im_start|>assistant\n"
                           "answer 0.0 answer 0.0 <|im_end|>\n<|im_start|>user\n")
    records = chat_trace([turns], sessions_per_s=1.0, seed=0)
    for prev, nxt in zip(records, records[1:], strict=False):
        assert nxt["prompt"][:len(prev["prompt"]) + len(prev["output"])] == \
            prev["prompt"] + prev["output"]
    # context cap: stop before the turn that would pass it; reply cap
    short = tokenize_conversation(conv, _encode, max_context=sum(map(len, turns[0])) + 5)
    assert len(short) == 1
    assert all(len(o) <= 4 for _, o in tokenize_conversation(conv, _encode, 10_000, 0, 4))


def test_trace_interleaves_sessions_in_time_order():
    convs = [[([1] * 3, [2] * 4)] * 3 for _ in range(20)]
    records = chat_trace(convs, sessions_per_s=2.0, think_time_s=5.0, seed=3)
    assert len(records) == 60
    times = [r["time_s"] for r in records]
    assert times == sorted(times)
    order = [r["session"] for r in records]
    assert order != sorted(order)  # sessions overlap
    for s in range(20):
        assert [r["turn"] for r in records if r["session"] == s] == [0, 1, 2]
    with pytest.raises(ValueError, match="sessions_per_s"):
        chat_trace(convs, sessions_per_s=0)


def test_packaged_conversations_and_tokenizer(tmp_path):
    """The ``sharegpt`` extra: the packaged (cut) file, the Qwen3.5 tokenizer, the CLI, the
    workload kind."""
    convs = load_tokenized(3, min_turns=2, max_context=4096)
    assert len(convs) == 3 and all(len(c) >= 2 for c in convs)
    assert convs[0][0][0][0] == 248045  # <|im_start|> in the Qwen3.5 vocabulary
    out = tmp_path / "chat.jsonl"
    summary = main(["--out", str(out), "--conversations", "3", "--max-context", "4096"])
    lines = out.read_text().splitlines()
    assert len(lines) == summary["requests"] >= 6
    assert {"prompt", "output", "session", "turn", "time_s"} <= set(json.loads(lines[0]))
    spec = workload_from_dict({"kind": "sharegpt", "num_conversations": 2, "max_output_len": 8})
    src = spec.source(vocab=1000, seed=0)
    first = src.start()
    assert len(first) == 2 and all(max(i.prompt) < 1000 and i.max_new_tokens <= 8 for i in first)
    nxt = src.follow_up(first[0], [7] * first[0].max_new_tokens)
    assert nxt.turn == 1 and nxt.prompt[:len(first[0].prompt) + first[0].max_new_tokens] == \
        first[0].prompt + [7] * first[0].max_new_tokens
    with pytest.raises(ValueError, match="tokenizer"):
        workload_from_dict({"kind": "sharegpt", "tokenizer": "gpt2"})
