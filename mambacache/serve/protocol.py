"""Request bodies of the OpenAI API as strict pydantic models, and their validation errors as
OpenAI-shaped HTTP 400 bodies that name the field and the limit.

Every field the server reads is declared here, with the engine's
bounds (``engine/sampling/params.py``), so a request the protocol accepts always packs
(penalties included: ``presence_penalty`` / ``frequency_penalty`` in [-2, 2],
``repetition_penalty`` in (0, 2]). Top logprobs (up to ``TOP_LOGPROBS_LIMIT``) and
``echo`` are served by ``scored_logprobs.py``; ``response_format`` and a forced
``tool_choice`` by ``structured.py``.
Unknown fields are kept aside (``extra="allow"``), never a 400: ``lenient.py`` logs them once
per name and the response lists them in a header.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from mambacache.engine.sampling.params import (
    MAX_NEW_TOKENS_LIMIT,
    MAX_STOP_TOKEN_IDS,
    PENALTY_LIMIT,
    REPETITION_PENALTY_LIMIT,
    SEED_LIMIT,
    TOKEN_ID_MAX,
    TOP_K_LIMIT,
)

MAX_STOP_STRINGS = 16
TOP_LOGPROBS_LIMIT = 20  # OpenAI's; engine/runners/scoring.py MAX_TOP_N
N_LIMIT = 16  # choices per prompt


class ApiError(Exception):
    """An error answered as ``{"error": {message, type, param, code}}`` with ``status``."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400,
                 type: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message, self.param, self.status = message, param, status
        self.type, self.code, self.headers = type, code, headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # unknown names: lenient.py


class StreamOptions(StrictModel):
    include_usage: bool = False


TokenId = Annotated[int, Field(ge=0, le=TOKEN_ID_MAX)]
MaxTokens = Annotated[int, Field(ge=1, le=MAX_NEW_TOKENS_LIMIT)]


class SamplingFields(StrictModel):
    """Fields shared by both endpoints (OpenAI's names; ``top_k``, ``ignore_eos``,
    ``stop_token_ids``, ``return_token_ids`` are the usual server extensions; ``cache_salt``,
    vLLM's: requests match only cached prefixes sent with the same salt)."""

    model: str | None = None
    max_tokens: MaxTokens | None = None
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1, le=TOP_K_LIMIT)
    seed: int | None = Field(default=None, ge=0, lt=SEED_LIMIT)
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=N_LIMIT)  # n > 1: choices.py
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(default=0.0, ge=-PENALTY_LIMIT, le=PENALTY_LIMIT)
    frequency_penalty: float = Field(default=0.0, ge=-PENALTY_LIMIT, le=PENALTY_LIMIT)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=REPETITION_PENALTY_LIMIT)
    response_format: dict[str, Any] | None = None  # structured.py
    user: str | None = None
    ignore_eos: bool = False
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    return_token_ids: bool = False
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)

    @field_validator("stop", mode="before")
    @classmethod
    def at_most_max_stop_strings(cls, value: Any) -> Any:
        """The count first: a long list otherwise fails as "not a valid string" (the union)."""
        if isinstance(value, list) and len(value) > MAX_STOP_STRINGS:
            raise ValueError(f"{len(value)} stop strings, the limit is {MAX_STOP_STRINGS}")
        return value

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``: one prompt, as text or token ids."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=TOP_LOGPROBS_LIMIT)
    echo: bool = False
    best_of: int | None = Field(default=None, ge=1, le=1)


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class Message(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatRequest(SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=TOP_LOGPROBS_LIMIT)


def _param(loc: tuple[Any, ...]) -> str:
    """``("messages", 0, "content")`` -> ``"messages[0].content"`` (union branch names dropped)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not any(c in part for c in "[]()-") and part not in ("str", "int", "float", "bool"):
            out += f".{part}" if out else part
    return out


def parse_request(body: bytes, model: type[StrictModel]) -> Any:
    """The validated request, or an ``ApiError`` naming the first bad field and its limit."""
    try:
        return model.model_validate_json(body)
    except ValidationError as err:
        first = err.errors(include_url=False)[0]
        if first["type"] == "json_invalid":
            raise ApiError(f"malformed JSON body: {first['msg']}") from None
        if first["type"] == "model_type":
            raise ApiError("the body must be a JSON object") from None
        param = _param(first["loc"])
        if first["type"] == "extra_forbidden":
            raise ApiError(f"unknown field {param!r}", param=param) from None
        got = first.get("input")
        got_text = repr(got) if len(repr(got)) <= 80 else repr(got)[:77] + "..."
        raise ApiError(f"{param}: {first['msg']} (got {got_text})", param=param) from None


def single_prompt(prompt: str | list[int] | list[str] | list[list[int]]) -> str | list[int]:
    """The one prompt of a completion request (a batch of one is unwrapped)."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            raise ApiError(f"prompt: a batch of {len(prompt)} prompts; this server takes 1 "
                           "per request", param="prompt")
        prompt = prompt[0]
    if len(prompt) == 0:
        raise ApiError("prompt: must not be empty", param="prompt")
    return prompt
