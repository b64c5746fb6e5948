"""OpenAI's request and response shapes: what comes in (pydantic models, checked at the door) and the
JSON that goes out (plain dicts built by small functions), field for field as OpenAI's API reference
gives them, so the official client and every OpenAI-speaking tool read our answers unchanged."""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..inference.sampling import SamplingParams


class ErrorResponse(Exception):
    """An OpenAI error object on its way out: {"error": {"message", "type", "param", "code"}} + status."""

    TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
             429: "rate_limit_exceeded", 500: "server_error", 503: "server_error"}

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """The fields both endpoints share. Unknown fields are ignored, as OpenAI's own server does."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None  # -1 or 0: off (vLLM's convention)
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0)] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    n: Annotated[int, Field(ge=1, le=16)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # structured output (server/structured.py): OpenAI's response_format, vLLM's guided_* fields
    response_format: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(s == "" for s in stops):
            raise ErrorResponse(400, "stop strings must not be empty", param="stop")
        if len(stops) > 4:
            raise ErrorResponse(400, f"stop has {len(stops)} strings; at most 4 are allowed", param="stop")
        return stops

    def sampling_params(self, max_tokens: int, choice: int, structured=None) -> SamplingParams:
        """One choice's SamplingParams: choice j of a seeded request draws with seed + j, so the n
        choices differ from each other and each is reproducible. EOS is not among the stop ids here:
        the engine was given the tokenizer's EOS and adds it (unless ignore_eos)."""
        stops = tuple(self.stop_token_ids or ())
        top_k = self.top_k if self.top_k not in (None, -1, 0) else None
        try:
            return SamplingParams(
                temperature=1.0 if self.temperature is None else self.temperature, top_k=top_k,
                top_p=self.top_p, min_p=self.min_p or None, repetition_penalty=self.repetition_penalty,
                max_tokens=max_tokens, stop_token_ids=stops,
                ignore_eos=self.ignore_eos, seed=None if self.seed is None else self.seed + choice,
                structured=structured,
            )
        except (TypeError, ValueError) as err:
            raise ErrorResponse(400, str(err)) from None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingFields):
    # text, several texts, token ids, or several lists of token ids
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    # a string, or OpenAI's list of content parts of which only {"type": "text"} is understood here
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            parts = [p for p in self.content if p.get("type") == "text"]
            if len(parts) != len(self.content):
                raise ErrorResponse(400, "only text content parts are supported", param="messages")
            return "".join(str(p.get("text", "")) for p in parts)
        return self.content or ""


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    add_generation_prompt: bool = True


# ------------------------------------------------------------------------------------ responses
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_response(rid: str, model: str, choices: list[dict], use: dict) -> dict:
    """choices: [{"text", "finish_reason"}] in choice order."""
    return {"id": rid, "object": "text_completion", "created": now(), "model": model,
            "choices": [{"index": i, "text": c["text"], "logprobs": None, "finish_reason": c["finish_reason"]}
                        for i, c in enumerate(choices)],
            "usage": use}


def completion_chunk(rid: str, model: str, created: int, index: int, text: str, finish_reason: str | None,
                     with_usage: bool) -> dict:
    choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}
    return _stream_chunk(rid, "text_completion", model, created, choice, with_usage)


def chat_response(rid: str, model: str, choices: list[dict], use: dict) -> dict:
    return {"id": rid, "object": "chat.completion", "created": now(), "model": model,
            "choices": [{"index": i, "message": {"role": "assistant", "content": c["text"]},
                         "logprobs": None, "finish_reason": c["finish_reason"]} for i, c in enumerate(choices)],
            "usage": use}


def chat_chunk(rid: str, model: str, created: int, index: int, delta: dict, finish_reason: str | None,
               with_usage: bool) -> dict:
    choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    return _stream_chunk(rid, "chat.completion.chunk", model, created, choice, with_usage)


def _stream_chunk(rid: str, obj: str, model: str, created: int, choice: dict, with_usage: bool) -> dict:
    """One streamed chunk of either endpoint: the envelope around the one choice it carries."""
    chunk = {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}
    if with_usage:  # OpenAI sends "usage": null on every chunk but the last when include_usage is on
        chunk["usage"] = None
    return chunk


def usage_chunk(rid: str, obj: str, model: str, created: int, use: dict) -> dict:
    """The last chunk of a stream with include_usage: no choices, the whole request's usage."""
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": use}


def models_response(model: str, max_model_len: int) -> dict:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": now(),
                                        "owned_by": "mini-transformer", "max_model_len": max_model_len}]}
