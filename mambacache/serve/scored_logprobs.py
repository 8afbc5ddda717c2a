"""Logprobs that need more than the sampled token's: top alternatives (completions
``logprobs: N``, chat ``top_logprobs: N``, N <= 20) and ``echo`` with prompt logprobs.

The answer is generated as usual; then prompt + output are scored once from scratch on the
engine thread (``engine/runners/scoring.py``: every position it needs is computed, the radix cache
is neither read nor changed), so a prompt's logprobs are the same whether its prefix was cached or
not, and the output tokens' logprobs equal the sampler's (within float error). ``usage`` says
what was recomputed: ``prompt_tokens_details.scored_tokens``. The first prompt token has no
logprob (``null``). Streamed (one choice): the scored answer is sent as one chunk per token,
text and logprobs together (``stream_chunks``), once scoring is done; several choices with top
logprobs are refused in a stream (400).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from mambacache.engine.runners.scoring import Scored, Scorer
from mambacache.serve.protocol import ApiError, ChatRequest, CompletionRequest

if TYPE_CHECKING:
    from mambacache.engine.engine import Engine

Piece = Callable[[int], str]


def scoring_request(req: CompletionRequest | ChatRequest, chat: bool,
                    multi: bool = False) -> tuple[int, bool]:
    """(top alternatives per token, echo) the request asks for; (0, False): no scoring.
    ``multi``: several choices (``n`` > 1 or a batch), which are not streamed with them."""
    if chat:
        top_n, echo = (req.top_logprobs or 0) if req.logprobs else 0, False
    else:
        top_n, echo = req.logprobs or 0, req.echo
    if (top_n or echo) and req.stream and multi:
        raise ApiError("top logprobs and echo of several choices are not streamed by this "
                       "server; send the request with stream false or n 1", param="stream")
    return top_n, echo


def scorer(server: Any, engine: Engine) -> Scorer:
    """The server's scorer (made on first use, in the engine thread)."""
    if getattr(server, "_scorer", None) is None:
        server._scorer = Scorer(engine)
    return server._scorer


def completion_object(scored: Scored, start: int, top_n: int, piece: Piece,
                      text_offset: int = 0) -> dict[str, Any]:
    """The legacy completions ``logprobs`` of positions ``start:`` of ``scored``."""
    tokens = [piece(t) for t in scored.ids[start:]]
    offsets, pos = [], text_offset
    for tok in tokens:
        offsets.append(pos)
        pos += len(tok)
    top = [None if lp is None else {piece(t): v for t, v in alts[:top_n]}
           for lp, alts in zip(scored.logprobs[start:], scored.top[start:], strict=True)]
    return {"tokens": tokens, "token_logprobs": scored.logprobs[start:],
            "top_logprobs": top, "text_offset": offsets}


def chat_object(scored: Scored, start: int, top_n: int, piece: Piece) -> dict[str, Any]:
    def entry(t: int, lp: float) -> dict[str, Any]:
        tok = piece(t)
        return {"token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8"))}

    return {"content": [entry(t, lp) | {"top_logprobs": [entry(a, v) for a, v in alts[:top_n]]}
                        for t, lp, alts in zip(scored.ids[start:], scored.logprobs[start:],
                                               scored.top[start:], strict=True)]}


async def scored_response(server: Any, gen: Any, shape: Any, chat: bool, top_n: int,
                          echo: bool) -> dict[str, Any]:
    """The non-streamed body of a request that asked for top logprobs or ``echo``."""
    text, ids, reason = "", [], None
    async for p in gen.pieces():
        text, ids, reason = text + p.text, ids + p.ids, p.finish_reason
    prompt = list(gen.prompt_ids)
    try:
        scored = await server.loop.call(
            lambda e: scorer(server, e).score(prompt + ids, top_n))
    except ValueError as err:
        raise ApiError(f"logprobs: {err}", param="logprobs") from None
    start = 0 if echo else len(prompt)
    if chat:
        logprobs = chat_object(scored, start, top_n, server.piece)
    else:
        logprobs = completion_object(scored, start, top_n, server.piece)
    if echo:
        text = server.tokenizer.decode(prompt) + text
    usage = gen.usage()
    usage["prompt_tokens_details"]["scored_tokens"] = len(scored.ids)
    return shape.full(text=text, ids=ids, finish_reason=reason, usage_=usage,
                      prompt_ids=prompt, logprobs=logprobs)



def stream_chunks(body: dict[str, Any], shape: Any, chat: bool) -> list[dict[str, Any]]:
    """A scored (non-streamed) ``body`` as stream chunks: one per token with its text and
    logprobs when the tokens' texts make up the text exactly (else one chunk with all of them),
    then the finish reason."""
    choice = body["choices"][0]
    text = choice["message"]["content"] if chat else choice["text"]
    lp = choice["logprobs"]
    entries = lp["content"] if chat else list(zip(
        lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], lp["text_offset"], strict=True))
    pieces = [e["token"] for e in entries] if chat else [e[0] for e in entries]
    if "".join(pieces) != text:  # a character split over tokens: one chunk
        pieces, groups = [text], [entries]
    else:
        groups = [[e] for e in entries]
    chunks = []
    ids = choice.get("token_ids") or []
    for i, (piece, group) in enumerate(zip(pieces, groups, strict=True)):
        if chat:
            logprobs = {"content": group}
        else:
            tokens, values, tops, offsets = (list(x) for x in zip(*group, strict=True))
            logprobs = {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
                        "text_offset": offsets}
        part = ids[i:i + 1] if len(groups) == len(entries) == len(ids) else []
        chunks.append(shape.chunk(text=piece, ids=part, logprobs=logprobs))
    return chunks + [shape.chunk(finish_reason=choice["finish_reason"])]
